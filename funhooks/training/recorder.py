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
from .watch import OptimizerWatch, Seen, Stored, Watching, as_watches, optimizers

__all__ = ["Recorder"]

T = TypeVar("T")


class Recorder:
    """What one step's specs and watches stored, one step (or one stretch) at a time."""

    __slots__ = ("caller", "model", "paused", "run", "seen", "specs", "watching")

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
        self.paused: contextlib.ExitStack | None = None
        self.seen: Seen | None = None  # the model's modules when :meth:`held` opened its run

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

    def held(self, work: Callable[[], T]) -> tuple[T, Record]:
        """``work()`` as one recorded step of a recording kept open from step to step and paused
        between them (see :meth:`end`), and the step's Record: what ``fh.fit`` does, where
        nothing but the reducers runs between steps. The run is made afresh when a module was
        added, removed or replaced since the last step (as :meth:`__call__` would)."""
        if not self.active:
            return work(), EMPTY_RECORD
        if self.specs is not None and (self.seen is None or not self.seen.holds(())):
            self._stop()
            self.open()
            self.seen = Seen.of(self.model, ())
        else:
            self.resume() if self.paused is not None else self.open()
        try:
            result = work()
        except BaseException:
            self.end()
            raise
        record = self.take()
        self.pause()
        return result, record

    def end(self) -> None:
        """Stop what :meth:`held` kept open: everything detached, nothing read."""
        self.seen = None
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
        return self._merged(record, self.watching.take() if self.watching is not None else {})

    def _stop(self) -> Run | None:
        paused, self.paused = self.paused, None
        run, self.run = self.run, None
        try:
            if paused is not None:
                paused.close()
            if run is not None:
                run.__exit__(None, None, None)
        finally:
            if self.watching is not None:
                self.watching.detach()
        return run

    def take(self) -> Record:
        """The Record of everything since :meth:`open` or the last take; recording goes on."""
        record = EMPTY_RECORD if self.run is None else self.run.take()
        return self._merged(record, self.watching.take() if self.watching is not None else {})

    def pause(self) -> None:
        """Record nothing until :meth:`resume` (steps no reducer reads)."""
        if self.paused is None:
            self.paused = contextlib.ExitStack()
            if self.run is not None:
                self.paused.enter_context(self.run.paused())
            if self.watching is not None:
                self.watching.detach()

    def resume(self) -> None:
        """Record again after :meth:`pause`."""
        paused, self.paused = self.paused, None
        if paused is not None:
            paused.close()
            if self.watching is not None:
                self.watching.attach()

    def _merged(self, record: Record, data: Stored) -> Record:
        """`record` with the watches' values added, paths in module order."""
        watching = self.watching
        if not data or watching is None:
            return record
        merged: dict[str, dict[str, tuple[object, ...]]] = {p: dict(names) for p, names in record._data.items()}
        for path, names in data.items():
            node = merged.get(path)
            if node is None:
                merged[path] = {name: tuple(values) for name, values in names.items()}
            else:
                node.update((name, tuple(values)) for name, values in names.items())
        keys = [watching.key(p) for p in merged]
        if any(a > b for a, b in zip(keys, keys[1:])):
            merged = {p: merged[p] for _, p in sorted(zip(keys, merged))}
        return with_notes_of(merged, record)

