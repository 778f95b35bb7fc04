"""The autoencoder protocol: what funhooks asks of a sparse autoencoder.

An SAE is any object with ``encode(x) -> features`` and ``decode(features) -> x_hat`` over
the last dimension (``(..., d_in) -> (..., d_sae) -> (..., d_in)``): a user's ``nn.Module``,
or an SAELens ``SAE`` as it is (its ``encode``/``decode`` are these). Its widths are read, when
it says them, from ``cfg.d_in``/``cfg.d_sae`` (SAELens), ``d_in``/``d_sae`` attributes, or the
shapes of ``W_enc`` ``(d_in, d_sae)`` / ``W_dec`` ``(d_sae, d_in)``; an SAE that says none is
checked by the shapes its calls return. Its place (device and dtype) is that of its first
parameter or buffer: activations are moved there before ``encode`` and results back after.
Per-head values ``(..., heads, d_head)`` reach an SAE as wide as all the heads flattened, unless
it flattens them itself (SAELens' ``hook_z`` SAEs, ``hook_z_reshaping_mode``): it gets them as
they are. Features come dense: a sparse ``encode`` (SAELens' TopK training SAEs with
``use_sparse_activations``) is made dense before an edit, a record or a sum sees it.

Cost: reading the widths and the place is attribute loads, once per splice; per call, the
heads' check is a few shape reads.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs
import torch
from torch import Tensor

from funhooks import _frozen
from funhooks.errors import SpecError

__all__ = ["Autoencoder", "Shape", "as_read", "encoded", "shape_of"]


@runtime_checkable
class Autoencoder(Protocol):
    """What a sparse autoencoder offers funhooks (an SAELens ``SAE`` is one)."""

    def encode(self, x: Tensor) -> Tensor:
        """The feature activations of `x`, ``(..., d_in) -> (..., d_sae)``."""

    def decode(self, features: Tensor) -> Tensor:
        """The reconstruction from `features`, ``(..., d_sae) -> (..., d_in)``."""


@_frozen.frozen
@attrs.frozen
class Shape:
    """What funhooks knows of an SAE: its widths (0 where it does not say them) and the
    device and dtype its activations are moved to (None: left where they are)."""

    d_in: int
    d_sae: int
    device: torch.device | None
    dtype: torch.dtype | None


def _width(sae: object, name: str, weight: str, axis: int) -> int:
    for holder in (getattr(sae, "cfg", None), sae):
        value = getattr(holder, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    w = getattr(sae, weight, None)
    return int(w.shape[axis]) if isinstance(w, Tensor) and w.ndim == 2 else 0


def shape_of(sae: object, caller: str) -> Shape:
    """The widths and place of `sae`; a SpecError naming the fix when it has no
    ``encode``/``decode`` methods."""
    missing = [m for m in ("encode", "decode") if not callable(getattr(sae, m, None))]
    if missing:
        raise SpecError(
            f"{caller}: an SAE is an object with `encode(x) -> features` and `decode(features) -> x_hat` "
            f"(an `nn.Module` of yours, or an SAELens `SAE`), got a {type(sae).__name__} without "
            f"{' and '.join(f'`{m}`' for m in missing)}. Give it those two methods (docs/saes.md)."
        )
    try:
        hash(sae)
    except TypeError:
        raise SpecError(f"{caller}: an SAE is hashable (a spec holding it is a value), got an unhashable "
                        f"{type(sae).__name__}. Use an `nn.Module` (hashed by identity).") from None
    place: Tensor | None = None
    if isinstance(sae, torch.nn.Module):
        place = next(iter(sae.parameters()), None)
        if place is None:
            place = next(iter(sae.buffers()), None)
    d_in = _width(sae, "d_in", "W_enc", 0) or _width(sae, "d_in", "W_dec", 1)
    d_sae = _width(sae, "d_sae", "W_enc", 1) or _width(sae, "d_sae", "W_dec", 0)
    if place is None or not place.is_floating_point():
        return Shape(d_in, d_sae, None if place is None else place.device, None)
    return Shape(d_in, d_sae, place.device, place.dtype)


def as_read(sae: object, d_in: int, x: Tensor, caller: str) -> tuple[Tensor, int]:
    """`x` as `sae` reads it, and the width it reads: heads ``(..., heads, d_head)`` of an SAE
    as wide as all of them flattened, unless the SAE flattens them itself (SAELens' ``hook_z``
    SAEs), which then cannot take them flattened (a SpecError naming SAELens' switch). The rule
    ``splice`` and ``evaluate`` share (not re-exported by ``funhooks.sae``)."""
    itself = getattr(sae, "hook_z_reshaping_mode", False) is True
    if d_in and x.ndim >= 2 and x.shape[-1] != d_in and x.shape[-2] * x.shape[-1] == d_in:
        return (x if itself else x.flatten(-2)), d_in
    if itself and x.shape[-1] == d_in:
        raise SpecError(
            f"{caller}: the {type(sae).__name__} flattens per-head values `(..., heads, d_head)` itself (SAELens' "
            f"hook_z mode), got values already flattened, of shape {tuple(x.shape)}. Pass the heads unflattened "
            "(a per-head point: `pts.z`, `hook_z`), or call `sae.turn_off_forward_pass_hook_z_reshaping()` for "
            "flattened activations."
        )
    return x, x.shape[-1]



def encoded(sae: Autoencoder, x: Tensor) -> Tensor:
    """``sae.encode(x)``, dense: a sparse result (SAELens' TopK training SAEs with
    ``use_sparse_activations`` return a COO tensor) is made dense, as the feature edits, the
    recorded features and ``evaluate``'s sums take it; ``decode`` takes either. The rule
    ``splice`` and ``evaluate`` share (not re-exported by ``funhooks.sae``)."""
    f = sae.encode(x)
    return f.to_dense() if f.layout != torch.strided else f
