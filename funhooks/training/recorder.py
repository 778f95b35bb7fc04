"""Recording one training step at a time: a run of specs on the model and optimizer watches
on the optimizers, their values merged into the step's one Record.

Every way of producing Steps uses a :class:`Recorder`: ``fh.train`` calls it around each
step (a ``with_hooks`` block per step, so nothing stays attached between steps),
``fh.folding`` keeps it open across the iterations of the user's own loop and takes a Record
at each mark, and the Lightning and Hugging Face callbacks open it when a step begins and
close it when it ends.

Cost: per recorded step, a ``with_hooks`` block (when there are specs) and two hook
registrations per optimizer (when there are watches); merging the watches' values into the
Record is one dict per layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import TypeVar

from torch import nn

from funhooks import _torch
from funhooks.errors import SelectorError, SpecError
from funhooks.records.record import Record, with_notes_of
from funhooks.runs.run import Run, make_run
from funhooks.specs.spec import Spec

from ._one_step import Optimizers
from .step import EMPTY_RECORD
from .watch import OptimizerWatch, Stored, Watching, as_watches, optimizers

__all__ = ["Recorder"]

T = TypeVar("T")


class Recorder:
    """What one step's specs and watches stored, one step (or one stretch) at a time."""

    __slots__ = ("caller", "model", "paused", "run", "specs", "walk", "watching")
    paused: contextlib.AbstractContextManager[None] | None
    """While paused: the block that pauses the run (its ``__exit__`` resumes it)."""

    def __init__(self, model: nn.Module, specs: Spec | Iterable[Spec],
                 watches: OptimizerWatch | Iterable[OptimizerWatch], opts: Optimizers | None, caller: str, *,
                 manual_before: bool = False) -> None:
        """Check everything now: specs resolved against the model, watches' layers found.

        Args:
            opts: the optimizer(s) the watches read; None only when there are no watches.
            manual_before: see :class:`~funhooks.training.watch.Watching`.
        """
        self.model, self.caller = model, caller
        self.specs = make_run(model, specs, caller).specs or None
        watches = as_watches(watches, caller)
        self.watching = None
        if watches:
            names = {s.name for s in self.specs or ()}
            clash = next((w for w in watches if w.name in names), None)
            if clash is not None:
                raise SpecError(f"{caller}: a watch and a spec store under one name, got {clash.name!r} for both. "
                                "Give the OptimizerWatch another `name=`.")
            self.watching = Watching(model, watches, optimizers(opts, caller), caller, manual_before=manual_before)
        self.run: Run | None = None
        self.paused = None
        self.walk: list[nn.Module] | None = None  # the model's modules at :meth:`held`'s last step

    @property
    def active(self) -> bool:
        """Whether there is anything to record at all."""
        return self.specs is not None or self.watching is not None

    @property
    def watches(self) -> Watching | None:
        """The optimizer watches, for a caller that runs ``before`` itself (Lightning)."""
        return self.watching

    def __call__(self, work: Callable[[], T]) -> tuple[T, Record]:
        """``work()`` as one recorded step, and the step's Record."""
        if self.watching is None:
            if self.specs is None:
                return work(), EMPTY_RECORD
            with self._run() as run:
                result = work()
            return result, run.record
        self.open()
        try:
            result = work()
        except BaseException:
            self.abort()
            raise
        return result, self.close()

    def held(self, work: Callable[[], T], modules: list[nn.Module]) -> tuple[T, Record]:
        """``work()`` as one recorded step of a recording kept open from step to step and paused
        between them (see :meth:`end`), and the step's Record: what ``fh.fit`` does, where
        nothing but the reducers runs between steps. The run is made afresh, and the watches
        find their layers again, when a module was added, removed or replaced since the last
        step (as :meth:`__call__` would).

        Args:
            modules: the model's modules as the loop's :class:`~funhooks._modes.Walked` gave
                them for this step: the very list of the last step while no module was added,
                removed or replaced (so the structure is compared once a step, by the loop).
        """
        if not self.active:
            return work(), EMPTY_RECORD
        same = modules is self.walk
        self.walk = modules
        if self.specs is not None and not same:
            self._stop()
            self.open()
        elif self.paused is not None:
            self.resume(same)
        else:
            self.open()
        try:
            result = work()
        except BaseException:
            self.end()
            raise
        record = self.take()
        self.pause(hold=True)
        return result, record

    def end(self) -> None:
        """Stop what :meth:`held` kept open: everything detached, nothing read."""
        self.walk = None
        self.abort()

    def _run(self) -> Run:
        """A run of the specs on the model as it is now; a spec whose selector matches no module
        any more (a layer swapped or removed mid-training) sits the step out (the constructor
        refused it on the model as it was)."""
        specs = self.specs or ()
        try:
            return make_run(self.model, specs, self.caller)
        except SelectorError:
            modules = list(_torch.named_modules(self.model))
            kept = tuple(s for s in specs if any(s.where.matches(p, m) for p, m in modules))
            if len(kept) == len(specs):
                raise
            return make_run(self.model, kept, self.caller)

    def open(self) -> None:
        """Start recording in the calling context (a ``with_hooks`` block, the watches' hooks)."""
        if self.specs is not None:
            run = self._run()
            run.__enter__()
            self.run = run
        if self.watching is not None:
            try:
                self.watching.attach()
            except BaseException:
                self.abort()
                raise

    def abort(self) -> None:
        """Stop recording after a failure: everything detached, nothing read."""
        self._stop()
        if self.watching is not None:
            self.watching.take()

    def close(self) -> Record:
        """Stop recording; the Record of everything since :meth:`open` (or the last :meth:`take`)."""
        run = self._stop()
        record = EMPTY_RECORD if run is None else run.record
        return self._merged(record, self.watching.take() if self.watching is not None else [])

    def _stop(self) -> Run | None:
        paused, self.paused = self.paused, None
        run, self.run = self.run, None
        try:
            if paused is not None:
                paused.__exit__(None, None, None)
            if run is not None:
                run.__exit__(None, None, None)
        finally:
            if self.watching is not None:
                self.watching.detach()
        return run

    def take(self) -> Record:
        """The Record of everything since :meth:`open` or the last take; recording goes on."""
        record = EMPTY_RECORD if self.run is None else self.run.take()
        return self._merged(record, self.watching.take() if self.watching is not None else [])

    def pause(self, *, hold: bool = False) -> None:
        """Record nothing until :meth:`resume` (steps no reducer reads); `hold` leaves the
        optimizer hooks registered, reading nothing (:meth:`held`: nothing but the reducers
        runs before the next step)."""
        if self.paused is None:
            # entered and left by hand, not by an ExitStack: fit pauses and resumes once a step
            paused = self.run.paused() if self.run is not None else contextlib.nullcontext()
            paused.__enter__()
            self.paused = paused
            if self.watching is not None:
                self.watching.pause() if hold else self.watching.detach()

    def resume(self, same: bool = False) -> None:
        """Record again after :meth:`pause`; `same`: the caller saw that no module was added,
        removed or replaced since (the watches need not look)."""
        paused, self.paused = self.paused, None
        if paused is not None:
            paused.__exit__(None, None, None)
            if self.watching is not None:
                self.watching.attach(same=same)

    def _merged(self, record: Record, data: Stored) -> Record:
        """`record` with the watches' values added, paths in module order."""
        watching = self.watching
        if not data or watching is None:
            return record
        merged: dict[str, dict[str, tuple[object, ...]]] = {p: dict(names) for p, names in record._data.items()}
        names: set[str] = set()
        for name, values in data:  # a watch's values of one optimizer step
            if not merged:  # the first into an empty record: its nodes at once
                merged = {path: {name: (value,)} for path, value in values.items()}
            elif name not in names and list(values) == list(merged):  # a new name on the same layers
                for names_of, value in zip(merged.values(), values.values()):
                    names_of[name] = (value,)
            else:
                for path, value in values.items():
                    node = merged.get(path)
                    if node is None:
                        merged[path] = {name: (value,)}
                    else:
                        calls = node.get(name)
                        node[name] = (value,) if calls is None else (*calls, value)
            names.add(name)
        order = watching.order  # a module's path; a parameter's is found by `key`
        keys = [order.get(p) or watching.key(p) for p in merged]
        if keys != sorted(keys):
            merged = {p: merged[p] for _, p in sorted(zip(keys, merged))}
        return with_notes_of(merged, record)
