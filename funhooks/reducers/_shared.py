"""What the library's reducers share: default layer selectors, argument checks, the
``every`` rule, cons-list states and the module order of paths seen on different steps.

Reducer states are cons lists, ``()`` or ``(rest, entry)``: adding a step is O(1) and copies
nothing, and :func:`unroll` / :func:`roll` turn them into lists and back.

Cost: nothing per step beyond a tuple per recorded step (values of a CPU step are kept as
Python numbers, see :func:`settled`); :func:`module_order` is a
topological sort over the distinct path orders seen, run when a result is read.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, TypeAlias, TypeGuard, TypeVar

import attrs
import torch

from funhooks.errors import ReducerError
from funhooks.records.record import Record
from funhooks.specs.selector import Selector, Where, select

from .layers import LeafModules

__all__ = [
    "HEALTHY_RATIO", "Cons", "Steps", "as_tensor", "entry_paths", "layer_scalars", "module_order", "newest", "roll",
    "settled", "unroll", "where", "to_selector", "check_every", "check_bool", "is_number", "records", "last_values",
    "last_calls",
]

T = TypeVar("T")
E = TypeVar("E")
K = TypeVar("K", bound="_Dated")

Cons: TypeAlias = "tuple[()] | tuple[Cons[E], E]"
"""A cons-list state: ``()``, or ``(rest, entry)`` with the newest entry on top."""

HEALTHY_RATIO = 1e-3
"""The rule of thumb for a healthy update-to-parameter ratio (Karpathy's), drawn on its plot."""

_ROOT = "(root)"
"""The layer name of the model itself (path ``""``) in the names ``scalars`` gives."""


def where(modules: Where | None, include_paramless: bool) -> Selector:
    """`modules` as a selector; None: :class:`LeafModules`."""
    return select(LeafModules(include_paramless) if modules is None else modules)


def to_selector(modules: Where | None) -> Selector | None:
    """The attrs converter of a ``modules=`` field: None stays None."""
    return None if modules is None else select(modules)


class _Validator(Protocol):
    """An attrs validator of a field of any type: ``check(instance, attribute, value)``."""

    def __call__(self, instance: object, attribute: attrs.Attribute[T], value: T, /) -> None: ...


def check_every(caller: str) -> _Validator:
    """The attrs validator of ``every``: a positive int or None."""

    def check(instance: object, attribute: attrs.Attribute[T], every: T) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every <= 0):
            raise ReducerError(
                f"{caller}: `every` is a positive int or None, got {every!r}. "
                "Pass every=1 (or None) to record every train step, every=k for one in k."
            )

    return check


def check_bool(caller: str) -> _Validator:
    """The attrs validator of a flag."""

    def check(instance: object, attribute: attrs.Attribute[T], value: T) -> None:
        if not isinstance(value, bool):
            raise ReducerError(f"{caller}: `{attribute.name}` is a bool, got {value!r}. Pass True or False.")

    return check


