"""FSDP2 (`fully_shard`) on two gloo ranks on the CPU: records, `param_grad` specs, reducers and
summaries of a sharded model, compared with the same model unsharded. This file runs as a
script per rank (every wait bounded); each rank holds a different shard. The one-rank edge
cases are in test_sharded_one_rank.py."""

from __future__ import annotations

import datetime
import os
import sys

import pytest
import torch
from fsdp_helpers import (
    BATCH,
    COLLECTIVE_TIMEOUT_S,
    GRAD_SPECS,
    STEPS,
    WORLD,
    clip,
    models,
    rank_input,
)
from torch import nn

import funhooks as fh


def _worker(out_dir: str) -> None:
    """One rank: runs the sharded and the plain model, saves what the tests compare."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    try:
        sharded, plain = models()
        x, both = rank_input(rank), torch.cat([rank_input(r) for r in range(WORLD)])
        out: dict = {}
        specs = [fh.outputs("**"), fh.inputs("**"), fh.grads("**")]
        for name, model in (("sharded", sharded), ("plain", plain)):
            with fh.with_hooks(model, specs) as run:
                model(x).sum().backward()
            out[f"{name} record"] = run.record
        sharded.zero_grad()
        plain.zero_grad()

        # param_grad: this rank's shard of the averaged gradient, or all of it with gather=True
        with fh.with_hooks(sharded, GRAD_SPECS) as run:
            sharded(x).sum().backward()
        plain(both).sum().div(WORLD).backward()  # FSDP averages the ranks' gradients
        out["shards"] = {p: (str(v["shard"].placements), v["shard"].to_local()) for p, v in run.record.items()}
        out["gathered"] = {p: v["full"] for p, v in run.record.items()}
        out["plain grads"] = {n: p.grad.clone() for n, p in plain.named_parameters()}

        # an editor clips; the optimizer steps with the clipped gradient
        sharded.zero_grad()
        plain.zero_grad()
        opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, plain))
        with fh.with_hooks(sharded, fh.edit(nn.Linear, clip, event="param_grad")):
            sharded(x).sum().backward()
            opt.step()
        plain(both).sum().div(WORLD).backward()
        for p in plain.parameters():
            p.grad.clamp_(-0.5, 0.5)
        plain_opt.step()
        out["stepped"] = {n: p.full_tensor() for n, p in sharded.named_parameters()}
        out["plain stepped"] = {n: p.detach().clone() for n, p in plain.named_parameters()}

        # ActivationStats merged across ranks, and a gradient statistic, against one process
        stats, norm = fh.ActivationStats(), fh.observe(nn.Linear, _norm, event="param_grad", name="norm", gather=True)
        batches = [(rank_input(rank, i), torch.zeros(BATCH, 2)) for i in range(STEPS)]
        steps = list(fh.train(sharded, batches, nn.functional.mse_loss, opt, specs=(*stats.specs, norm)))
        state = stats.init()
        for step in steps:
            state = stats.step(state, step)
        out["stats"] = stats.result(fh.merge_across_ranks(stats, state)).stats
        out["norms"] = [_norms(step.record) for step in steps]
        whole = [(torch.cat([rank_input(r, i) for r in range(WORLD)]), torch.zeros(WORLD * BATCH, 2)) for i in range(STEPS)]
        alone = fh.observe(nn.Linear, _norm, event="param_grad", name="norm")  # each rank runs the whole batch
        plain_steps = list(fh.train(plain, whole, nn.functional.mse_loss, plain_opt, specs=(*stats.specs, alone)))
        state = stats.init()
        for step in plain_steps:
            state = stats.step(state, step)
        out["plain stats"] = stats.result(state).stats
        out["plain norms"] = [_norms(step.record) for step in plain_steps]

        # GradientStats and UpdateRatio read the sharded parameters: every rank's are the whole model's
        sharded_twin, plain_twin = models(seed=1)
        targets = [torch.full((BATCH, 2), float(i)) for i in range(STEPS)]
        mine = fh.fit(sharded_twin, [(rank_input(rank, i), targets[i]) for i in range(STEPS)], nn.functional.mse_loss,
                      torch.optim.SGD(sharded_twin.parameters(), lr=0.1), [fh.GradientStats(), fh.UpdateRatio()])
        whole_twin = [(torch.cat([rank_input(r, i) for r in range(WORLD)]), targets[i].repeat(WORLD, 1))
                      for i in range(STEPS)]
        alone_twin = fh.fit(plain_twin, whole_twin, nn.functional.mse_loss,
                            torch.optim.SGD(plain_twin.parameters(), lr=0.1), [fh.GradientStats(), fh.UpdateRatio()])
        out["parameter stats"] = [(r.paths, r.stats if i == 0 else r.ratios) for i, r in enumerate(mine)]
        out["plain parameter stats"] = [(r.paths, r.stats if i == 0 else r.ratios) for i, r in enumerate(alone_twin)]

        # summaries count full parameters; the model still works afterwards
        out["layer_info"] = (fh.layer_info(sharded, x), fh.layer_info(plain, x))
        out["summary"] = (str(fh.module_summary(sharded, x)), str(fh.module_summary(plain, x)))
        with torch.no_grad():
            assert torch.allclose(sharded(x), plain(x))
        fh.testing.assert_no_hooks(sharded)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _norm(param, grad):
    return grad.norm()


def _norms(record: fh.Record) -> dict[str, torch.Tensor]:
    return {path: node["norm"] for path, node in record.items() if "norm" in node}


def _numbers(value) -> list[float]:
    """The floats of nested lists of dicts, in order."""
    if isinstance(value, dict):
        value = list(value.values())
    return [x for item in value for x in _numbers(item)] if isinstance(value, list) else [value]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each rank of one two-rank gloo run saved."""
    import _ranks

    out = tmp_path_factory.mktemp("fsdp")
    _ranks.spawn([__file__, str(out)], WORLD)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_records_of_a_sharded_model_equal_the_plain_models(ranks):
    """Outputs, inputs and output gradients recorded on the FSDP2 model equal the plain model's."""
    for r in ranks:
        assert list(r["sharded record"]) == ["0", "1", "2"]
        assert r["sharded record"].equal(r["plain record"])


