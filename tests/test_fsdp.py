"""FSDP2 (`fully_shard`): records, `param_grad` specs, reducers, summaries and hook checks on
sharded models, compared with the same model unsharded.

Two kinds of test. A two-rank gloo run on the CPU (this file spawned as a script per rank,
every wait bounded), where each rank holds a different shard; and a one-rank process group
in this process, where FSDP still moves parameters and gradients as it does on many ranks
(unsharded parameters in the forward, gradients reduced into the shards' ``.grad`` after
the backward): cheap enough for edge cases and exact error messages.
"""

from __future__ import annotations

import copy
import datetime
import os
import sys

import hypothesis
import pytest
import torch
from torch import nn

import funhooks as fh

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_gloo_available():
    pytest.skip("FSDP2 (`torch.distributed.fsdp.fully_shard`) with gloo is not available", allow_module_level=True)

WORLD = 2
BATCH = 4
COLLECTIVE_TIMEOUT_S = 60
STEPS = 3


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """`(sharded, plain)`: Linear-ReLU-Linear with each Linear and the root sharded, and an
    unsharded copy with the same parameters."""
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    sharded = copy.deepcopy(plain)
    fsdp.fully_shard(sharded[0])
    fsdp.fully_shard(sharded[2])
    fsdp.fully_shard(sharded)
    return sharded, plain


def _input(rank: int, step: int = 0) -> torch.Tensor:
    return torch.arange(BATCH * 3, dtype=torch.float32).reshape(BATCH, 3) / 10 - 0.5 + rank + step / 3


def _grad(param, grad):
    return grad


def _clip(param, grad):
    return grad.clamp(-0.5, 0.5)


GRAD_SPECS = (fh.observe("**", _grad, event="param_grad", name="shard"),
              fh.observe("**", _grad, event="param_grad", name="full", gather=True))


# -- two ranks -------------------------------------------------------------------------------


def _worker(out_dir: str) -> None:
    """One rank: runs the sharded and the plain model, saves what the tests compare."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    rank = dist.get_rank()
    try:
        sharded, plain = _models()
        x, both = _input(rank), torch.cat([_input(r) for r in range(WORLD)])
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
        with fh.with_hooks(sharded, fh.edit(nn.Linear, _clip, event="param_grad")):
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
        batches = [(_input(rank, i), torch.zeros(BATCH, 2)) for i in range(STEPS)]
        steps = list(fh.train(sharded, batches, nn.functional.mse_loss, opt, specs=(*stats.specs, norm)))
        state = stats.init()
        for step in steps:
            state = stats.step(state, step)
        out["stats"] = stats.result(fh.merge_across_ranks(stats, state)).stats
        out["norms"] = [_norms(step.record) for step in steps]
        whole = [(torch.cat([_input(r, i) for r in range(WORLD)]), torch.zeros(WORLD * BATCH, 2)) for i in range(STEPS)]
        alone = fh.observe(nn.Linear, _norm, event="param_grad", name="norm")  # each rank runs the whole batch
        plain_steps = list(fh.train(plain, whole, nn.functional.mse_loss, plain_opt, specs=(*stats.specs, alone)))
        state = stats.init()
        for step in plain_steps:
            state = stats.step(state, step)
        out["plain stats"] = stats.result(state).stats
        out["plain norms"] = [_norms(step.record) for step in plain_steps]

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


def test_summaries_of_a_sharded_model_count_full_parameters(ranks):
    """`layer_info` and `module_summary` rows and totals are the plain model's, not a shard's."""
    for r in ranks:
        sharded, plain = r["layer_info"]
        assert sharded == plain and [row.params for row in sharded] == [16, "", 10]
        assert r["summary"][0] == r["summary"][1]
        assert "Total params: 26" in r["summary"][0]


# -- one rank, in this process ----------------------------------------------------------------


COMPILE_WARNINGS = pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")  # inductor's import


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-process gloo group for this module's one-rank tests, destroyed after them."""
    dist = torch.distributed
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process already")
    store = tmp_path_factory.mktemp("one-rank") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    yield
    dist.destroy_process_group()


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
            for n, p in model.named_parameters()}


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor:UserWarning")  # Flatten, last
@hypothesis.given(fh.testing.models_and_inputs())
def test_records_of_a_sharded_random_model_equal_the_plain_models(one_rank, model_and_input):
    """On any drawn model sharded at its root (one rank), outputs, their gradients and every
    parameter's gathered gradient are the plain model's, bit for bit, under the same paths."""
    plain, x = model_and_input
    sharded = copy.deepcopy(plain)
    fsdp.fully_shard(sharded)
    specs = [fh.outputs("**", clone=True), fh.grads("**"), fh.observe("**", _grad, event="param_grad", name="g",
                                                                       gather=True)]
    records = []
    for model in (plain, sharded):
        with fh.with_hooks(model, specs) as run:
            model(x.clone().requires_grad_()).sum().backward()
        records.append(run.record)
    assert list(records[0]) == list(records[1])
    assert records[0].equal(records[1])


