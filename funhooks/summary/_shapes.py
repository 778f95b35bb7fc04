"""One pass recording each selected module's input and output shapes, its output's bytes and
whether fastai's ``_track`` would mark it as keeping its input's shape, and (when asked) the
FLOPs ``torch.utils.flop_counter`` counts per module: on the meta device where the model allows
it, else one real pass under ``torch.no_grad()`` (the rules are in :mod:`funhooks.summary`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple, TypeVar

import torch
from torch import nn
from torch.utils import flop_counter

from funhooks import _torch
from funhooks._modes import in_mode
from funhooks.records.record import Record
from funhooks.runs.introspect import isolated
from funhooks.runs.run import with_hooks
from funhooks.specs.selector import Where
from funhooks.specs.spec import Spec, observe

from .table import ShapeTree, shape_tree

__all__ = ["Pass", "Track", "is_leaf", "last_shape", "last_track", "nbytes", "record_shapes", "tracks"]

_T = TypeVar("_T")


def is_leaf(path: str, module: nn.Module) -> bool:
    return not any(c is not None for c in _torch.children(module).values())


def _same(args: tuple[object, ...], output: object) -> bool:
    """fastai's ``any(i.shape[1:] == o.shape for i, o in zip(args, output))`` on shapes: a
    tensor output iterates over its first dimension, a tuple or list over its items (an
    item that is no tensor, or a dict or 0-d output, where fastai raises, gives False)."""
    if isinstance(output, torch.Tensor):
        if output.ndim == 0:
            return False
        outs: list[torch.Size | None] = [output.shape[1:]] * min(len(args), output.shape[0])
    elif isinstance(output, (tuple, list)):
        outs = [o.shape if isinstance(o, torch.Tensor) else None for o in output]
    else:
        return False
    return any(isinstance(a, torch.Tensor) and o is not None and a.shape[1:] == o for a, o in zip(args, outs))


class Track(NamedTuple):
    """What the rows need of one call of a module."""

    shape: ShapeTree  # the output's
    same: bool  # fastai's "size unchanged"
    inputs: ShapeTree  # the positional arguments' (keyword arguments are not seen by a forward hook)
    output_bytes: int  # the bytes of the output's tensors


_NOT_RUN = Track(None, False, None, 0)


class Pass(NamedTuple):
    """What :func:`record_shapes` found."""

    record: Record  # a Track per call under "shape", for each selected module
    output: ShapeTree  # the model's output
    flops: dict[str, int] | None  # per module path (those that ran), "" the whole pass; None: not counted


def nbytes(value: object) -> int:
    """The bytes of the tensors in `value` (meta tensors included: their size, not their storage)."""
    return sum(t.numel() * t.element_size() for t in _torch.tensor_leaves(value))


def _track(module: nn.Module, args: tuple[object, ...], output: object) -> Track:
    return Track(shape_tree(output), _same(args, output), shape_tree(args), nbytes(output))


def _meta(value: _T) -> _T:
    return _torch.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, value)


@contextlib.contextmanager
def _on_meta(model: nn.Module) -> Iterator[None]:
    """Inside the block every parameter and buffer of `model` is a meta tensor of its shape;
    the originals are put back after, however the block exits. Each module is visited
    once, so a module shared under several paths is swapped and restored once. A plain
    tensor attribute that ``forward`` set to a meta tensor (a cache) is put back as it was,
    or removed when it is new."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    attributes = [(m, dict(vars(m))) for m in model.modules()]
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (_torch.own_parameters(module), _torch.own_buffers(module))
            for table in tables:
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    meta = torch.empty_like(t, device="meta")
                    saved.append((table, name, t))
                    table[name] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t
        for module, before in attributes:
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_meta and value is not before.get(key):
                    if key in before:
                        vars(module)[key] = before[key]
                    else:
                        del vars(module)[key]


def _flops_by_path(model: nn.Module, counter: flop_counter.FlopCounterMode) -> dict[str, int]:
    """The counter's totals keyed by module path. It names a module ``<root class>.<path>`` by
    the last path it found it under; a shared module is keyed here by its first path."""
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    root = type(model).__name__
    first = {id(m): p for p, m in _torch.named_modules(model)}
    flops = {first[id(m)]: counts[f"{root}.{p}"] for p, m in _torch.named_modules(model, every_path=True)
             if p and f"{root}.{p}" in counts}
    return {**flops, "": counter.get_total_flops()}


def _run(model: nn.Module, specs: tuple[Spec, ...], args: tuple[object, ...], kwargs: dict[str, object],
         count_flops: bool) -> Pass:
    counter = flop_counter.FlopCounterMode(display=False) if count_flops else None
    with with_hooks(model, specs) as run, counter or contextlib.nullcontext():
        out = model(*args, **kwargs)
    return Pass(run.record, shape_tree(out), None if counter is None else _flops_by_path(model, counter))


def record_shapes(model: nn.Module, where: Where | None, args: tuple[object, ...],
                  kwargs: dict[str, object] | None = None, *, count_flops: bool = False) -> Pass:
    """Run `model` on `args` and `kwargs` in eval mode, storing a :class:`Track` per call of the
    modules `where` selects (none when `where` is None), and counting FLOPs when asked (not on
    a sharded model). On the meta device when it can, else with one real pass. Lazy modules
    always get the real pass (it initialises them, as users of fastai's ``dummy_eval`` expect)."""
    model = _torch.unwrap(model)
    kwargs = kwargs or {}
    specs = () if where is None else (observe(where, _track, name="shape", detach=False),)
    with_hooks(model, specs)  # validates the selector before anything runs
    lazy = any(nn.parameter.is_lazy(t) for t in itertools.chain(model.parameters(), model.buffers()))
    # a sharded model (FSDP2) swaps its own parameters in and out around each call: it runs for real
    sharded = _torch.is_sharded(model)
    meta = not lazy and not sharded
    count_flops = count_flops and not sharded
    with in_mode(model, False), torch.no_grad(), isolated(), _torch.sharding_kept(model):  # funhooks' own pass
        if meta:
            try:
                with _on_meta(model):
                    return _run(model, specs, _meta(args), _meta(kwargs), count_flops)
            except Exception:  # noqa: BLE001 - no meta kernel, real tensors made in forward, data-dependent ops
                pass
        return _run(model, specs, args, kwargs, count_flops)


def tracks(rec: Record, path: str) -> tuple[Track, ...]:
    """A :class:`Track` per call of the module at `path`, in call order."""
    return rec.calls(path, "shape") if path in rec else ()


def last_track(rec: Record, path: str) -> Track:
    """The module's last call; shape None and `same` False when it did not run."""
    calls = tracks(rec, path)
    return calls[-1] if calls else _NOT_RUN


def last_shape(rec: Record, path: str) -> ShapeTree:
    return last_track(rec, path).shape
