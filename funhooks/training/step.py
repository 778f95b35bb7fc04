"""Step: one training or evaluation step, as a frozen value.

Every way of watching training in funhooks (``fh.train`` and ``fh.evaluate``, a loop you
write with ``fh.folding``, the Lightning and Hugging Face callbacks) produces the same
values: a ``Step`` holds the epoch, the iteration, the detached loss, whatever else the
training step returned (``metrics``) and the Record of what the specs (and optimizer
watches) stored during that step. Reducers fold over them and never see where they came from.

A Step is a registered pytree (with key paths), so ``torch.utils._pytree`` and
``torch.func`` see its tensors: the loss, the record's values and the metrics.

Cost: one small object per step; nothing is copied or read from a device.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeAlias

import attrs
import torch

from funhooks import _torch
from funhooks._frozen import frozen
from funhooks.records.record import Record

__all__ = ["EMPTY_RECORD", "Metrics", "Step"]

EMPTY_RECORD = Record()
"""The Record of a step that ran with the hooks paused (or without specs)."""

Metrics: TypeAlias = Mapping[str, Any]
"""What a training step returned besides its loss, by name: the user's values."""

_NO_METRICS: Metrics = types.MappingProxyType({})


def _as_metrics(value: Metrics | None) -> Metrics:
    """A read-only copy of `value` (None: empty)."""
    if not value:
        return _NO_METRICS
    return value if isinstance(value, types.MappingProxyType) else types.MappingProxyType(dict(value))


@frozen
@attrs.frozen(eq=False)
class Step:
    """One step of a training or evaluation run, as a frozen value.

    Attributes:
        epoch: the epoch, from 0 (always 0 for :func:`~funhooks.evaluate`).
        iteration: the global train-step index from 0, counted across epochs (one per
            optimizer step: micro-batches accumulated into one step are one iteration; a
            resumed run goes on from ``start_iteration``, a trainer callback from the
            trainer's global step; for :func:`~funhooks.evaluate`, the batch index within the
            evaluation).
        loss: the step's loss, a detached 0-d tensor on the model's device (``None`` when
            there is none). Call ``float(step.loss)`` to read it: that syncs a GPU, so do it
            only where you need the number.
        record: what the specs stored during this step (forward and backward, every
            micro-batch), plus what optimizer watches stored at its optimizer step.
        training: True for training steps, False for evaluation steps.
        metrics: everything else the training step returned besides the loss (a custom
            step returning a dict; Lightning's ``training_step`` dict), detached, read-only;
            empty by default.

    Example:
        >>> import torch, funhooks as fh
        >>> step = fh.Step(epoch=0, iteration=3, loss=torch.tensor(0.5), record=fh.Record(), training=True)
        >>> step.iteration, float(step.loss), dict(step.metrics)
        (3, 0.5, {})
        >>> step.iteration = 4
        Traceback (most recent call last):
        ...
        funhooks.errors.FrozenError: Step: a frozen value cannot be assigned to, got `.iteration = ...`. Build a new one with `attrs.evolve(step, iteration=...)`.
        >>> import torch.utils._pytree as pytree
        >>> [pytree.keystr(k) for k, _ in pytree.tree_flatten_with_path(step)[0]]
        ['.loss']
    """

    epoch: int
    iteration: int
    loss: torch.Tensor | None
    record: Record
    training: bool
    metrics: Metrics = attrs.field(default=None, converter=_as_metrics)
    _hint: ClassVar[str] = "Build a new one with `attrs.evolve(step, {key}=...)`."

    def __reduce__(self) -> tuple[type[Step], tuple[object, ...]]:
        return (Step, (self.epoch, self.iteration, self.loss, self.record, self.training, dict(self.metrics)))


_Context: TypeAlias = tuple[int, int, bool]
"""A Step's pytree context: ``(epoch, iteration, training)``."""


def _flatten(step: Step) -> tuple[list[object], _Context]:
    return [step.loss, step.record, dict(step.metrics)], (step.epoch, step.iteration, step.training)


def _unflatten(children: Iterable[Any], context: _Context) -> Step:
    loss, record, metrics = children
    epoch, iteration, training = context
    return Step(epoch, iteration, loss, record, training, metrics)


def _flatten_with_keys(step: Step) -> tuple[list[tuple[_torch.pytree.GetAttrKey, object]], _Context]:
    children, context = _flatten(step)
    keys = [_torch.pytree.GetAttrKey(name) for name in ("loss", "record", "metrics")]
    return list(zip(keys, children)), context


_torch.register_pytree(Step, _flatten, _unflatten, "funhooks.Step", flatten_with_keys=_flatten_with_keys)
