"""What the Lightning and Hugging Face callbacks share: reducers advanced by the steps a
training framework brackets with its own callbacks.

A framework says when an optimizer step begins (its first micro-batch, with the trainer's
epoch and global step: a resumed run numbers its steps on from the checkpoint's) and when it
has ended (after the optimizer's update); :class:`Stepwise` opens a :class:`~funhooks.training.recorder.Recorder`
at the first (when some reducer reads the step), closes it at the second, builds the Step with
the micro-batches' mean loss and advances every reducer's state. Between steps nothing is
attached. A step that raises is aborted: everything detached, nothing read. With
``log_every=k``, :meth:`Stepwise.scalars` gives the reducers' scalars (see
:mod:`funhooks.training.logged`) after every step whose iteration is a multiple of `k`, for the
callback to hand to its trainer's loggers.

Cost: per step, what :class:`~funhooks.training.recorder.Recorder` costs (nothing on steps no reducer
records), one Step and each reducer's ``step``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from funhooks.errors import LoopError

from . import _one_step
from ._one_step import Optimizers
from .folds import Reducers, as_items, records_of, watches_of
from .logged import check_log_every, group_names, scalars_of
from .recorder import Recorder
from .step import EMPTY_RECORD, Metrics, Step

__all__ = ["Results", "Stepwise", "misplaced"]

_TRAINERS = {"hf": ("transformers.Trainer", "Hugging Face"), "lightning": ("lightning.Trainer", "Lightning")}
"""Each callback module's trainer: its class and the name its docs give it."""


def misplaced(ours: str, theirs: str) -> LoopError:
    """The error for ``fh.<ours>.FoldCallback`` called by the trainer of ``fh.<theirs>``."""
    return LoopError(
        f"FoldCallback: `fh.{ours}.FoldCallback` is a callback of `{_TRAINERS[ours][0]}`, got it in a "
        f"`{_TRAINERS[theirs][0]}`. Pass `fh.{theirs}.FoldCallback(reducers)` to the {_TRAINERS[theirs][1]} Trainer."
    )


class Stepwise:
    """Reducers folded over the optimizer steps a framework brackets."""

    def __init__(self, reducers: Reducers, caller: str, log_every: int | None = None) -> None:
        self.caller = caller
        self.shape, self.items = as_items(reducers, caller)
        self.log_every = check_log_every(log_every, caller, "log_every")
        self.names = group_names(reducers)
        self.specs = tuple(dict.fromkeys(s for r in self.items for s in r.specs))
        self.watches = tuple(dict.fromkeys(w for r in self.items for w in watches_of(r)))
        self.records = records_of(self.items)
        self.states = [r.init() for r in self.items]
        self.recorder: Recorder | None = None
        self.iteration = 0
        self.epoch = 0
        self.open = False
        self.recording = False
        self.losses: list[torch.Tensor] = []
        self.metrics: dict[str, object] = {}

    def start(self, model: nn.Module, opts: Optimizers | None, *, manual_before: bool = False) -> None:
        """Resolve the specs and watches against the model and its optimizer(s), before training."""
        if self.watches and not opts:
            raise LoopError(f"{self.caller}: a reducer watches the optimizer step (`watches`), got a trainer without "
                            "an optimizer. Configure one before training.")
        self.abort()
        self.recorder = Recorder(model, self.specs, self.watches, opts if self.watches else None, self.caller,
                                 manual_before=manual_before)

    def begin(self, epoch: int, iteration: int) -> None:
        """A step begins (its first micro-batch), the trainer's global step `iteration`; a step
        already open goes on (accumulation)."""
        if self.open or self.recorder is None:
            return
        self.epoch, self.iteration, self.losses, self.metrics, self.open = epoch, iteration, [], {}, True
        if self.recorder.active and (self.records is None or self.records(self.iteration, True)):
            self.recorder.open()
            self.recording = True

    def add(self, loss: object, metrics: Metrics | None = None) -> None:
        """One micro-batch's loss (and other outputs) of the open step."""
        if not self.open:
            return
        loss, extra = _one_step.outcome(loss, self.caller)
        if loss is not None:
            self.losses.append(loss)
        self.metrics.update(extra or {})
        self.metrics.update(metrics or {})

    def before_update(self, optimizer: torch.optim.Optimizer) -> None:
        """The watches' ``before``, for frameworks that run it themselves (Lightning)."""
        if self.recording and self.recorder is not None and self.recorder.watches is not None:
            self.recorder.watches.before(optimizer)

    def end(self) -> Step | None:
        """The open step has ended: its Step, every reducer advanced by it (None: none open)."""
        if not self.open:
            return None
        record = EMPTY_RECORD
        if self.recording:
            self.recording = False
            record = self.recorder.close()  # type: ignore[union-attr]
        self.open = False
        loss = None
        if self.losses:
            loss = self.losses[0] if len(self.losses) == 1 else torch.stack(
                [t.to(self.losses[0].device) for t in self.losses]).mean()
        step = Step(self.epoch, self.iteration, loss, record, True, self.metrics)
        self.states = [r.step(s, step) for r, s in zip(self.items, self.states)]
        return step

    def scalars(self, step: Step | None) -> dict[str, float]:
        """The reducers' scalars to log after `step` (``funhooks/<group>/<layer>/<statistic>``,
        of the reducers that recorded `step` itself); ``{}`` on other steps and without
        ``log_every``."""
        if step is None or self.log_every is None or step.iteration % self.log_every:
            return {}
        return scalars_of(self.names, self.items, self.states, step.iteration)

    def abort(self) -> None:
        """Drop an open step (training raised or stopped mid-step): everything detached."""
        if self.recording and self.recorder is not None:
            self.recorder.abort()
        self.recording = self.open = False

    def result(self) -> Any:
        """The reducers' results so far, in the shape of the reducers."""
        return self.shape([r.result(s) for r, s in zip(self.items, self.states)])


class Results:
    """What the trainer callbacks share: their :class:`Stepwise`'s results and states."""

    _fold: Stepwise

    @property
    def result(self) -> Any:
        """The reducers' results over the steps so far, in the shape of `reducers`."""
        return self._fold.result()

    @property
    def states(self) -> Any:
        """The reducers' states, in the shape of `reducers`."""
        return self._fold.shape(list(self._fold.states))