def is_number(value: object) -> TypeGuard[float]:
    """A real number that is not a bool and not NaN."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def records(every: int | None, iteration: int, training: bool) -> bool:
    """The ``every`` rule: train iterations with ``iteration % every == 0``; never evaluation."""
    return training and (every is None or iteration % every == 0)


def last_values(record: Record, name: str) -> tuple[list[str], list[Any]]:
    """The paths (module order) of the modules that stored `name`, and each one's last value
    (a module called twice: its last call, as fastai's)."""
    found = record.calls_by_path(name)
    return list(found), [calls[-1] for calls in found.values()]


def last_calls(record: Record, name: str, caller: str) -> list[Any]:
    """The last value of `name` of every module that stored it, in module order; a step
    without any is refused (its steps ran without the reducer's specs)."""
    out = last_values(record, name)[1]
    if not out:
        raise ReducerError(
            f"{caller}: a recorded train step holds the records of the reducer's specs, got a Step whose record "
            f"has paths {list(record)} and no {name!r}. Run the steps with `specs=reducer.specs`, or use fh.fit."
        )
    return out


class _Dated(Protocol):
    """What every reducer's entry for one step has: the step's iteration."""

    @property
    def iteration(self) -> int: ...


class _StepEntry(_Dated, Protocol):
    """What every per-layer reducer's entry for one recorded step has."""

    @property
    def paths(self) -> tuple[str, ...]: ...


class Steps:
    """What results over one entry per recorded step share (each entry with an ``iteration``
    and its ``paths``): the iterations recorded and the number of steps."""

    __slots__ = ()
    entries: tuple[_StepEntry, ...]

    @property
    def iterations(self) -> tuple[int, ...]:
        """The train iterations recorded."""
        return tuple(e.iteration for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def entry_paths(result: Steps) -> tuple[str, ...]:
    """Every path of a result's entries, in module order (the attrs default of its ``paths``)."""
    return module_order(e.paths for e in result.entries)


def unroll(state: Cons[E]) -> list[E]:
    """The entries of a cons-list state, oldest first."""
    out = []
    while state:
        state, entry = state
        out.append(entry)
    out.reverse()
    return out


def roll(entries: Sequence[E]) -> Cons[E]:
    """A cons-list state holding `entries`, the last one on top."""
    state: Cons[E] = ()
    for entry in entries:
        state = (state, entry)
    return state


def newest(state: Cons[K], since: int) -> Cons[K]:
    """A state holding only the newest entry of `state`, when its ``iteration`` is `since` or
    later; else the empty state. O(1): what a reducer's ``scalars`` reads."""
    if state and state[1].iteration >= since:
        return ((), state[1])
    return ()


def layer_scalars(rows: dict[str, list[float]], columns: Sequence[str]) -> dict[str, float]:
    """``{"<layer>/<column>": value}`` of one step's rows (``{path: values in column order}``),
    the names ``scalars`` gives (the model itself named :data:`_ROOT`)."""
    return {f"{path or _ROOT}/{column}": value for path, row in rows.items() for column, value in zip(columns, row)}


def settled(value: torch.Tensor) -> Any:
    """A step's values as a state keeps them: on the CPU as Python numbers (``tolist()``, a
    number or nested lists as deep as the tensor; no
    sync there), since a small tensor kept per step pins freed heap pages and a long run's
    memory grows with its steps; on another device the tensor itself, not read (no sync)."""
    return value.tolist() if value.device.type == "cpu" else value


def as_tensor(value: object, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A value :func:`settled` kept, as a tensor on `device`."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device, dtype)
    return torch.tensor(value, dtype=dtype, device=device)


def _path_key(path: str) -> tuple[tuple[int, int, str], ...]:
    """A stand-in for module order between two paths no step orders: numbered parts by number."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split("."))


def module_order(orders: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """Every path of `orders` once, in module order.

    Each of `orders` lists some paths in module order (the modules that ran on one step), so
    together they say which of two paths comes first wherever a step ran both; paths no step
    orders (never run together) are put by :func:`_path_key`. The answer depends on the set
    of orders only, not on their sequence, so merging states in any order gives the same.
    """
    distinct = set(orders)
    if len(distinct) == 1:  # the same modules ran on every step
        return next(iter(distinct))
    later: dict[str, set[str]] = {}
    for seq in distinct:
        for p in seq:
            later.setdefault(p, set())
        for a, b in itertools.pairwise(seq):
            later[a].add(b)
    waiting = dict.fromkeys(later, 0)
    for nexts in later.values():
        for b in nexts:
            waiting[b] += 1
    ready = [(_path_key(p), p) for p, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        _, p = heapq.heappop(ready)
        out.append(p)
        for b in later[p]:
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, (_path_key(b), b))
    if len(out) < len(later):  # contradicting orders (states of different models): the rest by name
        out += sorted(set(later) - set(out), key=_path_key)
    return tuple(out)

