"""Evaluating an SAE: reconstruction, sparsity, and what it costs the model downstream.

``evaluate(sae, activations)`` reads batches of activations ``(..., d_in)`` (a list of tensors,
a ``DataLoader``, an ``fh.ActivationStream``) and gives a :class:`Reconstruction`;
``evaluate(sae, batches, model=model, where=point)`` runs the model on batches of tokens and
gives an :class:`Evaluation`, which adds the downstream numbers. The definitions are SAELens'
(``sae_lens.evals``), over every row (token) of the data, each weighted equally:

- ``mse``: the mean over rows of ``||x - x_hat||^2`` (summed over the width);
- ``explained_variance``: ``1 - mse / (E||x||^2 - ||E x||^2)``, the total variance of the rows;
- ``l0``: the mean number of non-zero features per row;
- ``density``: per feature, the fraction of rows where it is non-zero; ``dead``: the features
  with density below `dead_below`, ``dense``: above `dense_above`;
- ``ce_clean`` / ``ce_spliced`` / ``ce_ablated``: the next-token cross-entropy of the model, of the
  model run on the SAE's reconstruction at the point (no error term), and with the point
  zero-ablated; ``ce_loss_recovered = (ce_ablated - ce_spliced) / (ce_ablated - ce_clean)``;
- ``kl`` / ``kl_ablated``: the mean over positions of ``KL(clean || spliced)`` and
  ``KL(clean || ablated)`` of the next-token distributions; ``kl_recovered = 1 - kl / kl_ablated``.

With an ``attention_mask`` (a dict batch) only its positions count. Sums are kept in float64 on
the host. Runs under ``torch.no_grad()``, the model in the mode it is in (``model.eval()`` first).

Cost: per batch of tokens three forwards (clean, spliced, ablated) and one encode and decode
of the recorded activations; per batch of activations one encode and one decode.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from funhooks import _frozen
from funhooks.errors import SpecError
from funhooks.runs import capture
from funhooks.specs import ablate, outputs
from funhooks.transformer import Point

from .protocol import Shape, as_read, encoded, shape_of
from .splicing import splice

__all__ = ["Evaluation", "Reconstruction", "evaluate"]

_CALLER = "sae.evaluate"


@_frozen.frozen
@attrs.frozen(repr=False, eq=False)
class Reconstruction:
    """How well an SAE reconstructs a dataset's activations (see the module's definitions)."""

    rows: int
    mse: float
    explained_variance: float
    l0: float
    density: Tensor
    """Per feature, the fraction of rows where it is non-zero (float64, on the CPU)."""
    dead_below: float
    dense_above: float

    @property
    def dead(self) -> int:
        """The number of features with density below `dead_below`."""
        return int((self.density < self.dead_below).sum())

    @property
    def dense(self) -> int:
        """The number of features with density above `dense_above`."""
        return int((self.density > self.dense_above).sum())

    def _lines(self) -> list[str]:
        n = len(self.density)
        return [f"  rows                {self.rows}",
                f"  mse                 {self.mse:.6g}",
                f"  explained variance  {self.explained_variance:.4f}",
                f"  L0                  {self.l0:.2f} of {n} features",
                f"  dead                {self.dead} (density < {self.dead_below:g})",
                f"  dense               {self.dense} (density > {self.dense_above:g})"]

    def __repr__(self) -> str:
        return "\n".join([f"{type(self).__name__}("] + self._lines() + [")"])


@_frozen.frozen
@attrs.frozen(repr=False, eq=False)
class Evaluation(Reconstruction):
    """A :class:`Reconstruction` and the SAE's cost to the model when spliced in."""

    ce_clean: float = 0.0
    ce_spliced: float = 0.0
    ce_ablated: float = 0.0
    kl: float = 0.0
    kl_ablated: float = 0.0

    @property
    def ce_loss_recovered(self) -> float:
        """``(ce_ablated - ce_spliced) / (ce_ablated - ce_clean)``: 1 is the clean model's loss,
        0 the zero-ablated point's; NaN where ablating changes no loss."""
        gap = self.ce_ablated - self.ce_clean
        return (self.ce_ablated - self.ce_spliced) / gap if gap else float("nan")

    @property
    def kl_recovered(self) -> float:
        """``1 - kl / kl_ablated`` (SAELens' ``kl_div_score``); NaN where ablating changes nothing."""
        return 1.0 - self.kl / self.kl_ablated if self.kl_ablated else float("nan")

    def _lines(self) -> list[str]:
        return super()._lines() + [
            f"  CE loss             clean {self.ce_clean:.4f}, spliced {self.ce_spliced:.4f}, "
            f"ablated {self.ce_ablated:.4f}",
            f"  CE loss recovered   {self.ce_loss_recovered:.4f}",
            f"  KL to clean         {self.kl:.6g} (ablated {self.kl_ablated:.6g}, recovered {self.kl_recovered:.4f})"]


