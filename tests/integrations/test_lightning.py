"""fh.lightning.FoldCallback: the reducers of fh.fit, unchanged, in a real lightning.Trainer (issue 16)."""

from __future__ import annotations

import copy
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch import nn

import funhooks as fh

lightning = pytest.importorskip("lightning", reason="the `lightning` extra is not installed")

MSE = nn.functional.mse_loss
EPOCHS = 2
BATCH = 8


class Regressor(lightning.LightningModule):
    """A small MLP trained with MSE and SGD; `fail_at` raises in that training step."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if batch_idx == self.fail_at:
            raise ArithmeticError("nan loss")
        x, y = batch
        loss = MSE(self(x), y)
        return {"loss": loss, "batch": torch.tensor(float(batch_idx))}

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Validated(Regressor):
    """The same, with a validation loop."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch[0])


def _data(n: int = 32) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))


def _trainer(cb: Any, **kwargs: Any) -> Any:
    return lightning.Trainer(callbacks=[cb], accelerator="cpu", devices=1, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                             **{"max_epochs": EPOCHS, "logger": False, **kwargs})


def _reducers() -> dict:
    return {"acts": fh.ActivationStats(), "grads": fh.GradientStats(), "update": fh.UpdateRatio(every=2),
            "dead": fh.DeadUnits(), "loss": fh.LossCurve(), "calls": fh.HookCallback(lambda m, i, o: o.shape[0])}


