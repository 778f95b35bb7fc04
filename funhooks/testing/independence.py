"""Independence invariants: the output for one example does not depend on the others
(batch independence), and the output at a position does not depend on later positions
(causality).

Each check draws an input and a second one, splices part of the second into a copy of the
first (one example; every position after ``t``), runs the model on both from the same
buffers and random seed (dropout draws the same masks), and compares the parts of the
outputs that must not move. On failure it blames the innermost module whose inputs still
agree there but whose output does not (see ``_pair``), and raises ``AssertionError``
whose first line names the invariant and that module, followed by the shrunk input.
Afterwards buffers, train/eval modes and the random state are as before; no hook is left.

Cost: two forward passes per drawn input, without gradients; on failure, shrinking (tens
to a few hundred pairs of passes) and two recorded passes that keep a copy of every
module's inputs and outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from funhooks.errors import SpecError

from . import _invariant
from . import _pair

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis
    from hypothesis.strategies import SearchStrategy

__all__ = ["check_batch_independence", "check_causality"]

_INDEX = 2**16
"""Which example or position to change is drawn below this and reduced modulo the size."""


class _Draw(NamedTuple):
    """One draw of an independence check: an input, a second one to take the changed part
    from, and which example or position to change (below :data:`_INDEX`, before the modulo)."""

    first: object
    second: object
    at: int


def _batch_size(args: tuple, dim: int, caller: str, what: str, least: int) -> int:
    sizes = [t.shape[dim] for t in args if _has_dim(t, dim)]
    if not sizes or sizes[0] < least:
        raise SpecError(
            f"{caller}: the inputs have at least {least} {what} along dim {dim}, got shapes "
            f"{[tuple(t.shape) for t in args if isinstance(t, torch.Tensor)]}. Draw larger inputs."
        )
    return sizes[0]


def _has_dim(t: object, dim: int) -> bool:
    return isinstance(t, torch.Tensor) and -t.dim() <= dim < t.dim()


def _spliced(args: tuple, other: tuple, dim: int, size: int, index: slice) -> tuple:
    """`args` with the `index` positions along `dim` taken from `other` (tensors of `size` there)."""
    out = []
    for a, b in zip(args, other):
        if _has_dim(a, dim) and a.shape[dim] == size:
            a = a.clone()
            a[(slice(None),) * (dim % a.dim()) + (index,)] = b[(slice(None),) * (dim % b.dim()) + (index,)]
        out.append(a)
    return tuple(out)


def check_batch_independence(model: nn.Module, inputs: _invariant.Inputs, *, batch_dim: int = 0,
                             rtol: float = _pair.RTOL, atol: float = _pair.ATOL, settings: hypothesis.settings | None = None,
                             seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that the output for one example does not depend on the other examples.

    For each drawn input it changes one example ``j`` (taken from a second draw) and checks
    that the output for every other example stays the same. It catches a ``view`` or
    ``transpose`` that mixes the batch, batch norm in training mode, statistics over the
    batch leaking into each example. Intermediate tensors are compared where their size
    along `batch_dim` is the batch size.

    Args:
        model: the model, in the mode to check (call ``model.eval()`` first for inference).
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors)
            whose shape and dtype the drawn inputs take.
        batch_dim: the batch dimension of the inputs and outputs.
        rtol, atol: tolerances of the comparison.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_batch_independence: ...`` naming the innermost
            module that first mixes examples; then the shrunk input and the changed example.
        SpecError: for `inputs` that are neither a strategy nor tensors, or a batch of one.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> fh.testing.check_batch_independence(model, torch.randn(4, 3))
    """
    caller = "check_batch_independence"
    st = _invariant.hypothesis().strategies
    drawn = _invariant.as_strategy(inputs, caller)
    pairs: SearchStrategy[_Draw] = st.tuples(drawn, drawn, st.integers(0, _INDEX)).map(_Draw._make)

    def layout(draw: _Draw) -> tuple[tuple, tuple, int, int]:
        args, other = _invariant.as_args(draw.first), _invariant.as_args(draw.second)
        size = _batch_size(args, batch_dim, caller, "examples", 2)
        return args, other, size, draw.at % size

    def runs(draw: _Draw) -> tuple[_pair.Run, _pair.Run]:
        args, other, size, j = layout(draw)
        changed = _spliced(args, other, batch_dim, size, slice(j, j + 1))
        return _pair.Run(args, _pair.SEED, None), _pair.Run(changed, _pair.SEED, None)

    def same_for(draw: _Draw) -> _pair.Same:
        _, _, size, j = layout(draw)
        keep = [i for i in range(size) if i != j]

        def same(a: torch.Tensor, b: torch.Tensor) -> bool | None:
            if not _has_dim(a, batch_dim) or a.shape != b.shape or a.shape[batch_dim] != size:
                return None
            rows = torch.tensor(keep, device=a.device)
            return _pair.close(a.index_select(batch_dim, rows), b.index_select(batch_dim, rows.to(b.device)),
                               rtol, atol)
        return same

    def describe(draw: _Draw) -> str:
        args, other, size, j = layout(draw)
        rows = tuple(b.select(batch_dim, j) for a, b in zip(args, other) if _has_dim(a, batch_dim) and a.shape[batch_dim] == size)
        return (f"input: {_invariant.show(draw.first)}\n"
                f"example {j} changed to: {_invariant.show(rows if len(rows) > 1 else rows[0])}")

    _pair.compare(caller, model, pairs, runs, same_for, describe=describe, settings=settings, seed=seed,
                  rule="the output for one example depends only on that example",
                  fix="Look for a reshape or transpose across the batch dimension, or statistics over the batch")


