"""ActivationStats keyed by module path: modules skipped on some steps (issue 9), empty batches
(issue 10), experts routed one per step."""

from __future__ import annotations

import itertools
import math

import hypothesis
import pytest
import reducer_kit as kit
import toolz
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

MSE = kit.MSE



# -- statistics are keyed by module path (issue 9) ------------------------------------------------


def _stats_of(o: torch.Tensor) -> tuple[float, float, float]:
    o = o.float()
    return o.mean().item(), o.std().item(), (o <= 0.05).long().sum().item() / o.numel()


def test_skipped_module_keeps_its_own_statistics(device: torch.device) -> None:
    """A module skipped on a step is absent there: `paths` lists every module that ran in any step
    (module order, though `blocks.1` first runs at step 1), `stats` has None at its position, and
    `layer_stats` / `hist` of each path are that module's own, NaN / zero where it did not run."""
    masks = [(True, False, True), (True, True, True), (False, True, True)]
    model = kit.StochasticDepth(masks).to(device)
    batches = kit.batches(3, (6, 4), 4, device)
    res = fh.fit(model, batches, MSE, kit.frozen_opt(model), fh.ActivationStats(with_hist=True))
    assert res.paths == ("blocks.0", "blocks.1", "blocks.2")
    assert [[s is None for s in step] for step in res.stats] == [[False, True, False], [False] * 3, [True, False, False]]
    for path in res.paths:
        means, stds, near_zero = res.layer_stats(path)
        for k, ((x, _), mask) in enumerate(zip(batches, masks)):
            o = model.outputs(x, mask).get(path)
            if o is None:
                assert math.isnan(means[k]) and math.isnan(stds[k]) and math.isnan(near_zero[k])
                assert not res.hist(path)[:, k].any()
            else:
                want = _stats_of(o)
                assert means[k] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
                assert stds[k] == pytest.approx(want[1], rel=1e-5)
                assert near_zero[k] == want[2]
                assert torch.equal(res.hist(path)[:, k], o.histc(40, 0, 10).log1p().cpu())
    assert res.layer_stats(1) == res.layer_stats("blocks.1")


def test_every_step_without_the_module_reads_as_absent() -> None:
    """A module that never runs on a recorded step is not in `paths`; one that stops running is NaN."""
    masks = [(True, True, False), (True, False, False), (False, False, False)]
    model = kit.StochasticDepth(masks)
    res = fh.fit(model, kit.batches(4, (6, 4), 4), MSE, kit.frozen_opt(model), fh.ActivationStats(with_hist=True))
    assert res.paths == ("blocks.0", "blocks.1")
    means, _, _ = res.layer_stats("blocks.1")
    assert [math.isnan(m) for m in means] == [False, True, True, False]
    assert res.stats[2] == [None, None]
    assert res.hist("blocks.0")[:, 2].sum() == 0 and res.hist("blocks.0")[:, 3].sum() > 0


def _masks(depth: int) -> st.SearchStrategy[list[tuple[bool, ...]]]:
    return st.lists(st.tuples(*[st.booleans()] * depth).filter(any), min_size=1, max_size=8)


@hypothesis.given(data=st.data(), depth=st.integers(1, 4), with_hist=st.booleans(),
                  every=st.one_of(st.none(), st.integers(1, 3)))
def test_fold_of_chunks_equals_one_pass_with_skipped_modules(data: st.DataObject, depth: int, with_hist: bool,
                                                             every: int | None) -> None:
    """With modules skipped at random, folding chunks and merging (in any order) == one pass, exactly."""
    masks = data.draw(_masks(depth), label="masks")
    model = kit.StochasticDepth(masks)
    stats = fh.ActivationStats(with_hist=with_hist, every=every)
    steps = list(fh.train(model, kit.batches(8, (6, 4), 4), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
                          specs=stats.specs))
    cuts = data.draw(st.lists(st.integers(0, len(steps)), max_size=3), label="cuts")
    bounds = [0, *sorted(cuts), len(steps)]
    states = [toolz.reduce(stats.step, steps[a:b], stats.init()) for a, b in itertools.pairwise(bounds)]
    order = data.draw(st.permutations(range(len(states))), label="merge order")
    merged = stats.result(toolz.reduce(stats.merge, [states[i] for i in order]))
    whole = fh.fold(stats, steps)
    assert merged.paths == whole.paths
    assert merged.iterations == whole.iterations
    assert kit.plain(merged) == kit.plain(whole)