def test_each_backward_gets_its_own_part_of_an_accumulated_gradient(one_rank):
    """Without `zero_grad`, each backward's `param_grad` value is what it added; `.grad` holds the sum."""
    sharded, plain = _models()
    with fh.with_hooks(sharded, GRAD_SPECS[1]) as run:
        for step in range(2):
            sharded(_input(0, step)).sum().backward()
    for step in range(2):
        plain.zero_grad()
        plain(_input(0, step)).sum().backward()
        for path, grad in _grads(plain).items():
            torch.testing.assert_close(run.record.calls(path, "full")[step], grad)
    total = sum(run.record.calls("0.weight", "full"))
    torch.testing.assert_close(sharded[0].weight.grad.full_tensor(), total)


def test_a_backward_without_gradient_sync_is_seen_at_the_next_that_reduces(one_rank):
    """Under `set_requires_gradient_sync(False)` nothing reaches the shards: the specs run once, on
    the backward that reduces, with the gradient accumulated since the last reduction."""
    sharded, plain = _models()
    with fh.with_hooks(sharded, GRAD_SPECS[1]) as run:
        sharded.set_requires_gradient_sync(False)
        sharded(_input(0)).sum().backward()
        assert "0.weight" not in run.record
        sharded.set_requires_gradient_sync(True)
        sharded(_input(0, 1)).sum().backward()
    (plain(_input(0)).sum() + plain(_input(0, 1)).sum()).backward()
    for path, grad in _grads(plain).items():
        (value,) = run.record.calls(path, "full")
        torch.testing.assert_close(value, grad)


def test_activation_checkpointing_gives_one_value_per_backward(one_rank):
    """Recomputing the forward during backward watches nothing twice."""
    sharded, _ = _models()
    x = _input(0).requires_grad_()
    with fh.with_hooks(sharded, [GRAD_SPECS[0], fh.outputs("0")]) as run:
        torch.utils.checkpoint.checkpoint(sharded, x, use_reentrant=False).sum().backward()
    assert len(run.record.calls("0.weight", "shard")) == len(run.record.calls("0", "output")) == 1


def test_a_plan_made_before_sharding_is_not_reused_after(one_rank):
    """`fully_shard` replaces the parameters: a run after it watches the sharded ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    with fh.with_hooks(model, GRAD_SPECS[0]) as run:
        model(_input(0)).sum().backward()
    assert isinstance(run.record["0.weight"]["shard"], torch.Tensor)
    fsdp.fully_shard(model)
    with fh.with_hooks(model, GRAD_SPECS[0]) as run:
        model(_input(0)).sum().backward()
    assert type(run.record["0.weight"]["shard"]).__name__ == "DTensor"


def test_a_root_left_unsharded_is_watched_and_summaries_leave_it_sharded(one_rank):
    """A forward without backward leaves the root's parameters unsharded: `param_grad` specs still
    see shards, and `module_summary` / `dummy_eval` shard them again as they found them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fsdp.fully_shard(model)  # the root manages every parameter
    assert fh.module_summary(model, _input(0)).total == 26
    fh.dummy_eval(model)
    assert type(model[0].weight).__name__ == "DTensor"
    with torch.no_grad():
        model(_input(0))
    assert type(model[0].weight).__name__ == "Parameter"
    with fh.with_hooks(model, GRAD_SPECS[0]) as run:
        model(_input(0)).sum().backward()
    assert type(run.record["0.weight"]["shard"]).__name__ == "DTensor"


def test_a_stored_shard_keeps_its_value(one_rank):
    """`.grad` itself, stored, keeps its value when a later backward accumulates (FSDP adds to a
    copy), and a change in place (`zero_grad(set_to_none=False)`) is a StaleTensorError."""
    sharded, _ = _models()
    spec = fh.observe("2", _grad, event="param_grad", name="g")
    with fh.with_hooks(sharded, [spec, GRAD_SPECS[1]]) as run:
        sharded(_input(0)).sum().backward()
        sharded(_input(0, 1)).sum().backward()
    for path in ("2.weight", "2.bias"):
        stored = [g.full_tensor() for g in run.record.calls(path, "g")]
        assert all(torch.equal(a, b) for a, b in zip(stored, run.record.calls(path, "full")))
    sharded.zero_grad()
    with fh.with_hooks(sharded, spec) as run:
        sharded(_input(0)).sum().backward()  # stores `.grad` itself
        sharded.zero_grad(set_to_none=False)
    with pytest.raises(fh.StaleTensorError, match="Pass `clone=True`"):
        run.record


