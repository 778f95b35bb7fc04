"""Your own training step in fh.train / fh.fit (issue 16): autocast and a GradScaler, gradient
accumulation, clipping through a `param_grad` spec, an LR scheduler, dict batches of a Hugging
Face causal LM, batches moved to the model's device."""

from __future__ import annotations

import collections
import copy
from typing import Any

import pytest
import torch
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss
ACCUMULATE = 4
CLIP = 0.01


def _model(device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def _batches(n: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g).to(device), torch.randn(6, 2, generator=g).to(device)) for _ in range(n)]


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_autocast_and_grad_scaler_step_trains_like_the_hand_loop() -> None:
    """A bf16 autocast step with a GradScaler: same losses and weights as the same code by hand;
    the records hold the bf16 activations autocast produced."""
    model = _model()
    ref = copy.deepcopy(model)

    def make_step(m: nn.Module) -> Any:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")

        def step(m: nn.Module, batch: Any) -> torch.Tensor:
            x, y = batch
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = MSE(m(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            return loss

        return step

    ref_step = make_step(ref)
    ref_losses = [ref_step(ref, b).detach() for b in _batches(4)]
    steps = list(fh.train(model, _batches(4), step=make_step(model), specs=fh.outputs("0")))
    assert [float(s.loss) for s in steps] == [float(x) for x in ref_losses]
    assert _same_weights(model, ref)
    assert steps[0].record["0"]["output"].dtype == torch.bfloat16


def test_accumulation_gives_one_step_per_optimizer_step_with_every_micro_batch() -> None:
    """accumulate=4 over 10 batches: 3 Steps (4, 4, 2 micro-batches), each record holding every
    micro-batch's call; the built-in step equals the hand loop dividing each loss by k."""
    model, batches = _model(), _batches(10)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_losses = []
    for start in range(0, 10, ACCUMULATE):
        group = batches[start:start + ACCUMULATE]
        ref_opt.zero_grad()
        losses = []
        for x, y in group:
            loss = MSE(ref(x), y)
            (loss / len(group)).backward()
            losses.append(loss.detach())
        ref_opt.step()
        ref_losses.append(torch.stack(losses).mean())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = list(fh.train(model, batches, MSE, opt, specs=fh.outputs("0"), accumulate=ACCUMULATE))
    assert [s.iteration for s in steps] == [0, 1, 2]
    assert [len(s.record.calls("0", "output")) for s in steps] == [4, 4, 2]
    assert all(torch.equal(s.loss, r) for s, r in zip(steps, ref_losses))
    assert _same_weights(model, ref)


def test_accumulating_step_of_your_own_gets_the_micro_batches() -> None:
    """With your own step, accumulate=k hands it a list of k micro-batches; one Step each."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sizes = []

    def step(m: nn.Module, micro: list) -> torch.Tensor:
        sizes.append(len(micro))
        opt.zero_grad()
        losses = [MSE(m(x), y) for x, y in micro]
        for loss in losses:
            (loss / len(micro)).backward()
        opt.step()
        return torch.stack([loss.detach() for loss in losses]).mean()

    res = fh.fit(model, _batches(8), reducers=fh.ActivationStats(), step=step, accumulate=ACCUMULATE)
    assert sizes == [4, 4] and len(res.stats) == 2


def test_clipping_through_a_param_grad_spec_trains_like_clamped_gradients() -> None:
    """An `fh.edit(..., event="param_grad")` clip in `specs` clips each gradient as it arrives:
    the same weights as a hand loop with `register_hook(clamp)` on every parameter."""
    model = _model()
    ref = copy.deepcopy(model)
    handles = [p.register_hook(lambda g: g.clamp(-CLIP, CLIP)) for p in ref.parameters()]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in _batches(3):
        ref_opt.zero_grad()
        MSE(ref(x), y).backward()
        ref_opt.step()
    for h in handles:
        h.remove()
    clip = fh.edit(nn.Linear, lambda p, g: g.clamp(-CLIP, CLIP), event="param_grad")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    list(fh.train(model, _batches(3), MSE, opt, specs=clip))
    assert _same_weights(model, ref)
    fh.testing.assert_no_hooks(model)


def test_lr_scheduler_in_your_step_and_metrics_reach_the_steps() -> None:
    """A scheduler stepped in your step: the learning rates it returned are the Steps' metrics."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step(m: nn.Module, batch: Any) -> dict[str, Any]:
        x, y = batch
        opt.zero_grad()
        loss = MSE(m(x), y)
        loss.backward()
        opt.step()
        lr = opt.param_groups[0]["lr"]
        sched.step()
        return {"loss": loss, "lr": lr}

    steps = list(fh.train(model, _batches(3), step=step))
    assert [s.metrics["lr"] for s in steps] == [0.1, 0.05, 0.025]
    assert all(not s.loss.requires_grad for s in steps)


Pair = collections.namedtuple("Pair", ["x", "y"])


def test_batches_of_any_pytree_move_to_the_models_device(device: torch.device) -> None:
    """to_device=True moves the tensors of dicts, namedtuples and lists; other values stay."""
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def step(m: nn.Module, batch: Any) -> torch.Tensor:
        seen.append(batch)
        x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else (batch.x, batch.y) if isinstance(
            batch, Pair) else batch[:2]
        opt.zero_grad()
        loss = MSE(m(x), y)
        loss.backward()
        opt.step()
        return loss

    x, y = _batches(1)[0]
    batches = [{"x": x, "y": y, "note": "kept"}, Pair(x, y), [x, y, 3]]
    steps = list(fh.train(model, batches, step=step, to_device=True))
    assert len(steps) == 3 and seen[0]["note"] == "kept" and seen[2][2] == 3
    assert seen[0]["x"].device.type == seen[1].x.device.type == seen[2][0].device.type == device.type
    assert steps[0].loss.device.type == device.type


def test_hugging_face_causal_lm_trains_on_dict_batches() -> None:
    """A 2-layer GPT-2 built from a config trains on `model(**batch).loss` with ActivationStats
    folded over it; its Conv1D layers are recorded by path."""
    transformers = pytest.importorskip("transformers", reason="the `hf` extra is not installed")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=32,
                                     use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(4):
        ids = torch.randint(0, 32, (4, 12), generator=g)
        batches.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids})

    def step(m: nn.Module, batch: dict) -> Any:
        opt.zero_grad()
        out = m(**batch)
        out.loss.backward()
        opt.step()
        return out  # a ModelOutput: `loss`, and the logits as a metric

    stats = fh.ActivationStats(modules=transformers.pytorch_utils.Conv1D)
    steps = list(fh.train(model, batches, step=step, specs=stats.specs, to_device=True))
    assert all(s.loss.ndim == 0 for s in steps) and steps[0].metrics["logits"].shape == (4, 12, 32)
    res = fh.fold(stats, steps)
    assert res.paths[0] == "transformer.h.0.attn.c_attn" and len(res.paths) == 8 and len(res.stats) == 4
    fh.testing.assert_no_hooks(model)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"step": 3}, "train: `step` is a function `step(model, batch)`, got 3. Pass a function."),
        ({"loss_fn": MSE, "step": print}, (
            "train: a training step is `loss_fn` and `opt`, or your own `step=`, got both `loss_fn` and `step`. "
            "Compute the loss inside your step function.")),
        ({}, ("train: without `step=`, the built-in step needs `loss_fn` and `opt`, got loss_fn=None. "
              "Pass `loss_fn, opt`, or your own `step=fn(model, batch)`.")),
        ({"step": print, "accumulate": 0}, (
            "train: `accumulate` is a positive int (micro-batches per optimizer step), got 0. "
            "Pass accumulate=1 for one batch per step.")),
        ({"step": print, "to_device": "cuda"}, (
            "train: `to_device` is a bool, got 'cuda'. Pass True to move batches to the model's device.")),
    ],
)
def test_bad_step_arguments_are_refused(kwargs: dict, message: str) -> None:
    """Both or neither of the built-in step and yours, and bad flags, are one-line LoopErrors."""
    with pytest.raises(fh.LoopError) as err:
        fh.train(_model(), _batches(1), **kwargs)
    assert str(err.value) == message


def test_a_step_returning_no_loss_is_explained() -> None:
    """A step returning a loss vector is a LoopError saying what to return; hooks are removed."""
    model = _model()
    with pytest.raises(fh.LoopError) as err:
        list(fh.train(model, _batches(1), step=lambda m, b: MSE(m(b[0]), b[1], reduction="none"),
                      specs=fh.outputs("0")))
    assert str(err.value) == (
        "train: `step` returns the loss (a 0-d tensor), a dict holding it under 'loss', or None, got a Tensor of "
        "shape (6, 2). Return the scalar loss your step backpropagated, e.g. `return loss`."
    )
    fh.testing.assert_no_hooks(model)
    steps = list(fh.train(model, _batches(2), step=lambda m, b: None))
    assert [s.loss for s in steps] == [None, None]
