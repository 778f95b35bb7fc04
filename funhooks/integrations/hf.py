"""Reducers in the Hugging Face ``Trainer``: a ``TrainerCallback`` that folds them over training.

``FoldCallback(reducers)`` takes the reducers ``fh.fit`` takes (``ActivationStats``,
``HookCallback``, ``GradientStats``, yours) and runs them, unchanged, on the optimizer steps
of a ``transformers.Trainer``: one Step per optimizer step (``gradient_accumulation_steps``
micro-batches each), the specs attached from ``on_step_begin`` to ``on_step_end``, the
optimizer watches read around the update of the Trainer's optimizer (after its gradient
clipping). The Trainer hands callbacks no loss, so the Step's loss is made, as the Trainer
makes the loss it logs, from the ``loss`` the model returned on the step's micro-batches (a
model called with ``labels``): their sum when the Trainer passed ``num_items_in_batch`` (the
model then divides by the whole step's token count), their mean otherwise; None when the loss
is computed outside the model. Evaluation runs outside the steps and is
never recorded. A Step's ``epoch`` and ``iteration`` are the Trainer's epoch and
``state.global_step``, so a new callback on a run resumed with
``train(resume_from_checkpoint=...)`` numbers its steps on from the checkpoint's (and its
states merge with the first run's). ``cb.result`` holds the results in the shape of `reducers`.

With ``log_every=k`` and ``trainer=`` the callback also logs the reducers' scalars of the step
(see :mod:`funhooks.training.logged`; a reducer that did not record the step is not logged
there) after every step whose iteration is a multiple of `k`, through
``trainer.log``: so they land in ``state.log_history`` and reach every ``report_to`` integration
(TensorBoard, W&B, ...) at the Trainer's step (its ``global_step`` after the update, one past
the Step's iteration), named ``funhooks/<key>/<layer>/<statistic>`` (which the integrations,
as for every training log, put under ``train/``). The Trainer hands its
callbacks no Trainer, hence ``trainer=`` (make the Trainer first, then ``trainer.add_callback(cb)``).
Off by default: each log reads the statistics to the host (a CUDA sync), and a large model
puts several series per layer on the dashboard; choose the reducers, their keys and `k`, then
turn it on.

The Trainer calls no callback when training raises, so a step open at that moment stays
attached until the callback is closed: use it as a context manager (``with
fh.hf.FoldCallback(...) as cb:``) or call ``cb.close()``; the next ``trainer.train()`` closes
it too.

Needs the ``hf`` extra (``pip install 'funhooks[hf]'``); ``import funhooks`` never imports
transformers.

Cost: what the reducers cost in ``fh.fit``, plus a run on the model's root per step (its
loss, and its keyword arguments' names).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from funhooks.errors import ExtraError, LoopError
from funhooks.specs.spec import inputs, observe
from funhooks.training.folds import Reducers
from funhooks.training.recorder import Recorder
from funhooks.training.stepwise import Results, Stepwise, misplaced

try:
    import transformers
except ImportError:
    raise ExtraError(
        "funhooks.hf: the Trainer callback needs transformers, got it not installed. "
        "Install the extra: pip install 'funhooks[hf]'."
    ) from None

__all__ = ["FoldCallback"]

_LOSS = "model_loss"
"""The record name of the loss the model returned, in the callback's own run on the root."""


def _model_loss(module: nn.Module, args: tuple[object, ...], output: object) -> torch.Tensor | None:
    """A copy of the ``loss`` of a model output (a ``ModelOutput``, a dict); None without one.
    (A copy: the Trainer scales the loss in place after the model returns it.)"""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss.detach().clone() if isinstance(loss, torch.Tensor) else None


