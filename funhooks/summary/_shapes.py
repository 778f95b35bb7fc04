"""One pass recording each leaf module's output shape and whether fastai's ``_track`` would
mark it as keeping its input's shape: on the meta device where the model allows it, else one
real pass under ``torch.no_grad()`` (the rules are in :mod:`funhooks.summary`)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from funhooks import _torch
from funhooks._modes import in_mode
from funhooks.records.record import Record
from funhooks.runs.introspect import isolated
from funhooks.runs.run import with_hooks
from funhooks.specs.selector import Where
from funhooks.specs.spec import observe

from .table import ShapeTree, shape_tree

__all__ = ["is_leaf", "last_shape", "last_track", "record_shapes"]

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


def _track(module: nn.Module, args: tuple[object, ...], output: object) -> tuple[ShapeTree, bool]:
    """What a row needs of one call: the output's shape tree, and fastai's `same`."""
    return shape_tree(output), _same(args, output)


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


def record_shapes(model: nn.Module, where: Where | None, args: tuple[object, ...]) -> tuple[Record, ShapeTree]:
    """Run `model` on `args` in eval mode, storing the output shape of the modules `where`
    selects (none when `where` is None). Returns ``(record, output shape)``: on the meta
    device when it can, else with one real pass. Lazy modules always get the real pass
    (it initialises them, as users of fastai's ``dummy_eval`` expect)."""
    model = _torch.unwrap(model)
    specs = () if where is None else (observe(where, _track, name="shape", detach=False),)
    with_hooks(model, specs)  # validates the selector before anything runs
    lazy = any(nn.parameter.is_lazy(t) for t in itertools.chain(model.parameters(), model.buffers()))
    # a sharded model (FSDP2) swaps its own parameters in and out around each call: it runs for real
    meta = not lazy and not _torch.is_sharded(model)
    with in_mode(model, False), torch.no_grad(), isolated(), _torch.sharding_kept(model):  # funhooks' own pass
        if meta:
            try:
                with _on_meta(model), with_hooks(model, specs) as run:
                    out = model(*_meta(args))
                return run.record, shape_tree(out)
            except Exception:  # noqa: BLE001 - no meta kernel, real tensors made in forward, data-dependent ops
                pass
        with with_hooks(model, specs) as run:
            out = model(*args)
        return run.record, shape_tree(out)


def last_track(rec: Record, path: str) -> tuple[ShapeTree, bool]:
    """``(shape, same)`` of the module's last call; ``(None, False)`` when it did not run."""
    calls = rec.calls(path, "shape") if path in rec else ()
    return calls[-1] if calls else (None, False)


def last_shape(rec: Record, path: str) -> ShapeTree:
    return last_track(rec, path)[0]
