"""What the per-layer reducers share: a step's rows of statistics keyed by layer path, states
that merge by iteration, and results read to the host once.

An :class:`_Entry` is one recorded step: the paths of the layers that had values (module
order) and one row per layer, a tensor on the device the values were computed on. States are
cons lists of entries (see :mod:`funhooks.reducers._shared`). :func:`_merge` puts the entries of
disjoint chunks of steps in iteration order and hands two entries of one iteration (two
ranks) to the reducer's own rule. A :class:`Table` is what results read: every path in module
order, and each step's rows copied to the host in one go.

Cost: nothing per step beyond the entry; reading a result finishes every row in one pass and
copies them to the host once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeAlias

import torch

from funhooks.errors import ReducerError
from funhooks.specs.spec import Spec
from funhooks.training.step import Step

from . import _shared

__all__ = ["Reducer", "State", "Table", "TableResult", "index", "scalars", "table"]


class _Entry(NamedTuple):
    """One recorded step: ``rows[i]`` holds the values of layer ``paths[i]`` (lists of floats
    on the CPU, see :func:`~funhooks.reducers._shared.settled`)."""

    iteration: int
    paths: tuple[str, ...]
    rows: torch.Tensor | list[list[float]]


State: TypeAlias = "_shared.Cons[_Entry]"
"""One :class:`_Entry` per recorded step, newest on top."""


def _add_step(state: State, step: Step, every: int | None, name: str) -> State:
    """`state` with the step's entry (the last value each layer stored under `name`, as rows)
    when the ``every`` rule records the step."""
    if not _shared.records(every, step.iteration, step.training):
        return state
    paths, values = _shared.last_values(step.record, name)
    if not values:
        return (state, _Entry(step.iteration, (), []))
    return (state, _Entry(step.iteration, tuple(paths), _shared.settled(torch.stack(values))))


def table(state: State, reducer: str, name: str, finish: Callable[[torch.Tensor], torch.Tensor]) -> Table:
    """The Table of a state's entries, their rows turned into values by `finish`; recorded steps
    none of which holds `name` are refused (they ran without the reducer's watches)."""
    entries = _shared.unroll(state)
    if entries and not any(e.paths for e in entries):
        raise ReducerError(
            f"{reducer}: a recorded train step holds the records of the reducer's watches, got {len(entries)} "
            f"recorded steps and no {name!r} in any of their records. Run the steps with "
            "`watches=reducer.watches` and the optimizer (fh.fit does), or check that the optimizer stepped."
        )
    return Table(entries, finish)


def scalars(state: State, since: int, finish: Callable[[torch.Tensor], torch.Tensor],
            columns: Sequence[str]) -> dict[str, float]:
    """A reducer's ``scalars``: ``{"<layer>/<column>": value}`` of the newest recorded step when
    its iteration is `since` or later (else ``{}``), the values its result gives for that step
    (rows made values by `finish`), read to the host in one copy."""
    last = _shared.newest(state, since)
    if not last or not last[1].paths:
        return {}
    (rows,) = Table([last[1]], finish).rows()
    return _shared.layer_scalars(rows, columns)


def _merge(a: State, b: State, same: Callable[[_Entry, _Entry], _Entry]) -> State:
    """Entries of both states in iteration order; `same` combines two of one iteration."""
    by_iteration: dict[int, _Entry] = {}
    for entry in _shared.unroll(a) + _shared.unroll(b):
        seen = by_iteration.get(entry.iteration)
        by_iteration[entry.iteration] = entry if seen is None else same(seen, entry)
    return _shared.roll([by_iteration[k] for k in sorted(by_iteration)])


def _keep_first(a: _Entry, b: _Entry) -> _Entry:
    """Two ranks' entries of one iteration where ranks agree (replicated parameters): the
    first's, plus the layers only the second had."""
    extra = [i for i, p in enumerate(b.paths) if p not in a.paths]
    if not extra:
        return a
    paths = _shared.module_order([a.paths, b.paths])
    rows: dict[str, torch.Tensor | list[float]] = dict(zip(a.paths, a.rows))
    rows.update((b.paths[i], b.rows[i]) for i in extra)
    if isinstance(a.rows, torch.Tensor):
        return _Entry(a.iteration, paths,
                      torch.stack([_shared.as_tensor(rows[p], a.rows.device, a.rows.dtype) for p in paths]))
    return _Entry(a.iteration, paths, [r.tolist() if isinstance(r, torch.Tensor) else r for r in (rows[p] for p in paths)])


def index(paths: Sequence[str], idx: int | str, caller: str) -> int:
    """The position of layer `idx` (an index into `paths`, or a path), or a ReducerError."""
    if isinstance(idx, str) and idx in paths:
        return list(paths).index(idx)
    if isinstance(idx, int) and not isinstance(idx, bool) and -len(paths) <= idx < len(paths):
        return idx % len(paths)
    raise ReducerError(
        f"{caller}: `idx` is a module index in range(-{len(paths)}, {len(paths)}) or a module path, got {idx!r}; "
        f"there are {len(paths)} modules: {list(paths)}. Pick one of those."
    )


class Reducer:
    """What the per-layer reducers over optimizer watches share: no specs, the ``every`` rule,
    cons-list states of one :class:`_Entry` per recorded step (the rows their watch stored
    under ``NAME``), merged by iteration keeping the first rank's."""

    __slots__ = ()
    NAME: str
    every: int | None

    @property
    def specs(self) -> tuple[Spec, ...]:
        """None: what they read is read at the optimizer step (see ``watches``)."""
        return ()

    def records(self, iteration: int, training: bool) -> bool:
        """True for the train iterations recorded."""
        return _shared.records(self.every, iteration, training)

    def init(self) -> State:
        """The empty state."""
        return ()

    def step(self, state: State, step: Step) -> State:
        """Add the step's rows (on the device, not read) when it is recorded."""
        return _add_step(state, step, self.every, self.NAME)

    def merge(self, a: State, b: State) -> State:
        """Chunks of steps in iteration order; of one iteration (two ranks, replicated
        parameters), the first's rows."""
        return _merge(a, b, _keep_first)


class Table:
    """Entries read to the host: per step, per path (module order), a list of floats, the
    entries' rows (a reducer's sums) made values by `finish` (float64 rows to rows)."""

    def __init__(self, entries: Sequence[_Entry], finish: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.entries = tuple(entries)
        self.finish = finish
        self.paths = _shared.module_order(e.paths for e in self.entries)
        self.iterations = tuple(e.iteration for e in self.entries)
        self._rows: list[dict[str, list[float]]] | None = None

    def rows(self) -> list[dict[str, list[float]]]:
        """Per step, ``{path: row as floats}`` (one pass of `finish` and one copy to the host for
        all steps)."""
        if self._rows is None:
            rows = [e.rows for e in self.entries]
            host = []
            device = next((r.device for r in rows if isinstance(r, torch.Tensor)), None)
            if device is None and any(rows):  # a CPU run: lists of floats
                host = self.finish(torch.tensor([row for r in rows for row in r], dtype=torch.float64)).tolist()
            elif device is not None:
                host = self.finish(torch.cat([_shared.as_tensor(r, device, torch.float64)
                                              for r in rows if len(r)])).tolist()
            self._rows, start = [], 0
            for e, r in zip(self.entries, rows):
                self._rows.append(dict(zip(e.paths, host[start:start + len(r)])))
                start += len(r)
        return self._rows

    def last(self) -> dict[str, list[float]]:
        """``{path: row as floats}`` of the last recorded step alone (one copy of its rows, or
        none when every row was read already); ``{}`` without steps."""
        if not self.entries:
            return {}
        if self._rows is not None:
            return self._rows[-1]
        return Table(self.entries[-1:], self.finish).rows()[0]

    def column(self, idx: int | str, k: int, caller: str) -> list[float]:
        """Value `k` of layer `idx` at every step; NaN where the layer had none."""
        path = self.paths[index(self.paths, idx, caller)]
        return [row[path][k] if path in row else math.nan for row in self.rows()]

    def per_step(self, k: int) -> list[list[float]]:
        """Value `k` of every layer of ``paths`` at every step; NaN where absent."""
        return [[row[p][k] if p in row else math.nan for p in self.paths] for row in self.rows()]


class TableResult:
    """What results over a :class:`Table` share: the layer paths, the iterations, the length."""

    __slots__ = ()
    table: Table

    @property
    def paths(self) -> tuple[str, ...]:
        """The layer paths, in module order."""
        return self.table.paths

    @property
    def iterations(self) -> tuple[int, ...]:
        """The train iterations recorded."""
        return self.table.iterations

    def __len__(self) -> int:
        return len(self.table.entries)
