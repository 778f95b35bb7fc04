"""DeadUnits and LossCurve as folds, and the PNG plots of the new statistics."""

from __future__ import annotations

import itertools
import math
import pathlib

import hypothesis
import pytest
import toolz
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss


def _mlp(dead: int = 2, width: int = 4) -> nn.Module:
    """Linear(2, width) + ReLU whose first `dead` units have a bias no input overcomes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, width), nn.ReLU(), nn.Linear(width, 1))
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([-100.0] * dead + [100.0] * (width - dead)))
    return model


def _batches(n: int, shape: tuple[int, ...] = (8, 2), out: int = 1) -> list:
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(*shape, generator=g), torch.randn(shape[0], out, generator=g)) for _ in range(n)]


def _frozen(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.0)


def test_dead_units_counts_units_zero_on_every_example() -> None:
    """Per step, the share of a layer's units whose magnitude is <= near_zero on the whole batch."""
    model = _mlp(dead=3, width=4)
    res = fh.fit(model, _batches(3), MSE, _frozen(model), fh.DeadUnits())
    assert res.paths == ("1",) and res.dead == [[0.75]] * 3
    assert res.dead_throughout() == {"1": 0.75}


def test_units_are_channels_of_conv_outputs_and_last_features_otherwise() -> None:
    """(N, C, H, W): a channel is a unit; (N, T, D): a feature of the last dimension is."""
    conv = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU())
    with torch.no_grad():
        conv[0].bias.copy_(torch.tensor([-100.0, 0.0, 0.0, 0.0]))
    res = fh.fit(conv, [(torch.randn(2, 1, 5, 5), torch.randn(2, 4, 5, 5))], MSE, _frozen(conv), fh.DeadUnits())
    assert res.dead == [[0.25]]
    seq = nn.Sequential(nn.Linear(3, 5), nn.ReLU())
    with torch.no_grad():
        seq[0].bias.copy_(torch.tensor([-100.0, -100.0, 0.0, 0.0, 0.0]))
    res = fh.fit(seq, [(torch.randn(2, 7, 3), torch.randn(2, 7, 5))], MSE, _frozen(seq), fh.DeadUnits())
    assert res.dead == [[0.4]]


def test_a_unit_alive_on_one_micro_batch_is_alive_on_the_step() -> None:
    """With accumulation, a unit is dead on a step only if it is zero on every micro-batch."""
    model = nn.Sequential(nn.Identity(), nn.ReLU())
    xs = [torch.tensor([[1.0, -1.0]]), torch.tensor([[-1.0, -1.0]])]
    batches = [(x, torch.zeros(1, 2)) for x in xs]

    def step(m: nn.Module, micro: list) -> None:
        for x, _ in micro:
            m(x)

    res = fh.fit(model, batches, reducers=fh.DeadUnits(), step=step, accumulate=2)
    assert res.dead == [[0.5]]


@hypothesis.given(cuts=st.lists(st.integers(0, 6), max_size=3))
def test_dead_units_fold_of_chunks_merged_equals_one_pass(cuts: list[int]) -> None:
    """Chunks folded apart and merged in reverse give the one-pass fractions."""
    model = nn.Sequential(nn.Linear(2, 6), nn.ReLU(), nn.Linear(6, 1))
    stats = fh.DeadUnits()
    steps = list(fh.train(model, _batches(6), MSE, torch.optim.SGD(model.parameters(), lr=0.5), specs=stats.specs))
    bounds = [0, *sorted(cuts), len(steps)]
    states = [toolz.reduce(stats.step, steps[a:b], stats.init()) for a, b in itertools.pairwise(bounds)]
    merged = stats.result(toolz.reduce(stats.merge, states[::-1]))
    whole = fh.fold(stats, steps)
    assert merged.dead == whole.dead and merged.dead_throughout() == whole.dead_throughout()


