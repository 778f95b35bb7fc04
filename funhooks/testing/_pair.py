"""Comparing two runs of a model, and blaming the module that makes them disagree.

An invariant of this kind says how two runs must relate (the same output for the other
examples when one example changes; the same output twice in eval mode). :func:`compare`
draws inputs, runs the model twice per draw without hooks, and on the shrunk failing draw
runs it twice more with every module's inputs and outputs recorded. :func:`_introducer`
then walks the two Records in module order and names the innermost module whose inputs
still keep the invariant but whose output breaks it: the module that introduces the break.

Cost: two forward passes per drawn input, without gradients; to explain a failure, two
recorded passes that keep a copy of every module's inputs and outputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import torch
from torch import nn

from funhooks.records.record import Record
from funhooks.runs.run import with_hooks
from funhooks.specs.spec import inputs, outputs

from . import _invariant

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis
    from hypothesis.strategies import SearchStrategy

__all__ = ["ATOL", "RTOL", "Run", "SEED", "Same", "broken", "close", "compare"]

RTOL, ATOL = 1e-4, 1e-5
"""Default tolerances: float32 rounding when work is reordered, nothing more."""
SEED = 0
"""The seed both runs of a pair start from (determinism uses it and the next one)."""


class Run(NamedTuple):
    """One run of a pair: the model's positional arguments, the random seed it starts from, and
    its mode (True/False: train/eval, None: as it is)."""

    args: tuple
    seed: int
    mode: bool | None


Same = Callable[[torch.Tensor, torch.Tensor], "bool | None"]
"""``same(a, b)``: True when `b` keeps the invariant with respect to `a`, False when it
breaks it, None when the two tensors cannot be compared (the tensor is skipped)."""

_Draw = TypeVar("_Draw")


def _seeded_call(model: nn.Module, reset: Callable[[], None], args: tuple, seed: int,
                 mode: bool | None = None) -> object:
    """``model(*args)`` from the saved buffers and random seed `seed`, without gradients;
    in train (`mode` True) or eval (False) mode, or as it is (None)."""
    reset()
    if mode is not None:
        model.train(mode)
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(*args)


def _recorded(model: nn.Module, reset: Callable[[], None], args: tuple, seed: int,
              mode: bool | None = None) -> tuple[object, Record]:
    """:func:`_seeded_call` with every module's inputs and outputs recorded (copies)."""
    with with_hooks(model, [outputs(_invariant.EVERY, clone=True), inputs(_invariant.EVERY, clone=True)]) as run:
        out = _seeded_call(model, reset, args, seed, mode)
    return out, run.record


def close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> bool:
    """Same shape and values (within `rtol`/`atol` for floats; NaN equals NaN)."""
    if a.shape != b.shape:
        return False
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return torch.allclose(a, b.to(a.dtype), rtol=rtol, atol=atol, equal_nan=True)
    return torch.equal(a, b)


def broken(a: object, b: object, same: Same) -> bool:
    """Whether any comparable tensor of `b` breaks the invariant (or the structures differ)."""
    left, right = _invariant.tensor_leaves(a), _invariant.tensor_leaves(b)
    if len(left) != len(right):
        return True
    return any(same(x, y) is False for x, y in zip(left, right))


def _introducer(rec_a: Record, rec_b: Record, same: Same) -> str | None:
    """The innermost module, first in module order, with a call whose inputs keep the
    invariant and whose output breaks it: the module that introduces the break."""
    found = []
    for path, node in rec_a.items():
        if path not in rec_b:
            continue
        outs_a, outs_b = node.calls("output"), rec_b.calls(path, "output")
        ins_a, ins_b = node.calls("input"), rec_b.calls(path, "input")
        if len(outs_a) != len(outs_b) and not any(broken(x, y, same) for x, y in zip(ins_a, ins_b)):
            found.append(path)
            continue
        if any(broken(oa, ob, same) and not broken(ia, ib, same)
               for oa, ob, ia, ib in zip(outs_a, outs_b, ins_a, ins_b)):
            found.append(path)
    return _invariant.innermost(found)


def compare(caller: str, model: nn.Module, draws: SearchStrategy[_Draw], runs: Callable[[_Draw], tuple[Run, Run]],
            same_for: Callable[[_Draw], Same], *, rule: str, fix: str, settings: hypothesis.settings | None,
            seed: int | None, breaks: Callable[[_Draw, object, object], bool] | None = None,
            describe: Callable[[_Draw], str] | None = None) -> None:
    """Search `draws` for one whose two runs break the invariant; blame a module on the shrunk one.

    ``runs(draw)`` gives the two runs; ``same_for(draw)`` compares each module's tensors
    for the blame and, unless `breaks` is given (``breaks(draw, first, second)``), the
    model's outputs too. The error's first line is ``<caller>: <rule>, got module <blamed>
    first breaking it. <fix>.``, followed by ``describe(draw)`` (default: the input)."""
    if breaks is None:
        def breaks(draw: _Draw, first: object, second: object) -> bool:
            return broken(first, second, same_for(draw))

    with _invariant.preserved(model) as reset:
        def fails(draw: _Draw) -> bool:
            first, second = (_seeded_call(model, reset, *run) for run in runs(draw))
            return breaks(draw, first, second)

        draw = _invariant.search(draws, fails, settings, seed)
        if draw is None:
            return
        (_, rec_a), (_, rec_b) = (_recorded(model, reset, *run) for run in runs(draw))
        path = _introducer(rec_a, rec_b, same_for(draw))
    where = _invariant.module_name(model, "" if path is None else path)
    details = f"input: {_invariant.show(draw)}" if describe is None else describe(draw)
    raise AssertionError(f"{caller}: {rule}, got module {where} first breaking it. {fix}.\n{details}")
