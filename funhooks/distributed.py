"""Records and reducer states across the ranks of a ``torch.distributed`` group.

Two pieces make hooks work where training spans processes:

- ``gather=True`` on a spec (``fh.outputs(where, gather=True)``) all-gathers every stored
  tensor and concatenates the ranks' tensors along dim 0 (0-d tensors are averaged), in
  rank order, so each rank's Record holds the global batch. It is a no-op without an
  initialised group of more than one process. Every rank must run the same modules the
  same number of times with tensors of equal shape (a ``DistributedSampler`` ensures it).
  A ``DTensor`` (an FSDP2 gradient shard) gathers to its ``full_tensor()``, the whole
  tensor, the same on every rank.
- :func:`merge_across_ranks` combines a mergeable reducer state (one with
  ``reducer.merge(a, b)``) from every rank, so each rank, rank 0 included, holds the
  statistics of all of them.

Selectors and Record paths on a ``DistributedDataParallel``-wrapped model are those of the
inner model: the ``module.`` prefix never appears. On an FSDP2 (``fully_shard``) model they
are the model's own, and ``param_grad`` specs see each sharded parameter's gradient shard
(``_core/sharded.py``; ``docs/distributed.md`` says what each rank records).

Cost: ``gather=True`` runs one collective per stored tensor, inside the forward pass;
``merge_across_ranks`` pickles each rank's state (tensors moved to the CPU) and runs one
``all_gather_object``, so call it once at the end of training, not per batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
import torch

from . import _torch
from .errors import ReducerError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["is_distributed", "merge_across_ranks"]

_S = TypeVar("_S")


def is_distributed(group: ProcessGroup | None = None) -> bool:
    """True when `group` (default: the world) is initialised with more than one process.

    Args:
        group: a process group, or ``None`` for the default group.

    Returns:
        Whether ``gather=True`` and :func:`merge_across_ranks` do anything.

    Example:
        >>> import funhooks as fh
        >>> fh.distributed.is_distributed()
        False
    """
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any) -> Any:
    """Apply `fn` to every tensor in `value`: pytrees (tuples, lists, dicts) and attrs
    instances, however nested."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if attrs.has(type(value)):
        changes = {}
        for field in attrs.fields(type(value)):
            if field.init:
                changes[field.alias] = _map_tensors(fn, getattr(value, field.name))
        return attrs.evolve(value, **changes)
    if isinstance(value, (tuple, list, dict)):
        children, spec = _torch.pytree.tree_flatten(value, is_leaf=lambda x: x is not value and attrs.has(type(x)))
        return _torch.pytree.tree_unflatten([_map_tensors(fn, c) for c in children], spec)
    return value


def _device_of(value: object) -> torch.device | None:
    found: list[torch.device] = []

    def note(t: torch.Tensor) -> torch.Tensor:
        found.append(t.device)
        return t

    _map_tensors(note, value)
    return found[0] if found else None


def merge_across_ranks(reducer: object, state: _S, *, group: ProcessGroup | None = None) -> _S:
    """Merge `state` of `reducer` from every rank: each rank gets the merge of all of them.

    The states are gathered in rank order and combined with ``reducer.merge`` left to
    right, so every rank computes the same value, the one a single process folding every
    rank's steps would hold (for a reducer whose ``merge`` is exact). Without an
    initialised group of more than one process, `state` is returned as it is.

    Args:
        reducer: a reducer with ``merge(a, b) -> state`` (e.g. ``fh.ActivationStats``).
        state: this rank's state (from ``reducer.init()`` and ``reducer.step``).
        group: the process group; ``None`` for the default one.

    Returns:
        The merged state, its tensors on the device `state`'s tensors were on.

    Raises:
        ReducerError: when `reducer` has no callable ``merge``.

    Example:
        >>> import funhooks as fh
        >>> class Count:
        ...     specs = ()
        ...     def init(self): return 0
        ...     def step(self, state, step): return state + 1
        ...     def result(self, state): return state
        ...     def merge(self, a, b): return a + b
        >>> fh.merge_across_ranks(Count(), 3)  # one process: nothing to merge
        3
    """
    merge = getattr(reducer, "merge", None)
    if not callable(merge):
        raise ReducerError(
            f"merge_across_ranks: the reducer needs a `merge(a, b)` method, got {reducer!r} without one. "
            "Give it `merge`, or gather its results yourself with `torch.distributed.all_gather_object`."
        )
    if not is_distributed(group):
        return state
    dist = torch.distributed
    device = _device_of(state)
    states: list[Any] = [None] * dist.get_world_size(group)  # filled with every rank's state
    dist.all_gather_object(states, _map_tensors(lambda t: t.detach().cpu(), state), group=group)
    merged = functools.reduce(merge, states)
    return merged if device is None else _map_tensors(lambda t: t.to(device), merged)
