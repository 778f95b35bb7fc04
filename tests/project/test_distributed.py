"""Records across ranks: `gather=True`, DDP-wrapped models, and reducer states merged with
`merge_across_ranks`, tested for real with two gloo processes on the CPU.

The test spawns this file as a script twice (one process per rank); every wait is bounded,
so a stuck collective fails the test instead of hanging CI.
"""

from __future__ import annotations

import datetime
import os
import sys

import attrs
import pytest
import toolz
import torch
from torch import nn

import funhooks as fh

WORLD = 2
BATCH = 2
COLLECTIVE_TIMEOUT_S = 60  # init_process_group's timeout: a lost peer fails, never hangs
STEPS_PER_RANK = 3


@attrs.frozen(eq=False)
class SumsState:
    """How many outputs of module '0' were seen, and their sum."""

    count: int
    total: torch.Tensor


@attrs.frozen
class Sums:
    """A tiny mergeable reducer: counts train steps and sums module '0''s outputs."""

    specs: tuple = (fh.outputs("0"),)

    def init(self) -> SumsState:
        return SumsState(0, torch.zeros(()))

    def step(self, state: SumsState, step) -> SumsState:
        return SumsState(state.count + 1, state.total + step.record["0"]["output"].sum())

    def result(self, state: SumsState) -> tuple[int, float]:
        return state.count, state.total.item()

    def merge(self, a: SumsState, b: SumsState) -> SumsState:
        return SumsState(a.count + b.count, a.total + b.total)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _input(rank: int) -> torch.Tensor:
    return torch.arange(BATCH * 3, dtype=torch.float32).reshape(BATCH, 3) / 10 + rank


def _mean(module, args, output):
    return output.mean()


def _worker(out_dir: str) -> None:
    """One rank: checks what it can see alone, saves what the parent compares across ranks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    try:
        assert fh.distributed.is_distributed()
        model = _model()
        x = _input(rank)
        both = torch.cat([_input(r) for r in range(WORLD)])

        # gather=True: tensors concatenated along dim 0 in rank order, 0-d tensors averaged.
        specs = [fh.outputs("0", gather=True), fh.outputs("2"), fh.inputs("2", gather=True),
                 fh.observe("2", _mean, name="mean", gather=True), fh.grads("0", gather=True)]
        with fh.with_hooks(model, specs) as run:
            model(x).sum().backward()
        rec = run.record
        with torch.no_grad():
            hidden = model[0](both)
            outs = model(both)
        assert torch.allclose(rec["0"]["output"], hidden)
        assert torch.equal(rec["2"]["output"], model(x).detach())  # not gathered: this rank's
        assert torch.allclose(rec["2"]["input"][0][0], torch.relu(hidden))
        per_rank = outs.reshape(WORLD, BATCH, -1).mean(dim=(1, 2))
        assert rec["2"]["mean"].ndim == 0 and torch.allclose(rec["2"]["mean"], per_rank.mean())
        assert rec["0"]["grad"].shape == (WORLD * BATCH, 4)
        fh.testing.assert_no_hooks(model)

        # DDP: selectors and paths are those of the inner model.
        ddp = DistributedDataParallel(_model())
        with fh.with_hooks(ddp, [fh.outputs("**"), fh.grads(nn.Linear, gather=True)]) as run:
            ddp(x).sum().backward()
        ddp_rec = run.record
        assert list(ddp_rec) == ["0", "1", "2"]
        assert ddp_rec["2"]["grad"].shape == (WORLD * BATCH, 2)
        with pytest.raises(fh.SelectorError):
            fh.with_hooks(ddp, fh.outputs("module.0"))
        fh.testing.assert_no_hooks(ddp.module)

        # Reducer states merged across ranks: every rank holds the global statistics.
        batches = [(_input(rank) + i, torch.zeros(BATCH, 2)) for i in range(STEPS_PER_RANK)]
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        reducers = {"sums": Sums()}
        if hasattr(fh, "ActivationStats") and callable(getattr(fh.ActivationStats, "merge", None)):
            reducers["stats"] = fh.ActivationStats()
        specs = tuple(toolz.unique(s for r in reducers.values() for s in r.specs))
        steps = list(fh.train(ddp, batches, nn.functional.mse_loss, opt, specs=specs))
        local = {k: toolz.reduce(r.step, steps, r.init()) for k, r in reducers.items()}
        merged = {k: fh.merge_across_ranks(r, local[k]) for k, r in reducers.items()}
        torch.save({"record": rec, "ddp_record": ddp_rec, "local": local, "merged": merged},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path) -> list[dict]:
    """Run both ranks (bounded in time by `_ranks.spawn`); return what each saved."""
    import _ranks

    _ranks.spawn([__file__, str(tmp_path)], WORLD)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """The results of one two-rank gloo run, shared by the tests below."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    return _spawn(tmp_path_factory.mktemp("gloo"))


