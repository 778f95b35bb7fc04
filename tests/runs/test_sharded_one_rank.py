"""FSDP2 (`fully_shard`) in a one-rank process group in this process, where FSDP still moves
parameters and gradients as it does on many ranks (unsharded parameters in the forward,
gradients reduced into the shards' ``.grad`` after the backward): cheap enough for edge cases
and exact error messages."""

from __future__ import annotations

import copy
import datetime

import hypothesis
import pytest
import torch
from fsdp_helpers import (
    COLLECTIVE_TIMEOUT_S,
    GRAD_SPECS,
    fsdp,
    grad_value,
    models,
    rank_input,
)
from torch import nn

import funhooks as fh

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
    specs = [fh.outputs("**", clone=True), fh.grads("**")]
    if any(True for _ in plain.parameters()):  # a `param_grad` spec on a model without parameters is refused
        specs.append(fh.observe("**", grad_value, event="param_grad", name="g", gather=True))
    records = []
    for model in (plain, sharded):
        with fh.with_hooks(model, specs) as run:
            model(x.clone().requires_grad_()).sum().backward()
        records.append(run.record)
    assert list(records[0]) == list(records[1])
    assert records[0].equal(records[1])


def test_each_backward_gets_its_own_part_of_an_accumulated_gradient(one_rank):
    """Without `zero_grad`, each backward's `param_grad` value is what it added; `.grad` holds the sum."""
    sharded, plain = models()
    with fh.with_hooks(sharded, GRAD_SPECS[1]) as run:
        for step in range(2):
            sharded(rank_input(0, step)).sum().backward()
    for step in range(2):
        plain.zero_grad()
        plain(rank_input(0, step)).sum().backward()
        for path, grad in _grads(plain).items():
            torch.testing.assert_close(run.record.calls(path, "full")[step], grad)
    total = sum(run.record.calls("0.weight", "full"))
    torch.testing.assert_close(sharded[0].weight.grad.full_tensor(), total)


def test_a_backward_without_gradient_sync_is_seen_at_the_next_that_reduces(one_rank):
    """Under `set_requires_gradient_sync(False)` nothing reaches the shards: the specs run once, on
    the backward that reduces, with the gradient accumulated since the last reduction."""
    sharded, plain = models()
    with fh.with_hooks(sharded, GRAD_SPECS[1]) as run:
        sharded.set_requires_gradient_sync(False)
        sharded(rank_input(0)).sum().backward()
        assert "0.weight" not in run.record
        sharded.set_requires_gradient_sync(True)
        sharded(rank_input(0, 1)).sum().backward()
    (plain(rank_input(0)).sum() + plain(rank_input(0, 1)).sum()).backward()
    for path, grad in _grads(plain).items():
        (value,) = run.record.calls(path, "full")
        torch.testing.assert_close(value, grad)


def test_activation_checkpointing_gives_one_value_per_backward(one_rank):
    """Recomputing the forward during backward watches nothing twice."""
    sharded, _ = models()
    x = rank_input(0).requires_grad_()
    with fh.with_hooks(sharded, [GRAD_SPECS[0], fh.outputs("0")]) as run:
        torch.utils.checkpoint.checkpoint(sharded, x, use_reentrant=False).sum().backward()
    assert len(run.record.calls("0.weight", "shard")) == len(run.record.calls("0", "output")) == 1


def test_a_plan_made_before_sharding_is_not_reused_after(one_rank):
    """`fully_shard` replaces the parameters: a run after it watches the sharded ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    with fh.with_hooks(model, GRAD_SPECS[0]) as run:
        model(rank_input(0)).sum().backward()
    assert isinstance(run.record["0.weight"]["shard"], torch.Tensor)
    fsdp.fully_shard(model)
    with fh.with_hooks(model, GRAD_SPECS[0]) as run:
        model(rank_input(0)).sum().backward()
    assert type(run.record["0.weight"]["shard"]).__name__ == "DTensor"


def test_a_root_left_unsharded_is_watched_and_summaries_leave_it_sharded(one_rank):
    """A forward without backward leaves the root's parameters unsharded: `param_grad` specs still
    see shards, and `module_summary` / `dummy_eval` shard them again as they found them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    fsdp.fully_shard(model)  # the root manages every parameter
    assert fh.module_summary(model, rank_input(0)).total == 26
    fh.dummy_eval(model)
    assert type(model[0].weight).__name__ == "DTensor"
    with torch.no_grad():
        model(rank_input(0))
    assert type(model[0].weight).__name__ == "Parameter"
    with fh.with_hooks(model, GRAD_SPECS[0]) as run:
        model(rank_input(0)).sum().backward()
    assert type(run.record["0.weight"]["shard"]).__name__ == "DTensor"


