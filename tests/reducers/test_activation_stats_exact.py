"""ActivationStats' numbers are fastai's to the bit (issue 12), batched or reduced in the hook."""

from __future__ import annotations

import math
import warnings
from typing import Any

import hypothesis
import pytest
import reducer_kit as kit
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh
from funhooks.reducers import _exact

MSE = kit.MSE

# -- fastai's numbers to the bit (issue 12) ---------------------------------------------------------


class Emit(nn.Module):
    """Returns its input: its output is whatever tensor the test feeds it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Parts(nn.Module):
    """One Emit per input tensor, so one step can hold activations of any shapes."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Emit() for _ in range(k))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [part(x) for part, x in zip(self.parts, xs)]


def _fastai(o: torch.Tensor, bins: int = 40, lo: float = 0.0, hi: float = 10.0) -> dict:
    """fastai's ActivationStats.hook, verbatim (std of one value is NaN, without the warning)."""
    o = o.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"mean": o.mean().item(), "std": o.std().item(),
                "near_zero": (o <= 0.05).long().sum().item() / o.numel(), "hist": o.histc(bins, lo, hi).cpu()}


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_step(xs: list[torch.Tensor], **kwargs: Any) -> None:
    model = Parts(len(xs))
    stats = fh.ActivationStats(modules=Emit, with_hist=True, **kwargs)
    with fh.with_hooks(model, stats.specs) as run:
        model(xs)
    step = fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record, training=True)
    got = stats.result(stats.step(stats.init(), step)).stats[0]
    for g, x in zip(got, xs):
        want = _fastai(x, stats.hist_bins, *stats.hist_range)
        assert all(_same_float(g[k], want[k]) for k in ("mean", "std", "near_zero")), (x.shape, g, want)
        assert torch.equal(g["hist"], want["hist"])


SIZES = [1, 2, 3, 7, 8, 16, 31, 64, 127, 1000, 2048, 4095, 5000, 10_000, 32_767, 32_768, 40_000, 65_537, 131_072]


@pytest.mark.parametrize("n", SIZES)
def test_stats_equal_fastais_to_the_bit(device: torch.device, n: int) -> None:
    """mean and std are torch's `o.mean().item()` / `o.std().item()` exactly (fastai's own test uses
    exact equality), near_zero and the histogram too, for every size, batched or reduced in the hook."""
    g = torch.Generator().manual_seed(n)
    xs = [(torch.randn(3, n, generator=g) * 10 ** k + off).to(device)
          for k, off in ((-2, 0.0), (0, 1.0), (2, -5.0), (4, 100.0))]
    _check_step([x[i] for x in xs for i in range(3)] + [xs[1].relu().reshape(-1)[:n], xs[2].t()])


@hypothesis.given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 1100)), min_size=1, max_size=5),
    scale=st.floats(1e-3, 1e3), offset=st.sampled_from([0.0, 0.05, 1.0, -3.0, 250.0]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.bfloat16]),
    layout=st.sampled_from(["contiguous", "transposed", "relu"]),
    hist_range=st.sampled_from([(0.0, 10.0), (-1.0, 1.0), (0.1, 0.7), (-3.3, 1e-3)]),
    hist_bins=st.integers(1, 50), near_zero=st.sampled_from([0.05, 0.0, 0.1, -1.0]),
)
def test_stats_equal_fastais_to_the_bit_for_any_activation(
    shapes: list[tuple[int, int]], scale: float, offset: float, dtype: torch.dtype, layout: str,
    hist_range: tuple[float, float], hist_bins: int, near_zero: float,
) -> None:
    """Any mix of shapes, dtypes, layouts (transposed outputs are not contiguous), histogram ranges
    and thresholds: every statistic is what fastai's hook computes, bit for bit."""
    g = torch.Generator().manual_seed(len(shapes))
    xs = [(torch.randn(r, c, generator=g) * scale + offset).to(dtype) for r, c in shapes]
    if layout == "transposed":
        xs = [x.t() for x in xs]
    elif layout == "relu":
        xs = [x.relu() for x in xs]
    model = Parts(len(xs))
    stats = fh.ActivationStats(modules=Emit, with_hist=True, near_zero=near_zero, hist_bins=hist_bins,
                               hist_range=hist_range)
    with fh.with_hooks(model, stats.specs) as run:
        model(xs)
    step = fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record, training=True)
    for got, x in zip(stats.result(stats.step(stats.init(), step)).stats[0], xs):
        o = x.float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = (o.mean().item(), o.std().item(), (o <= near_zero).long().sum().item() / o.numel()
                    if o.numel() else math.nan)
        assert all(_same_float(a, b) for a, b in zip((got["mean"], got["std"], got["near_zero"]), want))
        assert torch.equal(got["hist"], o.histc(hist_bins, *hist_range))


def test_stats_are_exact_with_several_threads() -> None:
    """With more intra-op threads (PyTorch then splits large reductions) the numbers are still torch's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (1000, 32_767, 32_768, 40_000, 70_000):
            g = torch.Generator().manual_seed(n)
            _check_step([torch.randn(n, generator=g) * 3 + 1 for _ in range(3)])
    finally:
        torch.set_num_threads(threads)


def test_fastai_exact_equality_test_passes() -> None:
    """fastai's test_eq(stats[-1]['std'], pred.std()) with ==, on a model's last layer each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.Linear(50, 1))
    batches = [(torch.randn(16, 1), torch.randn(16, 1)) for _ in range(5)]
    res = fh.fit(model, batches, MSE, kit.frozen_opt(model), fh.ActivationStats())
    for step, (x, _) in zip(res.stats, batches):
        pred = model(x).detach()
        assert step[-1]["mean"] == pred.mean().item() and step[-1]["std"] == pred.std().item()


def test_std_near_a_float32_rounding_boundary_is_still_torchs() -> None:
    """Rows whose std falls within the sum-order slack of a float32 rounding boundary (a few in
    this data, checked) get torch's own sequential sum: every row's std is `row.std()` exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g) * 3 + 1
    d = x.double() - x.mean(1).double()[:, None]
    approx = torch.linalg.vector_norm(d, dim=1) / math.sqrt(63)
    near_boundary = (approx * (1 - _exact._SUM_ORDER_SLACK)).float() != (approx * (1 + _exact._SUM_ORDER_SLACK)).float()
    assert near_boundary.sum() >= 1
    rows = _exact._row_stats(x, 0.05)
    assert torch.equal(rows[:, 1], torch.stack([row.std() for row in x]))
    assert torch.equal(rows[:, 0], torch.stack([row.mean() for row in x]))