class _Sums:
    """The running float64 sums of the reconstruction metrics."""

    def __init__(self) -> None:
        self.rows = 0
        self.resid = self.norm = self.l0 = 0.0
        self.total: Tensor | None = None
        self.active: Tensor | None = None

    def add(self, x: Tensor, f: Tensor, x_hat: Tensor) -> None:
        x, f, x_hat = x.double(), f, x_hat.double()
        self.rows += x.shape[0]
        self.resid += float((x - x_hat).pow(2).sum())
        self.norm += float(x.pow(2).sum())
        total = x.sum(0).cpu()
        nonzero = f != 0
        self.l0 += float(nonzero.sum())
        active = nonzero.sum(0).double().cpu()
        self.total = total if self.total is None else self.total + total
        self.active = active if self.active is None else self.active + active

    def fields(self) -> dict[str, Any]:
        if not self.rows or self.total is None or self.active is None:
            raise SpecError(f"{_CALLER}: the data holds no rows to evaluate the SAE on, got none. Pass a non-empty "
                            "iterable of batches.")
        n = self.rows
        mse = self.resid / n
        variance = self.norm / n - float((self.total / n).pow(2).sum())
        explained = (1.0 if mse < 1e-10 else 0.0) if variance < 1e-10 else 1.0 - mse / variance
        return {"rows": n, "mse": mse, "explained_variance": explained, "l0": self.l0 / n,
                "density": self.active / n}


def _rows(sae: Any, shape: Shape, x: Tensor, keep: Tensor | None, sums: _Sums) -> None:
    """Encode and decode `x` (rows: its leading dims, or those of `keep`) into `sums`."""
    x, width = as_read(sae, shape.d_in, x, _CALLER)  # heads, for an SAE as wide as all of them
    if shape.d_in and width != shape.d_in:
        raise SpecError(f"{_CALLER}: the SAE reads vectors of its width d_in={shape.d_in}, got activations of "
                        f"width {width} (shape {tuple(x.shape)}) for the {type(sae).__name__}. Evaluate it on "
                        "the activations of the point it was trained on.")
    xs = x if shape.device is None and shape.dtype is None else x.to(device=shape.device, dtype=shape.dtype)
    f = encoded(sae, xs)
    x_hat = sae.decode(f)
    if xs.ndim > f.ndim:  # heads the SAE flattened itself
        xs, x_hat = xs.flatten(f.ndim - 1), x_hat.flatten(f.ndim - 1)
    lead = 1 if keep is None else keep.ndim
    flat = (lambda t: t.reshape(-1, *t.shape[-1:])) if keep is None else (lambda t: t.reshape(-1, *t.shape[lead:]))
    xs, f, x_hat = flat(xs), flat(f), flat(x_hat)
    if keep is not None:
        at = keep.reshape(-1).to(xs.device).bool()
        xs, f, x_hat = xs[at], f[at], x_hat[at]
    sums.add(xs.reshape(len(xs), -1), f.reshape(len(f), -1), x_hat.reshape(len(x_hat), -1))


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    if isinstance(out, (tuple, list)) and isinstance(out[0], Tensor):
        return out[0]
    raise SpecError(f"{_CALLER}: the model returns logits (a tensor, or an output with `.logits`), got a "
                    f"{type(out).__name__}. Pass a language model with its head.")


def _call(fn: Any, batch: Any) -> tuple[Tensor, Any]:
    out, rec = fn(**batch) if isinstance(batch, Mapping) else fn(batch)
    return _logits(out).double(), rec


class _Downstream:
    """The running sums of the downstream metrics."""

    def __init__(self) -> None:
        self.tokens = self.positions = 0
        self.ce = [0.0, 0.0, 0.0]
        self.kl = [0.0, 0.0]

    def add(self, ids: Tensor, mask: Tensor | None, clean: Tensor, spliced: Tensor, ablated: Tensor) -> None:
        keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device) if mask is None else mask.bool()
        target = keep[:, 1:]
        self.tokens += int(target.sum())
        for i, logits in enumerate((clean, spliced, ablated)):
            ce = nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none")
            self.ce[i] += float(ce[target].sum())
        self.positions += int(keep.sum())
        p = clean.log_softmax(-1)
        for i, logits in enumerate((spliced, ablated)):
            kl = nn.functional.kl_div(logits.log_softmax(-1), p, reduction="none", log_target=True).sum(-1)
            self.kl[i] += float(kl[keep].sum())


