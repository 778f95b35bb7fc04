"""GradientStats and UpdateRatio: what the optimizer applies, per layer, as folds on the device."""

from __future__ import annotations

import copy
import itertools
import math
import warnings
from typing import Any

import hypothesis
import pytest
import toolz
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss


def _model(device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(device)


def _batches(n: int, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g).to(device), torch.randn(6, 2, generator=g).to(device)) for _ in range(n)]


def _layer_stats(grads: list[torch.Tensor]) -> dict[str, float]:
    g = torch.cat([t.flatten() for t in grads]).double()
    return {"norm": g.norm().item(), "mean": g.mean().item(), "std": g.std().item(),
            "zeros": (g == 0).double().mean().item()}


def test_gradient_stats_are_those_of_the_accumulated_unscaled_gradients(device: torch.device) -> None:
    """With 4 micro-batches and a GradScaler in your own step, each Step's statistics are those
    of the gradients `opt.step()` applied: accumulated, unscaled."""
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type)
    applied = []

    def step(m: nn.Module, micro: list) -> torch.Tensor:
        opt.zero_grad()
        for x, y in micro:
            scaler.scale(MSE(m(x), y) / len(micro)).backward()
        scaler.unscale_(opt)
        applied.append({path: [p.grad.clone() for p in m.get_submodule(path).parameters()] for path in ("0", "2", "4")})
        scaler.step(opt)
        scaler.update()
        return torch.zeros(())

    res = fh.fit(model, _batches(8, device), reducers=fh.GradientStats(), step=step, opt=opt, accumulate=4)
    assert res.paths == ("0", "2", "4") and len(res) == 2
    for got, want in zip(res.stats, applied):
        for stats, path in zip(got, res.paths):
            expected = _layer_stats(want[path])
            assert all(stats[k] == pytest.approx(expected[k], rel=1e-5, abs=1e-7) for k in expected)


def test_a_step_the_scaler_skipped_has_no_gradient_statistics() -> None:
    """An inf gradient makes the GradScaler skip `opt.step()`: that step holds no statistics
    (NaN in `layer_stats`), the others do."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")

    def step(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        opt.zero_grad()
        loss = MSE(m(x), y) * (math.inf if x[0, 0] > 10 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    batches = _batches(3)
    batches[1] = (batches[1][0] + 100, batches[1][1])
    res = fh.fit(model, batches, reducers=fh.GradientStats(), step=step, opt=opt)
    norms = res.layer_stats(0)[0]
    assert not math.isnan(norms[0]) and math.isnan(norms[1]) and not math.isnan(norms[2])
    assert res.stats[1] == [None, None, None]


def test_default_layers_own_parameters_and_unused_layers_are_absent() -> None:
    """Default layers: modules with parameters of their own (a MultiheadAttention's in_proj
    too); a layer whose gradient is None on a step is absent there; frozen ones never appear."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(4, 1, batch_first=True)
            self.frozen, self.spare, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)
            self.frozen.requires_grad_(False)
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            h = self.frozen(self.attn(x, x, x)[0])
            return self.head(self.spare(h) if self.calls % 2 else h).mean(1)

    torch.manual_seed(0)
    model = Net()
    batches = [(torch.randn(2, 3, 4), torch.randn(2, 2)) for _ in range(2)]
    res = fh.fit(model, batches, MSE, torch.optim.SGD(model.parameters(), lr=0.1), fh.GradientStats())
    assert res.paths == ("attn", "attn.out_proj", "spare", "head")
    assert [s is None for s in res.stats[1]] == [False, False, True, False]


def test_update_ratio_is_the_update_norm_over_the_parameter_norm() -> None:
    """Per layer, ||after - before|| / ||before|| of all its parameters, for Adam's real update."""
    model = _model()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    expected = []
    for x, y in _batches(3):
        before = {p: [q.detach().clone() for q in ref.get_submodule(p).parameters()] for p in ("0", "2", "4")}
        ref_opt.zero_grad()
        MSE(ref(x), y).backward()
        ref_opt.step()
        row = []
        for path, old in before.items():
            new = list(ref.get_submodule(path).parameters())
            moved = torch.cat([(n - o).flatten() for n, o in zip(new, old)]).double().norm()
            row.append((moved / torch.cat([o.flatten() for o in old]).double().norm()).item())
        expected.append(row)
    res = fh.fit(model, _batches(3), MSE, torch.optim.Adam(model.parameters(), lr=1e-2), fh.UpdateRatio())
    assert res.paths == ("0", "2", "4")
    for got, want in zip(res.ratios, expected):
        assert got == pytest.approx(want, rel=1e-5)
    assert res.layer("2") == [row[1] for row in res.ratios]
    assert all(v < 0 for row in res.log10() for v in row)