def test_a_stored_shard_keeps_its_value(one_rank):
    """`.grad` itself, stored, keeps its value when a later backward accumulates (FSDP adds to a
    copy), and a change in place (`zero_grad(set_to_none=False)`) is a StaleTensorError."""
    sharded, _ = models()
    spec = fh.observe("2", grad_value, event="param_grad", name="g")
    with fh.with_hooks(sharded, [spec, GRAD_SPECS[1]]) as run:
        sharded(rank_input(0)).sum().backward()
        sharded(rank_input(0, 1)).sum().backward()
    for path in ("2.weight", "2.bias"):
        stored = [g.full_tensor() for g in run.record.calls(path, "g")]
        assert all(torch.equal(a, b) for a, b in zip(stored, run.record.calls(path, "full")))
    sharded.zero_grad()
    with fh.with_hooks(sharded, spec) as run:
        sharded(rank_input(0)).sum().backward()  # stores `.grad` itself
        sharded.zero_grad(set_to_none=False)
    with pytest.raises(fh.StaleTensorError, match="Pass `clone=True`"):
        run.record


def test_an_editor_of_a_sharded_gradient_returns_a_dtensor(one_rank):
    """Returning a plain tensor for a shard's gradient is a HookError with the rule and a fix."""
    sharded, _ = models()
    spec = fh.edit("2", lambda p, g: g.full_tensor(), event="param_grad", name="full")
    with pytest.raises(fh.HookError) as info, fh.with_hooks(sharded, spec):
        sharded(rank_input(0)).sum().backward()
    assert str(info.value) == (
        "with_hooks: an editor of an FSDP-sharded parameter's gradient returns a DTensor placed like the gradient "
        f"((Shard(dim=0),)), got a Tensor from {spec!r} for parameter '2.weight'. Compute the new gradient from "
        "`grad` with DTensor ops (e.g. `grad * scale`, `grad.clamp(-c, c)`)."
    )


def test_a_forward_run_outside_the_block_is_explained(one_rank):
    """A sharded parameter is watched from the forward: a block around the backward alone says so."""
    sharded, _ = models()
    out = sharded(rank_input(0))
    with fh.with_hooks(sharded, GRAD_SPECS[0]) as run:
        out.sum().backward()
    with pytest.raises(KeyError, match="is an FSDP-sharded parameter: its gradient is seen when the forward"):
        run.record["0.weight"]["shard"]


def test_a_record_holding_a_shard_says_how_to_save_it(one_rank, tmp_path):
    """`Record.save` refuses a DTensor, and says to store its full tensor or its local part."""
    sharded, _ = models()
    with fh.with_hooks(sharded, GRAD_SPECS[0]) as run:
        sharded(rank_input(0)).sum().backward()
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
    sharded, _ = models()
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
    sharded, _ = models()
    assert sharded._forward_pre_hooks and sharded._forward_hooks  # FSDP's own
    with fh.with_hooks(sharded, [GRAD_SPECS[0], fh.outputs("0")]):
        sharded(rank_input(0)).sum().backward()
        with pytest.raises(AssertionError, match="still has its `forward` wrapped by funhooks"):
            fh.testing.assert_no_hooks(sharded)
    fh.testing.assert_no_hooks(sharded)
    fh.testing.assert_transparent(sharded, [fh.outputs("**"), fh.grads("**"), GRAD_SPECS[0]], rank_input(0))
    handle = sharded[0].register_forward_hook(grad_value)
    with pytest.raises(AssertionError, match="installed by \\['fsdp_helpers.grad_value'\\], not by funhooks"):
        fh.testing.assert_no_hooks(sharded)
    handle.remove()
    (_, _, unsharded), _ = fh._torch.fsdp_parameters(sharded[0])
    handle = unsharded.register_hook(fh._torch.is_dtensor)  # a stand-in for a funhooks hook left behind
    with pytest.raises(AssertionError, match="tensor 'weight \\(unsharded by FSDP\\)' of module '0' has 1 funhooks"):
        fh.testing.assert_no_hooks(sharded)
    handle.remove()


def test_check_gradients_reach_refuses_a_sharded_model(one_rank):
    """Autograd never sees FSDP's shards: the check says so instead of blaming every module."""
    sharded, plain = models()
    fh.testing.check_gradients_reach(plain, rank_input(0))
    with pytest.raises(fh.TransformError) as info:
        fh.testing.check_gradients_reach(sharded, rank_input(0))
    assert str(info.value) == (
        "check_gradients_reach: the parameters checked are those autograd differentiates, got FSDPSequential, "
        "sharded by FSDP2, whose parameter shards autograd never sees (FSDP fills their `.grad` after the "
        "backward). Check the model before `fully_shard`."
    )
