"""Reducers in PyTorch Lightning: a ``Callback`` that folds them over ``Trainer.fit``.

``FoldCallback(reducers)`` takes the reducers ``fh.fit`` takes (``ActivationStats``,
``HookCallback``, ``GradientStats``, yours) and runs them, unchanged, on the training steps
of a ``lightning.Trainer``: one Step per optimizer step (``accumulate_grad_batches``
micro-batches each, the Step's loss their mean), the specs attached from the first
micro-batch's ``on_train_batch_start`` to the ``on_train_batch_end`` after the update, the
optimizer watches read around the update (``before`` in ``on_before_optimizer_step``, which
Lightning calls after its gradients are unscaled and before it clips them). Validation and
sanity checks run outside those steps and are never recorded. A Step's ``epoch`` and
``iteration`` are the Trainer's ``current_epoch`` and ``global_step``, so a new callback on a
run resumed with ``fit(ckpt_path=...)`` numbers its steps on from the checkpoint's (and its
states merge with the first run's). ``cb.result`` holds the results in the shape of `reducers`.

With ``log_every=k`` the callback also logs the reducers' scalars of the step (see
:mod:`funhooks.training.logged`; a reducer that did not record the step is not logged there)
after every step whose ``global_step`` is a multiple of `k`,
to each of ``trainer.loggers`` (``log_metrics(..., step=global_step)``: TensorBoard, W&B, CSV),
named ``funhooks/<key>/<layer>/<statistic>`` (``funhooks/activations/net.0/std``). The
interval is the callback's, not ``log_every_n_steps``. Off by default: each log reads the
statistics to the host (a CUDA sync), and a large model puts several series per layer on the
dashboard; choose the reducers, their keys and `k`, then turn it on.

Needs the ``lightning`` extra (``pip install 'funhooks[lightning]'``); ``import funhooks``
never imports Lightning.

Cost: what the reducers cost in ``fh.fit``, plus a few callback calls per step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from funhooks.errors import ExtraError
from funhooks.training.folds import Reducers
from funhooks.training.stepwise import Results, Stepwise, misplaced

try:
    import lightning.pytorch as pl
except ImportError:
    raise ExtraError(
        "funhooks.lightning: the Lightning callback needs lightning, got it not installed. "
        "Install the extra: pip install 'funhooks[lightning]'."
    ) from None

if TYPE_CHECKING:
    from lightning.pytorch.utilities.types import STEP_OUTPUT

__all__ = ["FoldCallback"]


class FoldCallback(Results, pl.Callback):
    """Fold reducers over the training steps of a ``lightning.Trainer``.

    Args:
        reducers: a dict or a list of reducers (a single reducer gives its result).
        log_every: log the reducers' scalars to the trainer's loggers every that many steps;
            None (the default): do not log.

    Attributes:
        result: the reducers' results in the shape of `reducers`, over the steps trained so
            far (read it after ``trainer.fit``).
        states: their states (for ``fh.merge_across_ranks`` on each rank).

    Raises:
        ReducerError: at construction, for an entry that lacks the reducer protocol.
        LoopError: at construction, for a `log_every` that is not a positive int or None.
        SpecError, SelectorError: when training starts, for specs or watches that do not fit
            the LightningModule (paths are those of the LightningModule).

    Example:
        >>> import torch, lightning, funhooks as fh
        >>> from torch import nn
        >>> class Regressor(lightning.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        ...     def training_step(self, batch, batch_idx):
        ...         x, y = batch
        ...         return nn.functional.mse_loss(self.net(x), y)
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.05)
        >>> data = torch.utils.data.TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
        >>> cb = fh.lightning.FoldCallback({"acts": fh.ActivationStats(), "grads": fh.GradientStats()})
        >>> trainer = lightning.Trainer(max_epochs=2, callbacks=[cb], accelerator="cpu", logger=False,
        ...                             enable_checkpointing=False, enable_progress_bar=False,
        ...                             enable_model_summary=False)
        >>> trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=8))
        >>> cb.result["acts"].paths, len(cb.result["grads"])
        (('net.0', 'net.2'), 8)
    """

    def __init__(self, reducers: Reducers, *, log_every: int | None = None) -> None:
        super().__init__()
        self._fold = Stepwise(reducers, "FoldCallback", log_every)
        self._global_step = 0
        self._normalize = 1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Resolve the reducers' specs on the module and their watches on its optimizers."""
        self._fold.start(pl_module, list(trainer.optimizers), manual_before=True)
        self._normalize = trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """The first micro-batch of an optimizer step opens the step."""
        if not self._fold.open:
            self._global_step = trainer.global_step
        self._fold.begin(trainer.current_epoch, trainer.global_step)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """The gradients are final (unscaled, before Lightning's clipping): the watches' ``before``."""
        self._fold.before_update(optimizer)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any,
                           batch_idx: int) -> None:
        """Add the micro-batch's loss; after the optimizer stepped, the step ends (and, on a
        logging step, its scalars go to the trainer's loggers)."""
        if isinstance(outputs, Mapping):
            loss, metrics = outputs.get("loss"), {k: v for k, v in outputs.items() if k != "loss"}
        else:
            loss, metrics = outputs, None
        if loss is not None and self._normalize != 1:
            loss = loss * self._normalize  # Lightning hands back the loss divided by the accumulation
        self._fold.add(loss, metrics)
        if trainer.global_step != self._global_step:
            step = self._fold.end()
            metrics = self._fold.scalars(step)
            if metrics and step is not None:
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=step.iteration)
                    logger.save()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A step left open (training stopped mid-accumulation) is dropped."""
        self._fold.abort()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Training raised: the open step is dropped, nothing stays attached."""
        self._fold.abort()

    def on_init_end(self, *args: object, **kwargs: object) -> None:
        """The first call of a ``transformers.Trainer`` to its callbacks: this one is Lightning's.

        Raises:
            LoopError: always, naming ``fh.hf.FoldCallback``.
        """
        raise misplaced("lightning", "hf")