def test_two_ranks_halves_of_a_batch_merge_into_the_joint_batch() -> None:
    """A unit alive on one rank's half is alive on the joint batch: masks combine by AND."""
    model = nn.Sequential(nn.Identity(), nn.ReLU())
    stats = fh.DeadUnits()

    def state(x: torch.Tensor) -> tuple:
        with fh.with_hooks(model, stats.specs) as run:
            model(x)
        return stats.step(stats.init(), fh.Step(epoch=0, iteration=0, loss=None, record=run.record, training=True))

    a, b = state(torch.tensor([[1.0, -1.0, -1.0]])), state(torch.tensor([[-1.0, 1.0, -1.0]]))
    assert stats.result(stats.merge(a, b)).dead == [[pytest.approx(1 / 3)]]
    assert stats.result(a).dead == [[pytest.approx(2 / 3)]]


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_dead_units_finds_hugging_face_activations_by_default(family: str) -> None:
    """`DeadUnits()` on a Hugging Face model whose MLPs use transformers' own activation modules
    (GPT-2's `NewGELUActivation`, BERT's `GELUActivation`): its default layers are those (one
    per block, and BERT's head's); it raised SelectorError, matching no module."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=16, vocab_size=32)
        model, acts = transformers.GPT2LMHeadModel(config), ("transformer.h.0.mlp.act", "transformer.h.1.mlp.act")
    else:
        config = transformers.BertConfig(num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                         intermediate_size=32, vocab_size=32, max_position_embeddings=16)
        model = transformers.BertForMaskedLM(config)
        acts = ("bert.encoder.layer.0.intermediate.intermediate_act_fn",
                "bert.encoder.layer.1.intermediate.intermediate_act_fn", "cls.predictions.transform.transform_act_fn")
    batches = [{"input_ids": torch.randint(0, 32, (2, 8))} for _ in range(2)]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(m: nn.Module, batch: dict) -> torch.Tensor:
        opt.zero_grad()
        loss = m(**batch, labels=batch["input_ids"]).loss
        loss.backward()
        opt.step()
        return loss

    res = fh.fit(model, batches, step=step, reducers=fh.DeadUnits())
    assert res.paths == acts
    assert all(0.0 <= f <= 1.0 for path in res.paths for f in res.layer(path))
    fh.testing.assert_no_hooks(model)


def test_dead_units_arguments_are_checked() -> None:
    """A negative near_zero is a one-line ReducerError."""
    with pytest.raises(fh.ReducerError) as err:
        fh.DeadUnits(near_zero=-1)
    assert str(err.value) == "DeadUnits: `near_zero` is a number >= 0, got -1. Pass e.g. near_zero=1e-06."


def test_loss_curve_keeps_losses_and_a_debiased_moving_average() -> None:
    """losses are the steps' losses; ema is fastai's debiased EMA; evaluation steps are skipped."""
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = list(fh.train(model, _batches(5), MSE, opt)) + list(fh.evaluate(model, _batches(2), MSE))
    res = fh.fold(fh.LossCurve(beta=0.9), steps)
    losses = [float(s.loss) for s in steps[:5]]
    assert res.losses == pytest.approx(losses) and res.iterations == (0, 1, 2, 3, 4)
    avg, ema = 0.0, []
    for t, loss in enumerate(losses, 1):
        avg = 0.9 * avg + 0.1 * loss
        ema.append(avg / (1 - 0.9**t))
    assert res.ema == pytest.approx(ema) and res.last == pytest.approx(ema[-1])
    assert fh.fold(fh.LossCurve(beta=0.0), steps).ema == pytest.approx(losses)


def test_loss_curve_merges_chunks_and_averages_ranks() -> None:
    """Chunks concatenate; two ranks' losses of one iteration average."""
    curve = fh.LossCurve()
    steps = [fh.Step(epoch=0, iteration=i, loss=torch.tensor(float(i)), record=fh.Record(), training=True)
             for i in range(4)]
    a, b = (toolz.reduce(curve.step, part, curve.init()) for part in (steps[:2], steps[2:]))
    assert curve.result(curve.merge(b, a)).losses == [0.0, 1.0, 2.0, 3.0]
    other = fh.Step(epoch=0, iteration=1, loss=torch.tensor(3.0), record=fh.Record(), training=True)
    assert curve.result(curve.merge(a, curve.step(curve.init(), other))).losses == [0.0, 2.0]
    with pytest.raises(fh.ReducerError, match=r"^LossCurve: `beta` is a number in \[0, 1\), got 1"):
        fh.LossCurve(beta=1)


def test_the_new_statistics_plot_as_png(tmp_path: pathlib.Path) -> None:
    """GradientStats, UpdateRatio, DeadUnits and LossCurve results each draw a Figure saved as PNG."""
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = fh.fit(model, _batches(4), MSE, opt, {"grads": fh.GradientStats(), "update": fh.UpdateRatio(),
                                                 "dead": fh.DeadUnits(), "loss": fh.LossCurve()})
    for name, result in res.items():
        fig = result.plot(epoch_len=2) if name == "loss" else result.plot()
        fig.savefig(tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    ratio = res["update"].plot().axes[0]
    assert [line.get_ydata()[0] for line in ratio.lines[-1:]] == [-3]  # the 1e-3 rule of thumb
    assert math.isfinite(res["loss"].last)