def test_an_editor_of_a_sharded_gradient_returns_a_dtensor(one_rank):
    """Returning a plain tensor for a shard's gradient is a HookError with the rule and a fix."""
    sharded, _ = _models()
    spec = fh.edit("2", lambda p, g: g.full_tensor(), event="param_grad", name="full")
    with pytest.raises(fh.HookError) as info, fh.with_hooks(sharded, spec):
        sharded(_input(0)).sum().backward()
    assert str(info.value) == (
        "with_hooks: an editor of an FSDP-sharded parameter's gradient returns a DTensor placed like the gradient "
        f"((Shard(dim=0),)), got a Tensor from {spec!r} for parameter '2.weight'. Compute the new gradient from "
        "`grad` with DTensor ops (e.g. `grad * scale`, `grad.clamp(-c, c)`)."
    )


def test_a_forward_run_outside_the_block_is_explained(one_rank):
    """A sharded parameter is watched from the forward: a block around the backward alone says so."""
    sharded, _ = _models()
    out = sharded(_input(0))
    with fh.with_hooks(sharded, GRAD_SPECS[0]) as run:
        out.sum().backward()
    with pytest.raises(KeyError, match="is an FSDP-sharded parameter: its gradient is seen when the forward"):
        run.record["0.weight"]["shard"]


def test_a_record_holding_a_shard_says_how_to_save_it(one_rank, tmp_path):
    """`Record.save` refuses a DTensor, and says to store its full tensor or its local part."""
    sharded, _ = _models()
    with fh.with_hooks(sharded, GRAD_SPECS[0]) as run:
        sharded(_input(0)).sum().backward()
    target = tmp_path / "rec.fh"
    with pytest.raises(TypeError) as info:
        run.record.save(target)
    assert str(info.value) == (
        "Record.save: stored values are tensors, numbers, str, bool, None, dtypes, devices and sizes in tuples, "
        f"lists, dicts and namedtuples, got DTensor at `rec['0.weight']['shard']`, so nothing was written to "
        f"{str(target)!r}. Store `value.full_tensor()` (the whole, a collective) or `value.to_local()` (this "
        "rank's part) instead."
    )
    run.record.map(lambda t: t.full_tensor()).save(target)
    assert fh.Record.load(target)["0.weight"]["shard"].shape == (4, 3)


@COMPILE_WARNINGS
def test_param_grad_on_a_compiled_sharded_model_is_refused(one_rank):
    """Inside `torch.compile` no forward watches the shards: an error at `with_hooks`, not silence."""
    sharded, _ = _models()
    compiled = torch.compile(sharded)
    with pytest.raises(fh.TransformError) as info:
        fh.with_hooks(compiled, GRAD_SPECS[0])
    assert str(info.value) == (
        "with_hooks: `param_grad` specs on FSDP-sharded parameters watch them in the forward of the FSDP module, "
        "which runs inside a `torch.compile`d module here, got module '0'. Run the specs on the sharded model before "
        "compiling it."
    )


def test_checks_tell_fsdp_hooks_from_funhooks(one_rank):
    """`assert_no_hooks` passes on a sharded model after a run, fails inside one, and still reports
    hooks that are neither FSDP's nor funhooks'; `assert_transparent` holds on a sharded model."""
    sharded, _ = _models()
    assert sharded._forward_pre_hooks and sharded._forward_hooks  # FSDP's own
    with fh.with_hooks(sharded, [GRAD_SPECS[0], fh.outputs("0")]):
        sharded(_input(0)).sum().backward()
        with pytest.raises(AssertionError, match="still has its `forward` wrapped by funhooks"):
            fh.testing.assert_no_hooks(sharded)
    fh.testing.assert_no_hooks(sharded)
    fh.testing.assert_transparent(sharded, [fh.outputs("**"), fh.grads("**"), GRAD_SPECS[0]], _input(0))
    handle = sharded[0].register_forward_hook(_grad)
    with pytest.raises(AssertionError, match="installed by \\['test_fsdp._grad'\\], not by funhooks"):
        fh.testing.assert_no_hooks(sharded)
    handle.remove()
    (_, _, unsharded), _ = fh._torch.fsdp_parameters(sharded[0])
    handle = unsharded.register_hook(fh._torch.is_dtensor)  # a stand-in for a funhooks hook left behind
    with pytest.raises(AssertionError, match="tensor 'weight \\(unsharded by FSDP\\)' of module '0' has 1 funhooks"):
        fh.testing.assert_no_hooks(sharded)
    handle.remove()


def test_check_gradients_reach_refuses_a_sharded_model(one_rank):
    """Autograd never sees FSDP's shards: the check says so instead of blaming every module."""
    sharded, plain = _models()
    fh.testing.check_gradients_reach(plain, _input(0))
    with pytest.raises(fh.TransformError) as info:
        fh.testing.check_gradients_reach(sharded, _input(0))
    assert str(info.value) == (
        "check_gradients_reach: the parameters checked are those autograd differentiates, got FSDPSequential, "
        "sharded by FSDP2, whose parameter shards autograd never sees (FSDP fills their `.grad` after the "
        "backward). Check the model before `fully_shard`."
    )


if __name__ == "__main__":
    # Import this file under its module name, so what it saves unpickles in pytest.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import test_fsdp

    test_fsdp._worker(sys.argv[1])
