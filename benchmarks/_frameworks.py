"""The Lightning and Hugging Face cases of ``bench_train.py``: reducers in a real trainer.

A trainer's ``fit`` / ``train`` spends a second or more setting itself up, so these cases do
not time whole calls: a timing callback, first in the trainer's list, reads this thread's
CPU time when step ``WARM_STEPS`` begins and when the last step ends, and a case's time is
that span per step. Every case trains a fresh copy of the same deep-narrow model on the same
batches with SGD; rounds are interleaved like ``_common.time_cases``' (order rotated), and
each case's time per step is compared with the bare trainer's of the same round.

Reported per reducer set: the trainer's ratio with the callback to the bare trainer, and the
time the callback adds per step against the time the same reducers add to ``fh.fit`` (the
issue's bound: at most 5% more).
"""

from __future__ import annotations

import atexit
import copy
import gc
import logging
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _common
import funhooks as fh

WARM_STEPS = 4
"""Steps each trainer runs before the timed span starts (its own warm-up: caches, first calls)."""


def _thread_time() -> float:
    return time.thread_time()


def _quiet() -> None:
    """No set-up chatter per fit (the libraries set their loggers' levels when imported), and
    not lightning 2.6's own deprecation warning under torch >= 2.10."""
    for name in ("lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)


def lightning_case(base: nn.Module, batches: list, reducers: Any, steps: int) -> Callable[[], float] | None:
    """A callable training `steps` Lightning steps, returning seconds per timed step; None without lightning."""
    try:
        import lightning
    except ImportError:
        return None
    _quiet()

    class Module(lightning.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Timer(lightning.Callback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == WARM_STEPS and not self.start:
                self.start = _thread_time()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self.end = _thread_time()

    def call() -> float:
        timer = Timer()
        callbacks = [timer] + ([] if reducers is None else [fh.lightning.FoldCallback(reducers)])
        trainer = lightning.Trainer(max_steps=steps, callbacks=callbacks, accelerator="cpu", devices=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    num_sanity_val_steps=0)
        trainer.fit(Module(copy.deepcopy(base)), torch.utils.data.DataLoader(batches, batch_size=None))
        return (timer.end - timer.start) / (steps - WARM_STEPS)

    return call


def hf_case(base: nn.Module, batches: list, reducers: Any, steps: int) -> Callable[[], float] | None:
    """A callable training `steps` Trainer steps, returning seconds per timed step; None without transformers."""
    try:
        import accelerate  # noqa: F401  (the Trainer needs it)
        import transformers
    except ImportError:
        return None
    _quiet()

    class Model(nn.Module):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": nn.functional.mse_loss(self.net(x), labels)}

    class Timer(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.start = self.end = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == WARM_STEPS and not self.start:
                self.start = _thread_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.end = _thread_time()

    examples = [{"x": x[i], "labels": y[i]} for x, y in batches for i in range(len(x))]
    out = tempfile.mkdtemp(prefix="fh-bench-hf-")
    atexit.register(shutil.rmtree, out, ignore_errors=True)  # the Trainer's output_dir, left empty

    def call() -> float:
        model = Model(copy.deepcopy(base))
        args = transformers.TrainingArguments(out, per_device_train_batch_size=len(batches[0][0]), max_steps=steps,
                                              report_to=[], save_strategy="no", logging_strategy="no",
                                              use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0)
        timer = Timer()
        callbacks = [timer] + ([] if reducers is None else [fh.hf.FoldCallback(reducers)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=examples, callbacks=callbacks,
                                       optimizers=(opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
        trainer.remove_callback(transformers.PrinterCallback)
        trainer.train()
        torch.set_num_threads(1)  # keep every case on one thread
        return (timer.end - timer.start) / (steps - WARM_STEPS)

    return call


def time_frameworks(cases: dict[str, Callable[[], float]], baselines: dict[str, str], rounds: int) -> dict[str, Any]:
    """Interleaved rounds; per case the seconds per step, the ratio to its baseline and the
    seconds per step it adds to it (medians and quartiles over rounds)."""
    names = list(cases)
    per_step: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            gc.collect()
            per_step[name].append(cases[name]())
    out = {}
    for name in names:
        base = baselines.get(name, name)
        pairs = list(zip(per_step[name], per_step[base]))
        out[name] = {"seconds_per_step": _common.summarise(per_step[name]),
                     "ratio": _common.summarise([a / b for a, b in pairs]),
                     "added_seconds_per_step": _common.summarise([a - b for a, b in pairs]), "baseline": base}
    return out


def format_table(results: dict[str, Any]) -> str:
    """The framework cases as a plain-text table."""
    lines = [f"  {'case':<58} {'us/step':>8} {'ratio':>6} {'added us/step':>14}"]
    for name, r in results.items():
        lines.append(f"  {name:<58} {r['seconds_per_step']['median'] * 1e6:8.1f} {r['ratio']['median']:6.2f} "
                     f"{r['added_seconds_per_step']['median'] * 1e6:14.1f}")
    return "\n".join(lines)
