"""fh.hf.FoldCallback: the reducers of fh.fit, unchanged, in a real transformers.Trainer (issue 16)."""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

import funhooks as fh

transformers = pytest.importorskip("transformers", reason="the `hf` extra is not installed")
pytest.importorskip("accelerate", reason="the Trainer needs accelerate (the `hf` extra)")

VOCAB = 32
EXAMPLES = 24
BATCH = 4
EPOCHS = 2
ACCUMULATE = 2


def _model() -> Any:
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=VOCAB,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _data(n: int = EXAMPLES) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, 10), generator=g)
    return [{"input_ids": i, "labels": i} for i in ids]


def _train(model: Any, cb: Any, out: pathlib.Path, resume_from_checkpoint: str | None = None, **kwargs: Any) -> Any:
    options = {"save_strategy": "no", **kwargs}
    args = transformers.TrainingArguments(
        str(out), per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS, learning_rate=1e-3,
        gradient_accumulation_steps=ACCUMULATE, logging_strategy="steps", logging_steps=1,
        report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **options)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), callbacks=[cb], **(
        {"eval_dataset": _data(8)} if kwargs.get("eval_strategy") else {}))
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


def test_trainer_steps_fold_like_fit_steps(tmp_path: pathlib.Path) -> None:
    """One Step per optimizer step (2 micro-batches each); the Step losses are the losses the
    Trainer logs; the gradient norms those it logs (no clipping); ActivationStats per layer path;
    evaluation is not recorded; nothing stays attached."""
    model = _model()
    calls: list[int] = []
    reducers = {"acts": fh.ActivationStats(modules=transformers.pytorch_utils.Conv1D),
                "grads": fh.GradientStats(), "update": fh.UpdateRatio(), "loss": fh.LossCurve(),
                "calls": fh.HookCallback(lambda m, i, o: calls.append(1) or 1, modules="lm_head")}
    with fh.hf.FoldCallback(reducers) as cb:
        trainer = _train(model, cb, tmp_path, max_grad_norm=0.0, eval_strategy="epoch")
    res = cb.result
    steps = trainer.state.global_step
    assert steps == EPOCHS * EXAMPLES // (BATCH * ACCUMULATE) == 6
    assert len(res["acts"]) == len(res["grads"]) == len(res["update"]) == len(res["loss"]) == steps
    assert res["acts"].paths[0] == "transformer.h.0.attn.c_attn" and len(res["acts"].paths) == 8
    logged = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    assert res["loss"].losses == pytest.approx([h["loss"] for h in logged], rel=1e-5)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied: one parameter, two layers
    for row, h in zip(res["grads"].stats, logged):
        norms = [s["norm"] for p, s in zip(res["grads"].paths, row) if s and p != "lm_head"]
        assert math.sqrt(sum(n**2 for n in norms)) == pytest.approx(float(h["grad_norm"]), rel=1e-4)
    assert sum("eval_loss" in h for h in trainer.state.log_history) == EPOCHS  # evaluation ran the model ...
    assert len(calls) == steps * ACCUMULATE  # ... but the hook ran on the training micro-batches only
    assert len(res["calls"]) == steps and res["calls"][0] == [1]
    fh.testing.assert_no_hooks(model)
    inner = trainer.optimizer.optimizer
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks


def test_a_failed_training_is_cleaned_up_by_closing_the_callback(tmp_path: pathlib.Path) -> None:
    """The Trainer calls no callback when training raises: leaving the `with` block detaches the
    step that was open, from the model and the optimizer."""

    class Failing(transformers.TrainerCallback):
        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            raise ArithmeticError("nan loss")

    model = _model()
    with pytest.raises(ArithmeticError):
        with fh.hf.FoldCallback([fh.ActivationStats(modules=transformers.pytorch_utils.Conv1D),
                                 fh.GradientStats()]) as cb:
            args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=BATCH,
                                                  gradient_accumulation_steps=ACCUMULATE, report_to=[],
                                                  save_strategy="no", use_cpu=True, disable_tqdm=True)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=_data(), callbacks=[cb, Failing()])
            trainer.remove_callback(transformers.PrinterCallback)
            trainer.train()
    fh.testing.assert_no_hooks(model)
    inner = trainer.optimizer.optimizer
    assert not inner._optimizer_step_pre_hooks and not inner._optimizer_step_post_hooks


