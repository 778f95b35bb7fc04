"""Recording one training step at a time: a run of specs on the model and optimizer watches
on the optimizers, their values merged into the step's one Record, and what the recording
learns about the model as it goes.

Every way of producing Steps uses a :class:`Recorder`: ``fh.train`` calls it around each
step (:meth:`Recorder.step`: a ``with_hooks`` block per step, so nothing stays attached
between steps), ``fh.fit`` keeps it attached across steps, paused between them
(:meth:`Recorder.held`), ``fh.folding`` keeps it open across the iterations of the user's own
loop and takes a Record at each mark, and the Lightning and Hugging Face callbacks open it
when a step begins and close it when it ends.

A Recorder is a small state machine (:class:`Phase`): ``IDLE`` (nothing attached),
``RECORDING`` (the run in the calling context's scope, the watches reading, the recording's
:class:`Learned` visible to spec functions) and ``PAUSED`` (attached, recording nothing).
What entering a phase did is held in an ``ExitStack``, so leaving it, however that happens,
undoes exactly that.

What a recording learns belongs to it: :class:`Learned` (whether a later op changes a
module's output in place, which ``ActivationStats`` reads to keep outputs without a copy)
lives as long as the Recorder, is visible only while it records and in the context recording,
and is forgotten when the model's structure changes.

Cost: per recorded step, a ``with_hooks`` block (when there are specs) and two hook
registrations per optimizer (when there are watches), a ``ContextVar`` set and reset;
merging the watches' values into the Record is one dict per layer
(:func:`funhooks.records.merge`).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections.abc import Callable, Iterable
from typing import TypeAlias, TypeVar

import torch
from torch import nn

from funhooks import _torch
from funhooks._modes import Walked
from funhooks.errors import SelectorError, SpecError, StaleTensorError
from funhooks.records import Record, merge
from funhooks.records.record import trusted
from funhooks.runs.run import Run, make_run
from funhooks.specs.selector import path_label
from funhooks.specs.spec import Spec

from ._one_step import Optimizers
from .step import EMPTY_RECORD
from .watch import OptimizerWatch, Stored, Watching, as_watches, optimizers

__all__ = ["Learned", "Phase", "Recorder", "learned"]

T = TypeVar("T")

_Kept: TypeAlias = tuple[torch.Tensor, int, nn.Module, bool]
"""What a spec function notes of an output it keeps (:meth:`Learned.note`): the output, its
version counter when noted, its module, and whether this is the module's first noted step
(it learns) or the module is known to keep its output unchanged (it is checked)."""


class Learned:
    """What one recording learns about the model it records, step by step: for each module,
    whether some op changed its output in place after its hooks saw it (an ``inplace=True``
    activation after it, a ``+=`` residual). Spec functions read it while the recording runs
    (:func:`learned`) and note the outputs they keep; the Recorder settles the notes when it
    takes the step's Record, and forgets everything when a module was added, removed or
    replaced (what follows a module may have changed).

    A plain mutable object owned by one :class:`Recorder`: nothing of it outlives the
    recording, and no other recording sees it.
    """

    __slots__ = ("caller", "changed", "checked", "kept", "modules", "walked")

    def __init__(self, walked: Walked, caller: str) -> None:
        self.walked, self.caller = walked, caller
        self.modules = walked()
        self.changed: dict[nn.Module, bool] = {}
        """Per module, whether a later op changed its output in place (absent: not known yet)."""
        self.kept: list[_Kept] = []
        """The notes of the step being recorded."""
        self.checked = True
        """Whether the structure was compared with the last step's for the step being recorded."""

    def check(self, modules: list[nn.Module] | None = None) -> None:
        """Forget what was learned when the model's structure changed since the last step
        (`modules`: the caller's walk of this step, else walked here); done once a step, by
        the Recorder where it knows a step begins, else by the first spec function reading."""
        now = self.walked() if modules is None else modules
        if now is not self.modules:
            self.modules = now
            self.changed.clear()
        self.checked = True

    def note(self, output: torch.Tensor, module: nn.Module, learning: bool) -> None:
        """Note an output kept for the end of the step: `learning`, its module's first
        (learns whether it changed); else one kept without a copy (checked that it did not)."""
        self.kept.append((output, output._version, module, learning))

    def settle(self) -> None:
        """End of a step: learn from the first notes of modules, check the others.

        Raises:
            StaleTensorError: when an output kept without a copy (no later op changed it on
                the earlier steps of this recording) was changed in place after its hook:
                its values on this step are lost. Its module is copied from then on.
        """
        kept, self.kept = self.kept, []
        self.checked = False
        changed = self.changed
        stale = []
        for output, version, module, learning in kept:
            moved = output._version != version
            if learning:
                changed[module] = moved
            elif moved:
                changed[module] = True
                stale.append(module)
        if stale:
            paths = {m: p for p, m in _torch.named_modules(self.walked.model)}
            where = ", ".join(path_label(paths.get(m, type(m).__name__)) for m in dict.fromkeys(stale))
            raise StaleTensorError(
                f"{self.caller}: an output kept without a copy (ActivationStats keeps so the outputs no later op changed "
                f"on earlier steps) must not change after its hook, got the output of module {where} changed in place "
                "on this step, which the earlier steps of this recording never did, so its statistics on this step are "
                "lost. Change it out of place on every step or on none (`y = y * 2`, `inplace=False`), or leave the "
                "module out with `modules=`."
            )

    def drop(self) -> None:
        """A step aborted: its notes go unread."""
        self.kept = []
        self.checked = False


