"""Field reliability (issue 11): execution modes (inference_mode, autocast, checkpointing, transforms
inside a block), leaks and caches (models freed, no hook left on persistent tensors, plans
that follow edits). Each test failed before the fix."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import funhooks as fh


def _mlp(device: torch.device | str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


# -- execution modes ----------------------------------------------------------------------------


def test_runs_work_under_inference_mode_and_keep_values_as_returned(device: torch.device) -> None:
    """Under `torch.inference_mode()` a run records; an in-place op after the module leaves
    the stored value as the module returned it (inference tensors keep no version counter,
    so they are stored as copies)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)).to(device)
    x = torch.randn(8, 4, device=device)
    with torch.inference_mode(), fh.with_hooks(model, [fh.outputs("0"), fh.inputs("1")]) as run:
        y = model(x)
    with torch.no_grad():
        expected = model[0](x)
    assert torch.equal(run.record["0"]["output"], expected) and (expected < 0).any()
    assert torch.equal(run.record["1"]["input"][0][0], expected)
    assert torch.equal(y, expected.relu())
    fh.testing.assert_no_hooks(model)


def test_an_inference_tensor_passed_through_outside_inference_mode_is_stored(device: torch.device) -> None:
    """An input made inside inference mode and passed through an `Identity` outside it."""
    with torch.inference_mode():
        x = torch.randn(2, 4, device=device)
    model = nn.Sequential(nn.Identity(), nn.Flatten()).to(device)
    with fh.with_hooks(model, fh.outputs("**")) as run:
        model(x)
    assert torch.equal(run.record["0"]["output"], x) and torch.equal(run.record["1"]["output"], x)


def test_runs_under_autocast_store_the_dtype_the_module_computed(device: torch.device) -> None:
    """Under `torch.autocast` the stored values are the bf16 the modules produced, and the
    gradients of a mixed-precision backward are recorded."""
    model = _mlp(device)
    x = torch.randn(4, 4, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16), fh.with_hooks(model, [fh.outputs("2"), fh.grads("2")]) as run:
        y = model(x)
        y.float().sum().backward()
    assert run.record["2"]["output"].dtype == torch.bfloat16 and torch.equal(run.record["2"]["output"], y.detach())
    assert run.record["2"]["grad"].dtype == torch.bfloat16


class _Checkpointed(nn.Module):
    """A block whose body runs under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=self.reentrant) if self.reentrant is not None else self.body(x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_modules_are_recorded_once_with_their_gradients(reentrant: bool, device: torch.device) -> None:
    """The recomputation during backward is not a new call: one call per forward, and the
    gradients, backward events and editors of a checkpointed region equal the plain model's."""
    x = torch.randn(5, 4, device=device, requires_grad=True)
    specs = [fh.outputs("**"), fh.inputs("body.0"), fh.grads("body.0"),
             fh.observe("body.2", lambda m, gi, go: go[0].clone(), event="backward", name="grad_out"),
             fh.edit("body.1", lambda m, a, o: o * 2)]
    records, grads = [], []
    for mode in (reentrant, None):
        model = _Checkpointed(mode).to(device)
        with fh.with_hooks(model, specs) as run:
            model(x).pow(2).sum().backward()
        records.append(run.record)
        grads.append([p.grad for p in model.parameters()])
        fh.testing.assert_no_hooks(model)
    checkpointed, plain = records
    assert all(len(checkpointed.calls(p, n)) == 1 for p, node in checkpointed.items() for n in node)
    assert checkpointed.equal(plain, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_transform_of_the_model_inside_a_block_raises_pointing_to_capture(transform: str) -> None:
    """`vmap(model)` / `grad` of the model inside a block would store values that escape
    the transform: a TransformError says so and points to `fh.capture`."""
    model = _mlp()
    x = torch.randn(5, 4)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        with pytest.raises(fh.TransformError) as err:
            if transform == "vmap":
                torch.func.vmap(model)(x)
            else:
                torch.func.grad(lambda t: model(t).sum())(x)
    assert str(err.value) == (
        "with_hooks: values stored by side effect cannot leave a torch.func transform, got module '0' called "
        "inside `vmap`/`grad` while the `with_hooks` block was entered outside it. Call `fh.capture(model, specs)` "
        "inside the transform instead: its Record comes back batched."
    )
    assert len(run.record) == 0
    fh.testing.assert_no_hooks(model)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.trace.* is deprecated:DeprecationWarning")  # 2.13 deprecates tracing
def test_jit_trace_inside_a_block_passes_its_check_and_traces_the_editors() -> None:
    """`torch.jit.trace` inside a block that stores outputs (with or without gradients) passes
    its own check, which traces again without gradients and compares the graphs (it failed:
    the entry detached the output in one trace only, and the tracer names a value after the
    variable that passes it to an op). Editors are traced into the graph; the block records
    every call jit makes."""
    model = _mlp()
    x = torch.randn(5, 4)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), fh.with_hooks(model, [fh.outputs("**"), fh.edit("2", lambda m, a, o: -o)]) as run:
            traced = torch.jit.trace(model, x)
        calls = [len(run.record.calls(p, "output")) for p in run.record]
        assert list(run.record) == ["0", "1", "2"] and calls[0] >= 1 and calls == calls[:1] * 3  # jit traces twice
        with torch.no_grad():
            assert torch.allclose(traced(x), -model(x))  # the edit is in the traced graph
        fh.testing.assert_no_hooks(model)