def test_missing_transformers_names_the_extra() -> None:
    """Without transformers, `fh.hf` raises ExtraError naming `funhooks[hf]`."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import funhooks as fh\n"
        "try:\n    fh.hf\nexcept fh.ExtraError as err:\n    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == (
        "funhooks.hf: the Trainer callback needs transformers, got it not installed. "
        "Install the extra: pip install 'funhooks[hf]'."
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


def test_a_resumed_training_numbers_its_steps_by_the_global_step(tmp_path: pathlib.Path) -> None:
    """A new callback after `train(resume_from_checkpoint=...)` numbers its Steps with the
    Trainer's global step and epoch, so its LossCurve state merges with the first run's into
    the uninterrupted run's curve (issue 26)."""
    curve = fh.LossCurve()
    with fh.hf.FoldCallback([Numbers(), curve]) as whole:
        _train(_model(), whole, tmp_path / "a", save_strategy="steps", save_steps=3)
    with fh.hf.FoldCallback([Numbers(), curve]) as resumed:
        _train(_model(), resumed, tmp_path / "a", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert whole.result[0] == ((0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5))
    assert resumed.result[0] == ((1, 3), (1, 4), (1, 5))
    assert resumed.result[1].losses == pytest.approx(whole.result[1].losses[3:], rel=1e-5)
    first = curve.merge(whole.states[1], resumed.states[1])
    assert curve.result(first).iterations == tuple(range(6))  # the same steps, never new ones


def test_the_lightning_callback_in_the_hf_trainer_is_named(tmp_path: pathlib.Path) -> None:
    """fh.lightning.FoldCallback given to a transformers.Trainer: a LoopError saying which
    callback belongs where, not an AttributeError for `on_init_end`."""
    pytest.importorskip("lightning", reason="the `lightning` extra is not installed")
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], save_strategy="no", use_cpu=True)
    with pytest.raises(fh.LoopError) as err:
        transformers.Trainer(model=_model(), args=args, train_dataset=_data(),
                             callbacks=[fh.lightning.FoldCallback([fh.LossCurve()])])
    assert str(err.value) == (
        "FoldCallback: `fh.lightning.FoldCallback` is a callback of `lightning.Trainer`, got it in a "
        "`transformers.Trainer`. Pass `fh.hf.FoldCallback(reducers)` to the Hugging Face Trainer.")


def test_log_every_goes_through_trainer_log_to_log_history_and_report_to(tmp_path: pathlib.Path) -> None:
    """With `log_every=2` and the Trainer, every second step's scalars go through `Trainer.log`:
    into `state.log_history` (at the Trainer's step, one past the Step's iteration) and to the
    `report_to` integrations (TensorBoard here), equal to `cb.result` at that step."""
    pytest.importorskip("tensorboard", reason="the `tensorboard` extra is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=1e-3,
        logging_strategy="no", report_to=["tensorboard"], save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_data(16))
    trainer.remove_callback(transformers.PrinterCallback)
    reducers = {"grads": fh.GradientStats(), "loss": fh.LossCurve()}
    with fh.hf.FoldCallback(reducers, log_every=2, trainer=trainer) as cb:
        trainer.add_callback(cb)
        trainer.train()
    res = cb.result
    assert len(res["loss"]) == 4
    logged = [h for h in trainer.state.log_history if "funhooks/loss/ema" in h]
    assert [h["step"] for h in logged] == [1, 3]
    for h in logged:
        k = h["step"] - 1
        assert h["funhooks/loss/ema"] == res["loss"].ema[k] and h["funhooks/loss/loss"] == res["loss"].losses[k]
        assert h["funhooks/grads/lm_head/norm"] == res["grads"].stats[k][res["grads"].paths.index("lm_head")]["norm"]
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    written = [(e.step, e.value) for e in acc.Scalars("train/funhooks/loss/ema")]  # the integrations' prefix
    assert written == [(h["step"], pytest.approx(h["funhooks/loss/ema"], rel=1e-6)) for h in logged]


def test_log_every_needs_the_trainer() -> None:
    """Logging goes through `Trainer.log`, which a callback cannot reach by itself: without
    `trainer=`, `log_every` is refused at construction, with the fix."""
    with pytest.raises(fh.LoopError) as err:
        fh.hf.FoldCallback({"loss": fh.LossCurve()}, log_every=10)
    assert str(err.value) == (
        "FoldCallback: `log_every` logs through `Trainer.log`, got no `trainer`. Make the Trainer first, then "
        "`cb = fh.hf.FoldCallback(reducers, log_every=10, trainer=trainer)` and `trainer.add_callback(cb)`.")