def test_param_grad_sees_each_ranks_shard_under_the_usual_path(ranks):
    """Each rank stores its own Shard(0) of the averaged gradient; together they make the whole."""
    plain = ranks[0]["plain grads"]
    assert list(ranks[0]["shards"]) == list(plain)
    for path, grad in plain.items():
        placement, first = ranks[0]["shards"][path]
        assert placement == "(Shard(dim=0),)"
        second = ranks[1]["shards"][path][1]
        assert first.shape[0] + second.shape[0] == grad.shape[0]
        torch.testing.assert_close(torch.cat([first, second]), grad)


def test_param_grad_gathered_is_the_whole_gradient_on_every_rank(ranks):
    """`gather=True` stores the full gradient, the same on both ranks: one process's, whole batch."""
    for path, grad in ranks[0]["plain grads"].items():
        assert torch.equal(ranks[0]["gathered"][path], ranks[1]["gathered"][path])
        torch.testing.assert_close(ranks[0]["gathered"][path], grad)


def test_param_grad_editor_is_what_the_optimizer_steps_with(ranks):
    """Clipping sharded gradients with an editor moves the parameters as clipping the plain model's."""
    for r in ranks:
        for path, value in r["plain stepped"].items():
            torch.testing.assert_close(r["stepped"][path], value)


def test_activation_stats_merged_across_ranks_equal_one_process_on_the_whole_batch(ranks):
    """ActivationStats of the sharded model, merged across ranks, equal the plain model's on both
    ranks' batches at once."""
    for r in ranks:
        assert len(r["stats"]) == STEPS
        for mine, whole in zip(r["stats"], r["plain stats"]):
            assert len(mine) == len(whole) == 2  # the two Linears
            for module, other in zip(mine, whole):
                assert module == pytest.approx(other, rel=1e-5, abs=1e-6)


def test_gradient_statistics_equal_one_process_on_the_whole_batch(ranks):
    """A gathered `param_grad` statistic is the same on every rank, the plain model's on the whole batch."""
    for r in ranks:
        for mine, whole in zip(r["norms"], r["plain norms"]):
            assert list(mine) == ["0.weight", "0.bias", "2.weight", "2.bias"]
            for path, value in mine.items():
                torch.testing.assert_close(value, whole[path])


def test_gradient_stats_and_update_ratios_of_sharded_parameters_are_the_whole_models(ranks):
    """GradientStats and UpdateRatio on the FSDP2 model: each rank's per-layer numbers are those
    of the whole (unsharded) gradients and updates, the plain model's on both ranks' batches."""
    for r in ranks:
        for (paths, mine), (plain_paths, whole) in zip(r["parameter stats"], r["plain parameter stats"]):
            assert paths == plain_paths == ("0", "2") and len(mine) == STEPS
            assert _numbers(mine) == pytest.approx(_numbers(whole), rel=1e-5, abs=1e-7)


def test_summaries_of_a_sharded_model_count_full_parameters(ranks):
    """`layer_info` and `module_summary` rows and totals are the plain model's, not a shard's."""
    for r in ranks:
        sharded, plain = r["layer_info"]
        assert sharded == plain and [row.params for row in sharded] == [16, "", 10]
        assert r["summary"][0] == r["summary"][1]
        assert "Total params: 26" in r["summary"][0]

if __name__ == "__main__":
    # Import this file under its module name, so what it saves unpickles in pytest.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_sharded

    test_sharded._worker(sys.argv[1])