def test_gather_gives_every_rank_the_same_global_record(ranks):
    """With `gather=True` both ranks' Records hold the same all-gathered tensors."""
    first, second = (r["record"] for r in ranks)
    assert first["0"]["output"].shape == (WORLD * BATCH, 4)
    assert torch.equal(first["0"]["output"], second["0"]["output"])
    assert torch.equal(first["2"]["mean"], second["2"]["mean"])
    assert torch.equal(first["0"]["grad"], second["0"]["grad"])
    assert not torch.equal(first["2"]["output"], second["2"]["output"])  # gather=False stays local


def test_ddp_paths_are_those_of_the_inner_model(ranks):
    """A DDP-wrapped model records under the inner model's paths, on every rank."""
    for r in ranks:
        assert list(r["ddp_record"]) == ["0", "1", "2"]


def test_merge_across_ranks_gives_every_rank_the_merge_of_all_states(ranks):
    """Each rank holds `reducer.merge(state_rank0, state_rank1)`, the global statistics."""
    reducer = Sums()
    expected = reducer.result(reducer.merge(ranks[0]["local"]["sums"], ranks[1]["local"]["sums"]))
    assert expected[0] == WORLD * STEPS_PER_RANK
    for r in ranks:
        assert reducer.result(r["merged"]["sums"]) == expected
        assert r["merged"]["sums"].total.device == torch.device("cpu")


def test_merge_across_ranks_merges_activation_stats(ranks):
    """ActivationStats states merged across ranks equal their merge in one process."""
    if "stats" not in ranks[0]["merged"]:
        pytest.skip("fh.ActivationStats has no `merge` in this tree")
    reducer = fh.ActivationStats()
    expected = reducer.result(reducer.merge(ranks[0]["local"]["stats"], ranks[1]["local"]["stats"]))
    for r in ranks:
        assert reducer.result(r["merged"]["stats"]).stats == expected.stats


# -- without a process group -----------------------------------------------------------------


def test_gather_is_a_no_op_without_a_process_group(device):
    """Outside `torch.distributed`, `gather=True` stores exactly what `gather=False` does."""
    model = _model().to(device)
    x = _input(0).to(device)
    with fh.with_hooks(model, [fh.outputs("**", gather=True), fh.observe("2", _mean, name="mean", gather=True)]) as gathered:
        model(x)
    with fh.with_hooks(model, [fh.outputs("**"), fh.observe("2", _mean, name="mean")]) as plain:
        model(x)
    assert gathered.record.equal(plain.record)


def test_merge_across_ranks_returns_the_state_without_a_process_group():
    """With one process there is nothing to merge: the state comes back as it is."""
    state = Sums().init()
    assert fh.merge_across_ranks(Sums(), state) is state


def test_merge_across_ranks_needs_a_merge_method():
    """A reducer without `merge` is a ReducerError with the rule and a fix."""

    class NoMerge:
        def __repr__(self) -> str:
            return "NoMerge()"

    with pytest.raises(fh.ReducerError) as info:
        fh.merge_across_ranks(NoMerge(), 0)
    assert str(info.value) == (
        "merge_across_ranks: the reducer needs a `merge(a, b)` method, got NoMerge() without one. "
        "Give it `merge`, or gather its results yourself with `torch.distributed.all_gather_object`."
    )


if __name__ == "__main__":
    # Import this file under its module name, so the states it saves unpickle in pytest.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_distributed

    test_distributed._worker(sys.argv[1])
