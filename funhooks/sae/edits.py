"""Feature edits: what a spliced SAE does to its feature activations before decoding them.

An edit is a value called on the feature tensor ``(..., d_sae)`` that returns the edited
tensor, a new one (no in-place write, so it is differentiable and ``vmap``-able):
:func:`ablate`, :func:`steer`, :func:`scale` and :func:`patch` are funhooks' own, each on some
features (None: all of them) and, with `positions`, on those positions only (the second last
dimension: a sequence's positions for ``(batch, position, d_sae)``). Any hashable function
``features -> features`` is an edit too; a list of edits applies them in order.

Cost: per call, one ``torch.where`` the size of the features, and a mask made per call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, TypeAlias

import attrs
import torch
from torch import Tensor

from funhooks import _frozen
from funhooks.errors import SpecError

__all__ = ["Edit", "FeatureEdit", "ablate", "patch", "scale", "steer"]

Edit: TypeAlias = "Callable[[Tensor], Tensor] | Sequence[Callable[[Tensor], Tensor]]"
"""What ``splice(edit=...)`` takes: a feature edit, any hashable ``features -> features``
function, or a list of them applied in order."""
_Ids: TypeAlias = "int | Sequence[int] | None"


def _ids(caller: str, name: str, ids: object) -> tuple[int, ...] | None:
    if ids is None:
        return None
    items = [ids] if isinstance(ids, int) else list(ids) if isinstance(ids, (list, tuple, range)) else None
    if not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise SpecError(f"{caller}: `{name}` is an int or a non-empty list of ints, got {ids!r}. Pass feature "
                        "indices (positions: indices along the positions dimension).")
    return tuple(items)


def _operand(caller: str, name: str, value: object) -> Tensor | float:
    if isinstance(value, Tensor):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise SpecError(f"{caller}: `{name}` is a number or a tensor, got {value!r}. Pass one.")


@_frozen.frozen
@attrs.frozen(eq=False, repr=False)
class FeatureEdit:
    """One edit of feature activations (made by :func:`ablate`, :func:`steer`, :func:`scale`
    or :func:`patch`); compared by identity, like any value that may hold a tensor."""

    kind: Literal["ablate", "steer", "scale", "patch"]
    features: tuple[int, ...] | None
    value: Tensor | float = 0.0
    positions: tuple[int, ...] | None = None
    _kept: _Kept = attrs.field(factory=lambda: _Kept(), init=False)

    def __repr__(self) -> str:
        parts = [] if self.features is None else [repr(list(self.features))]
        if self.kind != "ablate":
            parts.append(f"<Tensor of shape {tuple(self.value.shape)}>" if isinstance(self.value, Tensor)
                         else repr(self.value))
        if self.positions is not None:
            parts.append(f"positions={list(self.positions)!r}")
        return f"fh.sae.{self.kind}({', '.join(parts)})"

    def __call__(self, f: Tensor) -> Tensor:
        """The edited features: a new tensor of `f`'s shape and dtype."""
        mask, value = self._made(f)
        if self.kind == "ablate":
            new = torch.zeros((), dtype=f.dtype, device=f.device)
        elif self.kind == "steer":
            new = f + value
        elif self.kind == "scale":
            new = f * value
        else:
            new = value if isinstance(value, Tensor) else torch.tensor(value, dtype=f.dtype, device=f.device)
        return torch.where(mask, new, f).to(f.dtype)

    def _made(self, f: Tensor) -> tuple[Tensor, Tensor | float]:
        """The mask of the edited entries (features, positions) and the value on `f`'s device,
        made once per width, number of positions, device and dtype (kept, outside transforms)."""
        size = f.shape[-2] if self.positions is not None and f.ndim >= 2 else 0
        key = (f.shape[-1], size, f.device, f.dtype)
        made = self._kept.get(key)
        if made is None:
            made = self._kept[key] = self._make(f.shape[-1], size, f.device, f.dtype)
        return made

    def _make(self, n: int, size: int, device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor | float]:
        mask = torch.ones(n, dtype=torch.bool, device=device)
        value = self.value if not isinstance(self.value, Tensor) else self.value.to(device, dtype)
        if self.features is not None:
            ids = torch.tensor(self.features, device=device) % n
            mask = torch.zeros(n, dtype=torch.bool, device=device).index_fill(0, ids, True)
            if isinstance(value, Tensor) and value.ndim and value.shape[-1] == len(self.features) != n:
                value = torch.zeros(n, dtype=dtype, device=device).index_copy(0, ids, value.reshape(-1))
        if size:
            at = torch.zeros(size, dtype=torch.bool, device=device).index_fill(
                0, torch.tensor(self.positions, device=device) % size, True)
            mask = at[:, None] & mask
        return mask, value


class _Kept(dict):
    """A feature edit's masks, by width, positions, device and dtype; copies and pickles start empty."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _Kept, ()


def ablate(features: _Ids = None, *, positions: _Ids = None) -> FeatureEdit:
    """Zero `features` (None: all), at `positions` (None: all).

    Example:
        >>> import torch, funhooks as fh
        >>> fh.sae.ablate([0, 2])(torch.ones(1, 4))
        tensor([[0., 1., 0., 1.]])
    """
    return FeatureEdit("ablate", _ids("ablate", "features", features), 0.0, _ids("ablate", "positions", positions))


def steer(features: _Ids, by: float | Tensor, *, positions: _Ids = None) -> FeatureEdit:
    """Add `by` to `features` (a number, or one value per feature listed). With a linear
    decoder this adds ``by * W_dec[feature]`` to the point: the feature's direction.

    Example:
        >>> import torch, funhooks as fh
        >>> fh.sae.steer(1, 5.0, positions=-1)(torch.zeros(2, 3))
        tensor([[0., 0., 0.],
                [0., 5., 0.]])
    """
    return FeatureEdit("steer", _ids("steer", "features", features), _operand("steer", "by", by),
                       _ids("steer", "positions", positions))


def scale(features: _Ids, factor: float | Tensor, *, positions: _Ids = None) -> FeatureEdit:
    """Multiply `features` by `factor`.

    Example:
        >>> import torch, funhooks as fh
        >>> fh.sae.scale([1], 3.0)(torch.ones(3))
        tensor([1., 3., 1.])
    """
    return FeatureEdit("scale", _ids("scale", "features", features), _operand("scale", "factor", factor),
                       _ids("scale", "positions", positions))


def patch(features: _Ids, value: float | Tensor, *, positions: _Ids = None) -> FeatureEdit:
    """Set `features` to `value` (a number, a tensor broadcast to the features, or one value
    per feature listed): e.g. the features a clean run recorded, patched into a corrupted one.

    Example:
        >>> import torch, funhooks as fh
        >>> fh.sae.patch([0, 1], torch.tensor([7.0, 8.0]))(torch.zeros(3))
        tensor([7., 8., 0.])
    """
    return FeatureEdit("patch", _ids("patch", "features", features), _operand("patch", "value", value),
                       _ids("patch", "positions", positions))