def test_complex_parameters_count_both_parts() -> None:
    """A complex layer's gradient norm and update ratio are the complex norms (real and
    imaginary parts both count), not those of the real parts."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: complex modules are a new feature
        model = nn.Linear(2, 1).to(torch.complex64)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 2, dtype=torch.complex64)
    res = fh.fit(model, [(x, torch.zeros(4, 1, dtype=torch.complex64))], lambda o, y: (o - y).abs().square().mean(),
                 torch.optim.SGD(model.parameters(), lr=0.1), [fh.GradientStats(), fh.UpdateRatio()])
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    assert res[0].stats[0][0]["norm"] == pytest.approx(torch.linalg.vector_norm(grad).item(), rel=1e-5)
    assert res[1].ratios[0][0] == pytest.approx((moved.norm() / torch.cat([b.flatten() for b in before]).norm()).item(),
                                                rel=1e-5)


@hypothesis.given(cuts=st.lists(st.integers(0, 6), max_size=3), every=st.one_of(st.none(), st.integers(1, 3)))
def test_fold_of_chunks_merged_equals_one_pass(cuts: list[int], every: int | None) -> None:
    """Folding chunks of the steps and merging the states, in any order, equals one pass."""
    model = _model()
    reducers = [fh.GradientStats(every=every), fh.UpdateRatio(every=every)]
    watches = tuple(w for r in reducers for w in r.watches)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = list(fh.train(model, _batches(6), MSE, opt, watches=watches))
    bounds = [0, *sorted(cuts), len(steps)]
    for reducer in reducers:
        states = [toolz.reduce(reducer.step, steps[a:b], reducer.init()) for a, b in itertools.pairwise(bounds)]
        merged = reducer.result(toolz.reduce(reducer.merge, states[::-1]))
        whole = fh.fold(reducer, steps)
        assert merged.iterations == whole.iterations == tuple(range(0, 6, every or 1))
        assert merged.table.rows() == whole.table.rows()


def test_states_of_one_iteration_from_two_ranks_keep_the_first() -> None:
    """Replicated gradients (DDP) are not counted twice: merging a state with itself is a no-op."""
    model = _model()
    stats = fh.GradientStats()
    steps = list(fh.train(model, _batches(2), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
                          watches=stats.watches))
    state = toolz.reduce(stats.step, steps, stats.init())
    assert stats.result(stats.merge(state, state)).stats == stats.result(state).stats


def test_every_records_ceil_n_over_every_and_pauses_the_rest() -> None:
    """every=3 over 7 steps records 3; the optimizer's hooks exist only on recorded steps."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def count(layers: fh.training.Layers) -> dict:
        seen.append(layers.paths)
        return {}

    res = fh.fit(model, _batches(7), MSE, opt, [fh.GradientStats(every=3), _Counting(count)])
    assert res[0].iterations == (0, 3, 6) and len(seen) == 3
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


class _Counting:
    """A reducer whose only watch calls a function, recording like `every=3`."""

    specs: tuple = ()

    def __init__(self, fn: Any) -> None:
        self.watches = (fh.OptimizerWatch(nn.Linear, fn, name="count"),)

    def records(self, iteration: int, training: bool) -> bool:
        return iteration % 3 == 0

    def init(self) -> int:
        return 0

    def step(self, state: int, step: fh.Step) -> int:
        return state + 1

    def result(self, state: int) -> int:
        return state


def test_steps_without_the_watches_are_explained() -> None:
    """Folding steps run without the reducer's watches raises, saying what to run."""
    model = _model()
    steps = list(fh.train(model, _batches(1), MSE, torch.optim.SGD(model.parameters(), lr=0.1)))
    with pytest.raises(fh.ReducerError) as err:
        fh.fold(fh.GradientStats(), steps)
    assert str(err.value) == (
        "GradientStats: a recorded train step holds the records of the reducer's watches, got 1 recorded steps and "
        "no 'gradient_stats' in any of their records. Run the steps with `watches=reducer.watches` and the "
        "optimizer (fh.fit does), or check that the optimizer stepped."
    )
    with pytest.raises(fh.ReducerError, match=r"^GradientStats: `every` is a positive int or None, got 0"):
        fh.GradientStats(every=0)


def test_gradient_and_update_statistics_never_sync_the_gpu(device: torch.device) -> None:
    """Under torch.cuda.set_sync_debug_mode("error"), fit with both reducers runs."""
    if device.type != "cuda":
        pytest.skip("host syncs are a CUDA notion")
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = fh.fit(model, _batches(3, device), MSE, opt, [fh.GradientStats(), fh.UpdateRatio()])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(res[0]) == len(res[1]) == 3