def check_causality(model: nn.Module, inputs: _invariant.Inputs, *, dim: int = 1, rtol: float = _pair.RTOL,
                    atol: float = _pair.ATOL, settings: hypothesis.settings | None = None,
                    seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that the output at position ``t`` along `dim` depends only on inputs at ``<= t``.

    For each drawn input it changes every position after a drawn ``t`` (taking them from a
    second draw) and checks that the output at positions ``0..t`` stays the same: the
    property a language model's attention mask guarantees. Intermediate tensors are
    compared where their size along `dim` is the input's length.

    Args:
        model: the model, in the mode to check.
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors),
            such as token ids ``torch.randint(0, vocab, (2, 8))``.
        dim: the sequence dimension of the inputs and outputs (``-1`` for ``(N, C, T)``).
        rtol, atol: tolerances of the comparison.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_causality: ...`` naming the innermost module
            that first reads ahead; then the shrunk input and the position ``t``.
        SpecError: for inputs shorter than 2 along `dim`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.ConstantPad1d((2, 0), 0.0), nn.Conv1d(2, 2, kernel_size=3))  # pads the past only
        >>> fh.testing.check_causality(model, torch.randn(1, 2, 6), dim=-1)
    """
    caller = "check_causality"
    st = _invariant.hypothesis().strategies
    drawn = _invariant.as_strategy(inputs, caller)
    pairs: SearchStrategy[_Draw] = st.tuples(drawn, drawn, st.integers(0, _INDEX)).map(_Draw._make)

    def layout(draw: _Draw) -> tuple[tuple, tuple, int, int]:
        args, other = _invariant.as_args(draw.first), _invariant.as_args(draw.second)
        length = _batch_size(args, dim, caller, "positions", 2)
        return args, other, length, draw.at % (length - 1)

    def runs(draw: _Draw) -> tuple[_pair.Run, _pair.Run]:
        args, other, length, t = layout(draw)
        changed = _spliced(args, other, dim, length, slice(t + 1, None))
        return _pair.Run(args, _pair.SEED, None), _pair.Run(changed, _pair.SEED, None)

    def same_for(draw: _Draw) -> _pair.Same:
        _, _, length, t = layout(draw)

        def same(a: torch.Tensor, b: torch.Tensor) -> bool | None:
            if not _has_dim(a, dim) or a.shape != b.shape or a.shape[dim] != length:
                return None
            return _pair.close(a.narrow(dim, 0, t + 1), b.narrow(dim, 0, t + 1), rtol, atol)
        return same

    def describe(draw: _Draw) -> str:
        args, other, length, t = layout(draw)
        changed = _spliced(args, other, dim, length, slice(t + 1, None))
        return (f"input: {_invariant.show(draw.first)}\ninput with positions {t + 1}.. changed: "
                f"{_invariant.show(changed if len(changed) > 1 else changed[0])}\nthe output at positions 0..{t} changed")

    _pair.compare(caller, model, pairs, runs, same_for, describe=describe, settings=settings, seed=seed,
                  rule=f"the output at position t along dim {dim} depends only on inputs at positions <= t",
                  fix="Mask the future: a causal attention mask, left-only padding")