@hypothesis.given(data=st.data(), depth=st.integers(1, 4))
def test_merge_of_ranks_with_skipped_modules(data: st.DataObject, depth: int) -> None:
    """Two ranks that skipped different modules on the same iteration merge by path: a module that
    ran on one rank has that rank's statistics exactly, one that ran on both those of the joint batch."""
    mask_a, mask_b = (data.draw(st.tuples(*[st.booleans()] * depth)) for _ in range(2))
    hypothesis.assume(any(mask_a) or any(mask_b))
    split = data.draw(st.integers(1, 11))
    model = kit.StochasticDepth([mask_a])
    x = torch.randn(12, 4)
    stats = fh.ActivationStats(with_hist=True)

    def state(xs: torch.Tensor, mask: tuple[bool, ...]) -> tuple:
        model.masks = [mask]
        with fh.with_hooks(model, stats.specs) as run:
            model(xs)
        return stats.step(stats.init(), fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record,
                                                training=True))

    a, b = state(x[:split], mask_a), state(x[split:], mask_b)
    merged = stats.result(stats.merge(a, b))
    assert kit.plain(merged) == kit.plain(stats.result(stats.merge(b, a)))  # merging is symmetric
    outs_a, outs_b = model.outputs(x[:split], mask_a), model.outputs(x[split:], mask_b)
    assert merged.paths == tuple(p for p in (f"blocks.{i}" for i in range(depth)) if p in outs_a or p in outs_b)
    for path, got in zip(merged.paths, merged.stats[0]):
        if path not in outs_b:
            alone = stats.result(a)
            assert kit.plain_one(got) == kit.plain_one(alone.stats[0][alone.paths.index(path)])
        elif path not in outs_a:
            alone = stats.result(b)
            assert kit.plain_one(got) == kit.plain_one(alone.stats[0][alone.paths.index(path)])
        else:
            joint = torch.cat([outs_a[path], outs_b[path]]).double()
            assert got["mean"] == pytest.approx(joint.mean().item(), rel=1e-5, abs=1e-6)
            assert got["std"] == pytest.approx(joint.std().item(), rel=1e-5)
            assert got["near_zero"] == (joint <= torch.tensor(0.05).float()).sum().item() / joint.numel()
            assert torch.equal(got["hist"], joint.float().histc(40, 0, 10))


# -- empty batches (issue 10) -------------------------------------------------------------------


@pytest.mark.parametrize("width", [4, 300])  # 300 x 40 x 6 > REDUCE_IN_HOOK_NUMEL: the hook reduces it
def test_an_empty_batch_gives_nan_statistics(device: torch.device, width: int) -> None:
    """A zero-element activation reads as NaN mean / std / near_zero and zero histogram counts;
    the other steps are unaffected and the result stays readable."""
    model = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2)).to(device)
    batches = [(torch.randn(n, 40, 3, device=device), torch.randn(n, 40, 2, device=device)) for n in (6, 0, 6)]
    with torch.autograd.set_detect_anomaly(False):
        res = fh.fit(model, batches, lambda p, y: (p - y).square().sum(), kit.frozen_opt(model),
                     fh.ActivationStats(with_hist=True))
    empty = res.stats[1]
    assert [math.isnan(s[k]) for s in empty for k in ("mean", "std", "near_zero")] == [True] * 6
    assert all(torch.equal(s["hist"], torch.zeros(40)) for s in empty)
    assert all(not math.isnan(s["mean"]) for step in (res.stats[0], res.stats[2]) for s in step)
    means, stds, near_zero = res.layer_stats(0)
    assert math.isnan(means[1]) and math.isnan(stds[1]) and math.isnan(near_zero[1])
    assert not res.hist(0)[:, 1].any()


def test_an_empty_part_merges_as_nothing() -> None:
    """A rank that saw an empty batch adds nothing: the merge is the other rank's statistics."""
    model = kit.mlp()
    stats = fh.ActivationStats(with_hist=True)

    def state(xs: torch.Tensor) -> tuple:
        with fh.with_hooks(model, stats.specs) as run:
            model(xs)
        return stats.step(stats.init(), fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record,
                                                training=True))

    full = state(torch.randn(5, 3))
    merged = stats.result(stats.merge(state(torch.randn(0, 3)), full))
    assert kit.plain(merged) == kit.plain(stats.result(full))



class Routed(nn.Module):
    """A mixture of 12 experts where call k runs expert ``route[k % len(route)]`` only."""

    def __init__(self, route: list[int]) -> None:
        super().__init__()
        self.stem, self.experts = nn.Linear(4, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(12))
        self.route, self.calls = route, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.experts[self.route[self.calls % len(self.route)]]
        self.calls += 1
        return expert(self.stem(x))


def test_modules_that_never_run_together_are_in_path_order() -> None:
    """Experts routed one per step: `paths` puts each after the stem (the steps say so) and the
    experts, which no step orders, by number; each expert's statistics are its own steps'."""
    model = Routed([10, 2, 0, 10])
    res = fh.fit(model, kit.batches(4, (6, 4), 4), MSE, kit.frozen_opt(model), fh.ActivationStats())
    assert res.paths == ("stem", "experts.0", "experts.2", "experts.10")
    means, _, _ = res.layer_stats("experts.10")
    assert [math.isnan(m) for m in means] == [False, True, True, False]