_LEARNED: contextvars.ContextVar[Learned | None] = contextvars.ContextVar("funhooks.learned", default=None)

learned = _LEARNED.get
"""``learned()``: the :class:`Learned` of the recording the calling context is in, while it
records; None elsewhere (a plain ``with_hooks`` block, another thread, a paused recording)."""


class Phase(enum.Enum):
    """Where a :class:`Recorder` is."""

    IDLE = "idle"
    """Nothing attached."""
    RECORDING = "recording"
    """The run in the calling context's scope, the watches reading, :class:`Learned` visible."""
    PAUSED = "paused"
    """Attached, recording nothing (the run out of scope, the watches not reading)."""


class Recorder:
    """What one step's specs and watches stored, one step (or one stretch) at a time."""

    __slots__ = ("caller", "learning", "model", "phase", "specs", "walked", "watching", "_attached", "_entered",
                 "_paused", "_run", "_walk")

    def __init__(self, model: nn.Module, specs: Spec | Iterable[Spec],
                 watches: OptimizerWatch | Iterable[OptimizerWatch], opts: Optimizers | None, caller: str, *,
                 manual_before: bool = False) -> None:
        """Check everything now: specs resolved against the model, watches' layers found.

        Args:
            opts: the optimizer(s) the watches read; None only when there are no watches.
            manual_before: see :class:`~funhooks.training.watch.Watching`.
        """
        self.model, self.caller = model, caller
        self.walked = Walked(model)
        self._walk = self.walked()
        first = make_run(model, specs, caller)  # resolved now; the run of the first step, unless the model changes
        self.specs = first.specs
        self._run: Run | None = first if self.specs else None
        watches = as_watches(watches, caller)
        self.watching = None
        if watches:
            names = {s.name for s in self.specs}
            clash = next((w for w in watches if w.name in names), None)
            if clash is not None:
                raise SpecError(f"{caller}: a watch and a spec store under one name, got {clash.name!r} for both. "
                                "Give the OptimizerWatch another `name=`.")
            self.watching = Watching(model, watches, optimizers(opts, caller), caller, manual_before=manual_before)
        self.learning = Learned(self.walked, caller)
        self.phase = Phase.IDLE
        self._attached = contextlib.ExitStack()  # what :meth:`open` did
        self._paused = contextlib.ExitStack()  # what :meth:`pause` did
        self._entered: Run | None = None  # the run :meth:`open` entered (none without specs)

    @property
    def active(self) -> bool:
        """Whether there is anything to record at all."""
        return bool(self.specs) or self.watching is not None

    @property
    def watches(self) -> Watching | None:
        """The optimizer watches, for a caller that runs ``before`` itself (Lightning)."""
        return self.watching

    # -- the steps of the loops ---------------------------------------------------------

    def step(self, work: Callable[[], T], modules: list[nn.Module] | None = None) -> tuple[T, Record]:
        """``work()`` as one recorded step, attached for it alone, and the step's Record.

        Args:
            modules: the model's modules as the caller walked them for this step
                (:attr:`walked`), if it did.
        """
        if not self.active:
            return work(), EMPTY_RECORD
        self.open(modules)
        try:
            result = work()
        except BaseException:
            self.abort()
            raise
        return result, self.close()

    def held(self, work: Callable[[], T], modules: list[nn.Module]) -> tuple[T, Record]:
        """``work()`` as one recorded step of a recording kept attached from step to step and
        paused between them (:meth:`abort` ends it), and the step's Record: what ``fh.fit`` does,
        where nothing but the reducers runs between steps. The run is made afresh, and the
        watches find their layers again, when a module was added, removed or replaced since
        the last step (as :meth:`step` would).

        Args:
            modules: the model's modules as the loop walked them for this step
                (:attr:`walked`): the very list of the last step while no module was added,
                removed or replaced (so the structure is compared once a step, by the loop).
        """
        if not self.active:
            return work(), EMPTY_RECORD
        same = modules is self._walk
        if self.phase is Phase.PAUSED and (same or not self.specs):
            self._walk = modules
            self.resume(same)
            self.learning.check(modules)
        else:
            self.abort()
            self.open(modules)
        try:
            result = work()
            record = self.take()
        except BaseException:
            self.abort()
            raise
        self.pause(hold=True)
        return result, record

    # -- the phases -----------------------------------------------------------------------

    def _make_run(self, modules: list[nn.Module]) -> Run:
        """A run of the specs on the model as it is now (the constructor's, while the model
        has not changed since); a spec whose selector matches no module any more (a layer
        swapped or removed mid-training) sits the step out (the constructor refused it on the
        model as it was)."""
        run, self._run = self._run, None
        if run is not None and modules is self._walk:
            return run
        try:
            return make_run(self.model, self.specs, self.caller)
        except SelectorError:
            named = list(_torch.named_modules(self.model))
            kept = tuple(s for s in self.specs if any(s.where.matches(p, m) for p, m in named))
            if len(kept) == len(self.specs):
                raise
            return make_run(self.model, kept, self.caller)

    def open(self, modules: list[nn.Module] | None = None) -> None:
        """IDLE -> RECORDING: start recording in the calling context (a ``with_hooks`` block,
        the watches' hooks, :class:`Learned` visible)."""
        if self.phase is not Phase.IDLE:
            self.abort()
        modules = self.walked() if modules is None else modules
        stack = self._attached
        try:
            if self.specs:
                self._entered = stack.enter_context(self._make_run(modules))
            if self.watching is not None:
                stack.callback(self.watching.detach)
                self.watching.attach()
            self.learning.check(modules)
            stack.callback(_undo, _LEARNED.set(self.learning), None)
        except BaseException:
            self.phase = Phase.RECORDING
            self.abort()
            raise
        self._walk = modules
        self.phase = Phase.RECORDING

    def pause(self, *, hold: bool = False) -> None:
        """RECORDING -> PAUSED: record nothing until :meth:`resume` (steps no reducer reads);
        `hold` leaves the optimizer hooks registered, reading nothing (:meth:`held`: nothing
        but the reducers runs before the next step)."""
        if self.phase is not Phase.RECORDING:
            return
        stack = self._paused
        stack.callback(_undo, _LEARNED.set(None), self.learning)
        if self._entered is not None:
            stack.enter_context(self._entered.paused())
        if self.watching is not None:
            self.watching.pause() if hold else self.watching.detach()
        self.phase = Phase.PAUSED

    def resume(self, same: bool = False) -> None:
        """PAUSED -> RECORDING: record again; `same`: the caller saw that no module was added,
        removed or replaced since (the watches need not look)."""
        if self.phase is not Phase.PAUSED:
            return
        self.phase = Phase.RECORDING
        self._paused.close()
        if self.watching is not None:
            self.watching.attach(same=same)

    def take(self) -> Record:
        """RECORDING -> RECORDING: the Record of everything since :meth:`open` or the last
        take; recording goes on.

        Raises:
            StaleTensorError: see :meth:`Learned.settle`.
        """
        record = EMPTY_RECORD if self._entered is None else self._entered.take()
        self.learning.settle()
        return self._merged(record)

    def close(self) -> Record:
        """RECORDING or PAUSED -> IDLE: the Record of everything since :meth:`open` (or the
        last :meth:`take`); nothing of it stays attached."""
        run, paused = self._entered, self.phase is Phase.PAUSED
        self._leave()
        if paused:
            self.learning.drop()
            return self._merged(EMPTY_RECORD)
        record = EMPTY_RECORD if run is None else run.record
        self.learning.settle()
        return self._merged(record)

    def abort(self) -> None:
        """Any phase -> IDLE, after a failure or at the end of :meth:`held`'s steps: everything
        detached, nothing read."""
        try:
            self._leave()
        finally:
            self.learning.drop()
            if self.watching is not None:
                self.watching.take()

    def _leave(self) -> None:
        """Undo what :meth:`pause` and :meth:`open` did (a run checks its calls on leaving
        unless an error is propagating, as a ``with`` block's exit does)."""
        if self.phase is Phase.IDLE:
            return
        self.phase, self._entered = Phase.IDLE, None
        try:
            self._paused.close()
        finally:
            self._attached.close()

    def _merged(self, record: Record) -> Record:
        """`record` with the watches' values added, paths in module order."""
        watching = self.watching
        data: Stored = watching.take() if watching is not None else []
        if not data or watching is None:
            return record
        by_path: dict[str, dict[str, tuple[object, ...]]] = {}
        for name, values in data:  # a watch's values of one optimizer step
            for path, value in values.items():
                node = by_path.get(path)
                if node is None:
                    by_path[path] = {name: (value,)}
                else:
                    calls = node.get(name)
                    node[name] = (value,) if calls is None else (*calls, value)
        return merge([record, trusted(by_path)], order=watching.key)


def _undo(token: contextvars.Token[Learned | None], value: Learned | None) -> None:
    """Undo a ``_LEARNED.set``; in another context than the one it was made in (a generator
    resumed or finished elsewhere), set `value` there instead."""
    try:
        _LEARNED.reset(token)
    except ValueError:
        _LEARNED.set(value)