def test_lightning_training_folds_what_fit_folds() -> None:
    """Trainer.fit with the callback and fh.fit on the same module, data and optimizer give the
    same results for every reducer; the step metrics carry the training step's extra outputs."""
    module = Regressor()
    twin = copy.deepcopy(module)
    cb = fh.lightning.FoldCallback(_reducers())
    _trainer(cb).fit(module, torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    batches = list(torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    fitted = fh.fit(twin, batches, MSE, torch.optim.SGD(twin.parameters(), lr=0.05), _reducers(), epochs=EPOCHS)
    got = cb.result
    assert got["acts"].paths == ("net.0", "net.2", "net.4") and len(got["acts"]) == 8
    assert got["acts"].stats == fitted["acts"].stats
    assert got["grads"].stats == fitted["grads"].stats and got["update"].ratios == fitted["update"].ratios
    assert got["dead"].dead == fitted["dead"].dead and got["loss"].losses == fitted["loss"].losses
    assert got["calls"] == fitted["calls"]
    assert all(torch.equal(p, q) for p, q in zip(module.parameters(), twin.parameters()))
    fh.testing.assert_no_hooks(module)


def test_accumulated_batches_are_one_step_and_validation_is_never_recorded() -> None:
    """accumulate_grad_batches=2: one Step per optimizer step holding both micro-batches, the
    loss their mean; the validation loop's calls are in no step."""
    module = Validated()
    seen: list[int] = []
    calls = fh.HookCallback(lambda m, i, o: seen.append(o.shape[0]) or o.shape[0], modules="net.0")
    cb = fh.lightning.FoldCallback({"calls": calls, "loss": fh.LossCurve()})
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    _trainer(cb, accumulate_grad_batches=2).fit(module, loader, torch.utils.data.DataLoader(_data(8), batch_size=4))
    assert len(cb.result["calls"]) == EPOCHS * 2 and len(cb.result["loss"]) == EPOCHS * 2
    assert len(seen) == EPOCHS * 4  # the validation batches went through net.0 unrecorded
    twin = Regressor()
    with torch.no_grad():
        first = [MSE(twin(x), y).item() for x, y in list(loader)[:2]]
    assert cb.result["loss"].losses[0] == pytest.approx(sum(first) / 2)


def test_an_exception_in_training_leaves_nothing_attached() -> None:
    """A training step that raises: Lightning's on_exception drops the open step; no wrapper on
    the module, no hook on the optimizer."""
    module = Regressor(fail_at=2)
    cb = fh.lightning.FoldCallback([fh.ActivationStats(), fh.GradientStats()])
    trainer = _trainer(cb)
    with pytest.raises(ArithmeticError):
        trainer.fit(module, torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    fh.testing.assert_no_hooks(module)
    assert all(not o._optimizer_step_pre_hooks and not o._optimizer_step_post_hooks for o in trainer.optimizers)
    assert len(cb.result[0]) == 2


def test_missing_lightning_names_the_extra() -> None:
    """Without lightning, `fh.lightning` raises ExtraError naming `funhooks[lightning]`; importing
    funhooks imports neither Lightning nor transformers."""
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "import funhooks as fh\n"
        "assert 'lightning' not in sys.modules or sys.modules['lightning'] is None\n"
        "assert 'transformers' not in sys.modules\n"
        "try:\n    fh.lightning\nexcept fh.ExtraError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        "funhooks.lightning: the Lightning callback needs lightning, got it not installed. "
        "Install the extra: pip install 'funhooks[lightning]'."
    )


class Numbers:
    """A reducer keeping each Step's `(epoch, iteration)`."""

    specs = ()

    def init(self) -> tuple:
        return ()

    def step(self, state: tuple, step: fh.Step) -> tuple:
        return (*state, (step.epoch, step.iteration))

    def result(self, state: tuple) -> tuple:
        return state


def test_a_resumed_fit_numbers_its_steps_by_the_global_step(tmp_path: pathlib.Path) -> None:
    """A new callback after `fit(ckpt_path=...)` numbers its Steps with the Trainer's global step
    and epoch; merged with the first run's state, the loss curve is the uninterrupted run's (issue 26)."""
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH)
    curve = fh.LossCurve()
    whole = fh.lightning.FoldCallback([Numbers(), curve])
    _trainer(whole).fit(Regressor(), loader)
    first = fh.lightning.FoldCallback([Numbers(), curve])
    trainer = _trainer(first, max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(module := Regressor(), loader)
    trainer.save_checkpoint(tmp_path / "epoch0.ckpt")
    resumed = fh.lightning.FoldCallback([Numbers(), curve])
    _trainer(resumed, default_root_dir=tmp_path).fit(module, loader, ckpt_path=tmp_path / "epoch0.ckpt")
    assert first.result[0] == tuple((0, i) for i in range(4))
    assert resumed.result[0] == tuple((1, i) for i in range(4, 8))
    merged = curve.result(curve.merge(first.states[1], resumed.states[1]))
    assert merged.iterations == tuple(range(8))
    assert merged.losses == pytest.approx(whole.result[1].losses, rel=1e-6)


def test_the_hf_callback_in_a_lightning_trainer_is_named() -> None:
    """fh.hf.FoldCallback given to a lightning.Trainer: a LoopError saying which callback belongs
    where, not an AttributeError for `setup` / `on_exception`."""
    pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    module = Regressor()
    with pytest.raises(fh.LoopError) as err:
        _trainer(fh.hf.FoldCallback([fh.LossCurve()])).fit(module, torch.utils.data.DataLoader(_data(), batch_size=8))
    assert str(err.value) == (
        "FoldCallback: `fh.hf.FoldCallback` is a callback of `transformers.Trainer`, got it in a "
        "`lightning.Trainer`. Pass `fh.lightning.FoldCallback(reducers)` to the Lightning Trainer.")
    fh.testing.assert_no_hooks(module)


def _csv_rows(log_dir: pathlib.Path) -> list[dict[str, str]]:
    import csv

    rows: list[dict[str, str]] = []
    for path in log_dir.rglob("metrics.csv"):
        with path.open() as f:
            rows += csv.DictReader(f)
    return rows


def test_log_every_sends_the_results_to_the_trainers_loggers(tmp_path: pathlib.Path) -> None:
    """With `log_every=2`, every second step's scalars reach Lightning's CSVLogger, named
    funhooks/<key>/<layer>/<statistic> and equal to `cb.result` at that step."""
    reducers = {"activations": fh.ActivationStats(), "grads": fh.GradientStats(), "loss": fh.LossCurve()}
    cb = fh.lightning.FoldCallback(reducers, log_every=2)
    logger = lightning.pytorch.loggers.CSVLogger(tmp_path)
    _trainer(cb, logger=logger, max_epochs=1, log_every_n_steps=1).fit(Regressor(), torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    rows = [r for r in _csv_rows(tmp_path) if r.get("funhooks/loss/ema")]
    res = cb.result
    assert len(res["loss"]) == 4
    assert [int(r["step"]) for r in rows] == [0, 2]
    for r in rows:
        k = int(r["step"])
        assert float(r["funhooks/loss/ema"]) == res["loss"].ema[k]
        assert float(r["funhooks/activations/net.2/std"]) == res["activations"].stats[k][1]["std"]
        assert float(r["funhooks/grads/net.4/norm"]) == res["grads"].stats[k][2]["norm"]
    assert "funhooks/activations/net.1/std" not in rows[0]  # the default layers: leaves with parameters


def test_a_point_logged_at_step_i_is_step_is_result(tmp_path: pathlib.Path) -> None:
    """Issue 36 item 8, through the callback: `GradientStats(every=2)` with `log_every=3` logged
    step 2's statistics at step 3. The callback logs a reducer only at the steps it recorded:
    of steps 0-7, at 0 and 6 (the loss, recorded at every step, at 0, 3 and 6)."""
    cb = fh.lightning.FoldCallback({"grads": fh.GradientStats(every=2), "loss": fh.LossCurve()}, log_every=3)
    logger = lightning.pytorch.loggers.CSVLogger(tmp_path)
    _trainer(cb, logger=logger, max_epochs=2, log_every_n_steps=1).fit(
        Regressor(), torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    res = cb.result
    assert res["grads"].iterations == (0, 2, 4, 6)
    rows = _csv_rows(tmp_path)
    grads = {int(r["step"]): r for r in rows if r.get("funhooks/grads/net.4/norm")}
    losses = {int(r["step"]): r for r in rows if r.get("funhooks/loss/loss")}
    assert sorted(grads) == [0, 6] and sorted(losses) == [0, 3, 6]
    for k, r in grads.items():
        assert float(r["funhooks/grads/net.4/norm"]) == res["grads"].stats[res["grads"].iterations.index(k)][2]["norm"]


def test_logging_is_off_by_default(tmp_path: pathlib.Path) -> None:
    """Without `log_every`, nothing of funhooks reaches the logger (this module logs nothing itself: no file)."""
    cb = fh.lightning.FoldCallback({"loss": fh.LossCurve()})
    logger = lightning.pytorch.loggers.CSVLogger(tmp_path)
    _trainer(cb, logger=logger, max_epochs=1, log_every_n_steps=1).fit(
        Regressor(), torch.utils.data.DataLoader(_data(), batch_size=BATCH))
    rows = _csv_rows(tmp_path)
    assert not any(name.startswith("funhooks/") for r in rows for name in r)
    assert len(cb.result["loss"]) == 4


def test_log_every_is_a_positive_int() -> None:
    """A bad `log_every` is refused at construction, with the fix."""
    with pytest.raises(fh.LoopError) as err:
        fh.lightning.FoldCallback({"loss": fh.LossCurve()}, log_every=0)
    assert str(err.value) == ("FoldCallback: `log_every` is a positive int (log every that many steps) or None "
                              "(do not log), got 0. Pass e.g. log_every=50.")