class FoldCallback(Results, transformers.TrainerCallback):
    """Fold reducers over the optimizer steps of a ``transformers.Trainer``.

    Args:
        reducers: a dict or a list of reducers (a single reducer gives its result).
        log_every: log the reducers' scalars through ``trainer.log`` every that many steps;
            None (the default): do not log.
        trainer: the ``transformers.Trainer`` this callback is added to (needed by `log_every`).

    Attributes:
        result: the reducers' results in the shape of `reducers`, over the steps trained so
            far (read it after ``trainer.train()``).
        states: their states (for ``fh.merge_across_ranks`` on each rank).

    Raises:
        ReducerError: at construction, for an entry that lacks the reducer protocol.
        LoopError: at construction, for a `log_every` that is not a positive int or None, or
            one without `trainer`.
        SpecError, SelectorError: when training starts, for specs or watches that do not fit
            the model.

    Example:
        >>> import tempfile, torch, transformers, funhooks as fh
        >>> config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=16, vocab_size=32,
        ...                                  bos_token_id=0, eos_token_id=0)
        >>> _ = torch.manual_seed(0)
        >>> model = transformers.GPT2LMHeadModel(config)
        >>> ids = torch.randint(0, 32, (16, 8))
        >>> data = [{"input_ids": i, "labels": i} for i in ids]
        >>> cb = fh.hf.FoldCallback({"grads": fh.GradientStats(), "loss": fh.LossCurve()})
        >>> with tempfile.TemporaryDirectory() as out, cb:
        ...     args = transformers.TrainingArguments(out, per_device_train_batch_size=4, num_train_epochs=2,
        ...                                           report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
        ...     trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=[cb])
        ...     trainer.remove_callback(transformers.PrinterCallback)  # no printed logs
        ...     _ = trainer.train()
        >>> len(cb.result["loss"]), cb.result["grads"].paths[:2]
        (8, ('transformer.wte', 'transformer.wpe'))
    """

    def __init__(self, reducers: Reducers, *, log_every: int | None = None,
                 trainer: transformers.Trainer | None = None) -> None:
        self._fold = Stepwise(reducers, "FoldCallback", log_every)
        if log_every is not None and trainer is None:
            raise LoopError(
                "FoldCallback: `log_every` logs through `Trainer.log`, got no `trainer`. Make the Trainer first, then "
                f"`cb = fh.hf.FoldCallback(reducers, log_every={log_every}, trainer=trainer)` and "
                "`trainer.add_callback(cb)`."
            )
        self._trainer = trainer
        self._losses: Recorder | None = None
        self._losses_open = False
        self._epoch = 0

    def close(self) -> None:
        """Drop a step left open (training raised): nothing stays attached."""
        if self._losses_open and self._losses is not None:
            self._losses.abort()
        self._losses_open = False
        self._fold.abort()

    def __enter__(self) -> FoldCallback:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_train_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, model: Any = None,
                       optimizer: torch.optim.Optimizer | None = None, **kwargs: object) -> None:
        """Resolve the reducers' specs on the model and their watches on its optimizer."""
        self.close()
        self._fold.start(model, optimizer)
        specs = [observe("", _model_loss, name=_LOSS, detach=False), inputs("")]
        self._losses = Recorder(model, specs, (), None, "FoldCallback")
        self._epoch = 0

    def on_epoch_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                       control: transformers.TrainerControl, **kwargs: object) -> None:
        """The Trainer's epoch, from 0 (resumed: the checkpoint's, whose ``state.epoch`` counts
        the epochs done, a fraction for one done in part)."""
        self._epoch = int(state.epoch or 0)

    def on_step_begin(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                      control: transformers.TrainerControl, **kwargs: object) -> None:
        """The first micro-batch of an optimizer step opens the step, numbered by the Trainer's
        global step."""
        self._fold.begin(self._epoch, state.global_step)
        if self._losses is not None and not self._losses_open:
            self._losses.open()
            self._losses_open = True

    def on_step_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                    control: transformers.TrainerControl, **kwargs: object) -> None:
        """After the optimizer's update the step ends, with the mean of the model's losses (and,
        on a logging step, its scalars go to ``trainer.log``)."""
        if self._losses_open and self._losses is not None:
            self._losses_open = False
            record = self._losses.close()
            if "" in record:
                losses = [loss for loss in record.calls("", _LOSS) if loss is not None]
                summed = any("num_items_in_batch" in kwargs for _, kwargs in record.calls("", "input"))
                if losses:
                    self._fold.add(torch.stack(losses).sum() if summed else torch.stack(losses).mean())
        metrics = self._fold.scalars(self._fold.end())
        if metrics and self._trainer is not None:
            self._trainer.log(metrics)

    def on_train_end(self, args: transformers.TrainingArguments, state: transformers.TrainerState,
                     control: transformers.TrainerControl, **kwargs: object) -> None:
        """A step left open (training stopped mid-accumulation) is dropped."""
        self.close()

    @property
    def state_key(self) -> str:
        """The name a ``lightning.Trainer`` reads before calling a callback (then :meth:`setup` refuses)."""
        return type(self).__qualname__

    def setup(self, *args: object, **kwargs: object) -> None:
        """The first call of a ``lightning.Trainer`` to its callbacks: this one is the Hugging Face Trainer's.

        Raises:
            LoopError: always, naming ``fh.lightning.FoldCallback``.
        """
        raise misplaced("hf", "lightning")

    def on_exception(self, *args: object, **kwargs: object) -> None:
        """Lightning's call after :meth:`setup` refused: nothing was attached, nothing to undo."""