def _key(where: object) -> str:
    if isinstance(where, Point):
        if len(where.keys) != 1:
            raise SpecError(f"{_CALLER}: an SAE is evaluated at one place, got `{where!r}` holding {len(where.keys)} "
                            f"layers. Index the point: `pts.{where.name}[3]`.")
        return where.keys[0]
    if isinstance(where, str) and where and "*" not in where:
        return where
    raise SpecError(f"{_CALLER}: `where` is a standard point of one layer (`pts.resid_post[3]`) or a module path "
                    f"without wildcards, got {where!r}. Pass one of those.")


def evaluate(sae: Any, data: Iterable[Any], *, model: nn.Module | None = None, where: Point | str | None = None,
             column: str | None = None, dead_below: float = 1e-8, dense_above: float = 0.1) -> Reconstruction:
    """Evaluate `sae` over `data`: activations, or (with `model` and `where`) token batches.

    Args:
        sae: an object with ``encode``/``decode`` (see ``protocol``).
        data: an iterable of batches: of activations ``(..., d_in)`` (tensors, or the dicts of
            columns an ``fh.ActivationStream`` gives: its only column, or `column`), or with
            `model` of token ids ``(batch, position)`` (tensors, or dicts of the model's keyword
            arguments holding ``input_ids`` and perhaps ``attention_mask``).
        model: a language model returning logits; with `where`, the SAE is evaluated at that
            point of it.
        where: a standard point of one layer (``pts.resid_post[3]``) or a module path.
        column: the column of a dict batch of activations.
        dead_below, dense_above: the density thresholds of dead and dense features.

    Returns:
        A :class:`Reconstruction`, or with `model` an :class:`Evaluation`.

    Raises:
        SpecError: for a bad SAE or `where`, activations of another width, no rows.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> class Identity(nn.Module):                 # a perfect, dense "SAE"
        ...     def encode(self, x):
        ...         return x
        ...     def decode(self, f):
        ...         return f
        >>> result = fh.sae.evaluate(Identity(), [torch.randn(10, 4), torch.randn(6, 4)])
        >>> result.rows, result.mse, result.explained_variance, result.l0
        (16, 0.0, 1.0, 4.0)
    """
    shape = shape_of(sae, _CALLER)
    if (model is None) != (where is None):
        raise SpecError(f"{_CALLER}: `model` and `where` come together (the point of the model to splice the SAE "
                        f"at), got only {'model' if where is None else 'where'}. Pass both, or neither to evaluate "
                        "on activations.")
    for name, value in (("dead_below", dead_below), ("dense_above", dense_above)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise SpecError(f"{_CALLER}: `{name}` is a density in [0, 1], got {value!r}. Pass a fraction of rows.")
    sums = _Sums()
    thresholds: dict[str, Any] = {"dead_below": float(dead_below), "dense_above": float(dense_above)}
    with torch.no_grad():
        if model is None:
            for batch in data:
                x = batch
                if isinstance(batch, Mapping):  # a store's rows: the named column, or the only one
                    x = batch[column] if column is not None else next(iter(batch.values())) if len(batch) == 1 else None
                if not isinstance(x, Tensor):
                    raise SpecError(f"{_CALLER}: a batch of activations is a tensor (or a dict with `column=`), got "
                                    f"a {type(batch).__name__}. Pass tensors, or name the column.")
                _rows(sae, shape, x, None, sums)
            return Reconstruction(**sums.fields(), **thresholds)
        key = _key(where)
        clean_fn = capture(model, outputs(where))  # type: ignore[arg-type]  # a Point is a where-value
        spliced_fn = capture(model, splice(where, sae, error=False, record=False))  # type: ignore[arg-type]
        ablated_fn = capture(model, ablate(where))  # type: ignore[arg-type]
        down = _Downstream()
        for batch in data:
            ids = batch["input_ids"] if isinstance(batch, Mapping) else batch
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            clean, rec = _call(clean_fn, batch)
            x = rec[key]["output"]
            _rows(sae, shape, x if isinstance(x, Tensor) else x[0], torch.ones(ids.shape, dtype=torch.bool)
                  if mask is None else mask, sums)
            down.add(ids, mask, clean, _call(spliced_fn, batch)[0], _call(ablated_fn, batch)[0])
        return Evaluation(**sums.fields(), **thresholds, ce_clean=down.ce[0] / down.tokens,
                          ce_spliced=down.ce[1] / down.tokens, ce_ablated=down.ce[2] / down.tokens,
                          kl=down.kl[0] / down.positions, kl_ablated=down.kl[1] / down.positions)
