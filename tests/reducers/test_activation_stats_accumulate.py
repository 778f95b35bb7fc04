"""ActivationStats of a step with several forwards (micro-batches): every forward counts."""

from __future__ import annotations

import math

import pytest
import torch

import funhooks as fh
from reducer_kit import MSE, batches, frozen_opt, mlp


def joint(model: torch.nn.Module, xs: list[torch.Tensor]) -> dict[str, tuple[float, float, float, torch.Tensor]]:
    """Mean, std, near-zero share and histogram of each Linear's output over all of `xs` at once."""
    with torch.no_grad():
        h = torch.cat(xs)
        a = model[0](h)
        c = model[2](model[1](a))
    return {p: (o.mean().item(), o.std().item(), (o <= 0.05).sum().item() / o.numel(), o.histc(40, 0, 10))
            for p, o in (("0", a), ("2", c))}


def check(res: fh.ActivationStatsResult, expected: dict) -> None:
    assert res.paths == ("0", "2")
    for i, path in enumerate(res.paths):
        got = res.stats[0][i]
        mean, std, near, hist = expected[path]
        assert math.isclose(got["mean"], mean, rel_tol=1e-5, abs_tol=1e-6)
        assert math.isclose(got["std"], std, rel_tol=1e-5)
        assert got["near_zero"] == pytest.approx(near, abs=1e-12)
        assert torch.equal(got["hist"], hist)


def test_fit_accumulate_covers_every_micro_batch() -> None:
    """fit(accumulate=2): a step's statistics are those of both micro-batches together."""
    model, data = mlp(), batches(4)
    res = fh.fit(model, data, MSE, frozen_opt(model), fh.ActivationStats(with_hist=True), accumulate=2)
    assert res.iterations == (0, 1)
    check(res, joint(model, [data[0][0], data[1][0]]))


def test_folding_two_forwards_per_step_covers_both() -> None:
    """fh.folding with two forwards before a mark: the step's statistics cover both."""
    model, data = mlp(), batches(2)
    opt = frozen_opt(model)
    with fh.folding(model, [fh.ActivationStats(with_hist=True)], opt=opt) as fold:
        losses = [MSE(model(x), y) for x, y in data]
        fold.step(sum(losses))
    check(fold.result()[0], joint(model, [x for x, _ in data]))


def test_one_forward_keeps_fastai_numbers() -> None:
    """One forward per step: the numbers are still fastai's own calls, to the bit."""
    model, data = mlp(), batches(2)
    res = fh.fit(model, data, MSE, frozen_opt(model), fh.ActivationStats())
    with torch.no_grad():
        out = model[0](data[1][0])
    assert res.stats[1][0]["mean"] == out.mean().item() and res.stats[1][0]["std"] == out.std().item()