def test_pure_functions_called_inside_a_block_are_unseen_by_it() -> None:
    """`vmap(activation_grads(...))` and `vmap(capture(...))` inside a block return their own
    batched Records; the block around them stores nothing of their calls."""
    model = _mlp()
    x = torch.randn(5, 4)
    with fh.with_hooks(model, fh.outputs("**")) as run:
        loss, grads = torch.func.vmap(fh.activation_grads(model, "0", lambda out: out.sum()))(x)
        _, captured = torch.func.vmap(fh.capture(model, fh.outputs("0")))(x)
    assert len(run.record) == 0
    assert grads["0"]["grad"].shape == (5, 8) and captured["0"]["output"].shape == (5, 8)


# -- leaks and caches -------------------------------------------------------------------------------


def _specs_reaching(model: nn.Module) -> list[list[fh.Spec]]:
    """Specs that hold the model itself: a closure, a predicate, a list with the root."""
    scaled = fh.observe("0", lambda m, a, o: o * model[2].weight.sum(), name="scaled")
    first = fh.select(lambda path, m: m is model[0])
    return [[scaled], [fh.outputs(first)], [fh.outputs([model, model[0]])]]


@pytest.mark.usefixtures("frozen_heap")
def test_a_spec_closing_over_the_model_does_not_keep_it_alive() -> None:
    """Plans are cached per model; a spec whose function or predicate reaches the model
    itself must not pin it: once the user drops the model, it is freed."""
    model = _mlp()
    alive = weakref.ref(model)
    for specs in _specs_reaching(model):
        with fh.with_hooks(model, specs):
            model(torch.randn(2, 4))
    del model, specs
    gc.collect()
    assert alive() is None


class _Positions(nn.Module):
    """A learned positional embedding: the module returns its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos, self.keep, self.head = _Positions(), nn.Identity(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.keep(x) + self.pos(x))


def test_grads_of_persistent_tensors_leave_no_hook_behind() -> None:
    """`grads` on a module returning a parameter, or the caller's leaf input through an
    `Identity`: the gradient is recorded and no tensor hook stays after the block, so a
    training loop does not pile one up per step."""
    model = _Embedded()
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(3):
        with fh.with_hooks(model, fh.grads(["pos", "keep"])) as run:
            model(x).sum().backward()
        assert not model.pos.table._backward_hooks and not x._backward_hooks
    assert torch.allclose(run.record["pos"]["grad"], model.head.weight.sum(0).expand(3, 4))
    assert torch.allclose(run.record["keep"]["grad"], run.record["pos"]["grad"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = fh.train(model, [(x.detach(), torch.zeros(3, 2))] * 20, nn.functional.mse_loss, opt,
                     specs=fh.grads("pos"), progress=False)
    assert len(list(steps)) == 20
    assert not model.pos.table._backward_hooks
    fh.testing.assert_no_hooks(model)


def test_plans_follow_module_list_and_sequential_edits() -> None:
    """`insert`, `del` and `pop` edit `_modules` without PyTorch's registration hook: the
    next run sees the model as it is now (paths, values, selectors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    spec = fh.outputs("**")
    with fh.with_hooks(model, spec) as run:
        model(x)
    assert list(run.record) == ["0", "1", "2"]
    model.insert(1, nn.ReLU())
    with fh.with_hooks(model, spec) as run:
        model(x)
    assert list(run.record) == ["0", "1", "2", "3"]
    assert torch.equal(run.record["1"]["output"], model[0](x).relu().detach())
    del model[1]
    model.pop(2)
    with fh.with_hooks(model, spec) as run:
        model(x)
    assert list(run.record) == ["0", "1"]
    with pytest.raises(fh.SelectorError, match="selector '2'"):
        fh.with_hooks(model, fh.outputs("2"))


def test_a_list_of_many_modules_keeps_its_order_in_stored() -> None:
    """`hook_outputs(list)` of thousands of modules: `stored` follows the list's order."""
    model = nn.Sequential(*[nn.Identity() for _ in range(2000)])
    chosen = [model[i] for i in range(1999, -1, -3)]
    x = torch.randn(1)
    with fh.with_hooks(model, fh.hook_outputs(chosen)) as run:
        model(x)
    assert len(run.stored) == len(chosen) and list(run.record)[:2] == ["1", "4"]
