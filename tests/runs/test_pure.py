"""capture / functional: pure functions returning (output, Record) under torch.func."""

import runpy
from pathlib import Path

import hypothesis
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FEATURES = 4


@st.composite
def mlps(draw: st.DrawFn) -> tuple[nn.Module, torch.Tensor]:
    """A small random MLP (linear, tanh, in-place ReLU, LayerNorm, a shared layer) and a batch."""
    torch.manual_seed(draw(st.integers(0, 2**16)))
    width, layers = FEATURES, []
    shared = nn.Linear(FEATURES, FEATURES)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["linear", "tanh", "relu_", "norm", "shared"]))
        if kind == "linear":
            new = draw(st.integers(2, 6))
            layers.append(nn.Linear(width, new))
            width = new
        elif kind == "tanh":
            layers.append(nn.Tanh())
        elif kind == "relu_" and layers and isinstance(layers[-1], nn.Linear):
            layers.append(nn.ReLU(inplace=True))  # autograd allows it after a linear layer only
        elif kind == "relu_":
            layers.append(nn.ReLU())
        elif kind == "norm":
            layers.append(nn.LayerNorm(width))
        elif width == FEATURES:
            layers += [shared, nn.Tanh(), shared]
    layers.append(nn.Linear(width, 2))
    x = torch.randn(draw(st.integers(1, 4)), FEATURES)
    return nn.Sequential(*layers), x


def stacked(records: list[fh.Record]) -> fh.Record:
    """The per-example Records stacked along a new first dimension."""
    flat = [fh._torch.pytree.tree_flatten(r) for r in records]
    leaves = [torch.stack(ls) for ls in zip(*(f[0] for f in flat))]
    return fh._torch.pytree.tree_unflatten(leaves, flat[0][1])


def test_capture_returns_output_and_record(device: torch.device) -> None:
    """capture(model, specs)(x) is (model(x), the Record a with_hooks run would give)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(device)
    x = torch.randn(5, 3, device=device)
    out, rec = fh.capture(model, [fh.outputs(nn.Linear), fh.inputs("2")])(x)
    with fh.with_hooks(model, [fh.outputs(nn.Linear), fh.inputs("2")]) as run:
        expected = model(x)
    assert torch.equal(out, expected) and rec.equal(run.record)
    fh.testing.assert_no_hooks(model)


@given(mlps())
def test_vmap_record_equals_stacked_per_example_records(model_x: tuple[nn.Module, torch.Tensor]) -> None:
    """vmap(capture(...)) returns the per-example Records stacked, in-place ops included."""
    model, x = model_x
    f = fh.capture(model, [fh.outputs("**", clone=True), fh.inputs(nn.Linear, clone=True)])
    out, rec = torch.func.vmap(f)(x)
    per_example = [f(x[i : i + 1].clone()) for i in range(len(x))]
    expected = stacked([r.map(lambda t: t[0]) for _, r in per_example])
    assert rec.equal(expected, atol=1e-5, rtol=1e-5)
    assert torch.allclose(out, torch.cat([o for o, _ in per_example]), atol=1e-5)
    fh.testing.assert_no_hooks(model)


@given(mlps())
def test_grad_has_aux_equals_autograd(model_x: tuple[nn.Module, torch.Tensor]) -> None:
    """grad(functional(...), has_aux=True) gives autograd's parameter gradients plus the Record."""
    model, x = model_x
    f = fh.functional(model, fh.outputs(nn.Linear, clone=True))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, fh.Record]:
        out, rec = f(p, x)
        return out.square().sum(), rec

    grads, rec = torch.func.grad(loss, has_aux=True)(params, x)
    model.zero_grad()
    with fh.with_hooks(model, fh.outputs(nn.Linear, clone=True)) as run:
        model(x).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, (name, model, torch.is_grad_enabled(), [(n, q.grad is None, q.requires_grad) for n, q in model.named_parameters()])
        assert torch.allclose(grads[name], p.grad, atol=1e-5), name
    assert rec.equal(run.record, atol=1e-6)
    fh.testing.assert_no_hooks(model)


def test_vmap_grad_gives_per_example_grads_and_records(device: torch.device) -> None:
    """vmap(grad(...)) over functional gives per-example gradients and per-example Records."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(device)
    f = fh.functional(model, fh.outputs("1"))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict, x: torch.Tensor) -> tuple[torch.Tensor, fh.Record]:
        out, rec = f(p, x)
        return out.sum(), rec

    x = torch.randn(6, 3, device=device)
    grads, rec = torch.func.vmap(torch.func.grad(loss, has_aux=True), in_dims=(None, 0))(params, x)
    for i in range(len(x)):
        g, r = torch.func.grad(loss, has_aux=True)(params, x[i])
        assert torch.allclose(grads["0.weight"][i], g["0.weight"], atol=1e-6)
        assert torch.allclose(rec["1"]["output"][i], r["1"]["output"], atol=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # jvp's own
def test_jacrev_and_jvp_compose(device: torch.device) -> None:
    """jacrev and jvp differentiate through a capture function and return its Record."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Tanh()).to(device)
    f = fh.capture(model, fh.outputs("0"))
    x = torch.randn(3, device=device)
    jac, rec = torch.func.jacrev(f, has_aux=True)(x)
    assert torch.allclose(jac, torch.func.jacrev(lambda v: model(v))(x)) and torch.equal(rec["0"]["output"], model[0](x).detach())
    g = fh.capture(model, fh.outputs("0", detach=False))  # detach=True would cut the tangent
    (out, rec), (dout, drec) = torch.func.jvp(g, (x,), (torch.ones_like(x),))
    assert torch.allclose(drec["0"]["output"], model[0].weight.sum(1).detach(), atol=1e-6)
    assert torch.allclose(out, model(x))


def test_editors_work_under_vmap() -> None:
    """A forward editor inside capture changes the output under vmap, per example."""
    model = nn.Sequential(nn.Linear(2, 2))
    f = fh.capture(model, fh.edit("0", lambda m, args, out: out * 0))
    out, rec = torch.func.vmap(f)(torch.randn(3, 2))
    assert torch.equal(out, torch.zeros(3, 2)) and len(rec) == 0


def test_stored_values_stay_right_when_in_place_ops_follow_under_vmap() -> None:
    """Under vmap stored outputs are copies, so a later ReLU(inplace=True) leaves them intact."""
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True))
    x = torch.randn(4, 2)
    _, rec = torch.func.vmap(fh.capture(model, fh.outputs("0")))(x)
    assert torch.allclose(rec["0"]["output"], model[0](x).detach())


def test_eager_capture_raises_when_in_place_op_changes_stored_output() -> None:
    """In eager capture a stored output changed in place raises StaleTensorError naming clone=True."""
    model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(inplace=True))
    with pytest.raises(fh.StaleTensorError, match="clone=True"):
        fh.capture(model, fh.outputs("0"))(torch.randn(4, 2))


def test_functional_uses_given_params_and_optional_buffers() -> None:
    """functional runs with the given parameters; buffers may be given or left to the model."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).eval()
    f = fh.functional(model, fh.outputs("0"))
    params = {k: torch.zeros_like(v) if k.startswith("0.") else v for k, v in model.named_parameters()}
    out, rec = f(params, torch.ones(3, 2))
    assert torch.equal(rec["0"]["output"], torch.zeros(3, 2))
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    buffers["1.running_mean"] = torch.ones(2)
    out2, _ = f((params, buffers), torch.ones(3, 2))
    assert not torch.allclose(out, out2)


def test_functional_params_mismatch_lists_missing_and_unexpected() -> None:
    """functional names the missing and the unexpected parameter names."""
    model = nn.Sequential(nn.Linear(2, 2))
    f = fh.functional(model, fh.outputs("0"))
    with pytest.raises(fh.SpecError) as err:
        f({"0.weight": torch.zeros(2, 2), "0.bais": torch.zeros(2)}, torch.ones(1, 2))
    assert str(err.value) == (
        "functional: `params` names every parameter of Sequential (buffers optional) and nothing "
        "else, got missing ['0.bias'] and unexpected ['0.bais']. Build it from "
        "`dict(model.named_parameters())`."
    )


BACKWARD_MESSAGE = (
    "capture: a pure function returns its Record when the forward pass ends, so backward events "
    "(`grads`, `backward`, `backward_pre`, `param_grad`) never reach it and module backward hooks do "
    "not run under `vmap`/`grad`, got {spec!r}. Use `fh.activation_grads(model, where, loss_fn)` for "
    "gradients of activations, or `fh.with_hooks` around an eager `backward()`."
)


@pytest.mark.parametrize(
    "spec",
    [fh.grads("0"), fh.observe("0", lambda m, gi, go: go[0], event="backward", name="g"),
     fh.observe("0", lambda m, go: go[0], event="backward_pre", name="g"),
     fh.observe("0", lambda p, g: g, event="param_grad", name="g")],
    ids=["grads", "backward", "backward_pre", "param_grad"],
)
@pytest.mark.parametrize("transform", ["vmap", "grad", "eager"])
def test_backward_specs_raise_pointing_to_activation_grads(spec: fh.Spec, transform: str) -> None:
    """Backward-event specs in capture raise TransformError pointing to activation_grads."""
    model = nn.Sequential(nn.Linear(2, 2))
    f = fh.capture(model, spec)
    calls = {"vmap": lambda x: torch.func.vmap(f)(x),
             "grad": lambda x: torch.func.grad(lambda x: f(x)[0].sum())(x), "eager": f}
    with pytest.raises(fh.TransformError) as err:
        calls[transform](torch.randn(3, 2))
    assert str(err.value) == BACKWARD_MESSAGE.format(spec=spec)
    fh.testing.assert_no_hooks(model)


def test_non_tensor_leaf_under_transform_raises() -> None:
    """A spec storing a non-tensor raises under vmap, naming the module and the record name."""
    def count(module: nn.Module, args: tuple, output: torch.Tensor) -> int:
        return 3

    model = nn.Sequential(nn.Linear(2, 2))
    f = fh.capture(model, fh.observe("0", count))
    assert f(torch.ones(1, 2))[1]["0"]["count"] == 3
    with pytest.raises(fh.TransformError) as err:
        torch.func.vmap(f)(torch.ones(3, 2))
    assert str(err.value) == (
        "capture: under a torch.func transform every stored value is a tensor or a pytree of tensors, "
        "got int 3 in 'count' of module '0'. Return tensors from the spec's function (e.g. "
        "`torch.tensor(value)`), or run it outside the transform."
    )


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_models_are_refused() -> None:
    """A TorchScript model, or a selection inside a scripted submodule, raises TransformError."""
    with pytest.raises(fh.TransformError, match="TorchScript"):
        fh.capture(torch.jit.script(nn.Sequential(nn.Linear(2, 2))), fh.outputs("0"))
    model = nn.Sequential(torch.jit.script(nn.Sequential(nn.Linear(2, 2))), nn.ReLU())
    with pytest.raises(fh.TransformError) as err:
        fh.capture(model, fh.outputs("0.0"))
    assert str(err.value) == (
        "capture: hooks on modules inside a TorchScript module never fire, got module '0.0' selected "
        "by outputs('0.0'). Hook the eager model before scripting it."
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).relu()


def test_fx_inlined_modules_are_refused_and_called_ones_work() -> None:
    """On an fx GraphModule, hooks on inlined modules raise; called leaf modules record."""
    traced = torch.fx.symbolic_trace(nn.Sequential(Block(), nn.Linear(2, 1)))
    out, rec = fh.capture(traced, fh.outputs("1"))(torch.ones(1, 2))
    assert torch.equal(rec["1"]["output"], out)
    with pytest.raises(fh.TransformError, match="fx inlined module '0'"):
        fh.capture(traced, fh.outputs("0"))


def test_example_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """examples/per_example_grads.py runs and prints per-example values."""
    runpy.run_path(str(EXAMPLES / "per_example_grads.py"), run_name="__main__")
    assert "per-example gradient norms" in capsys.readouterr().out


@hypothesis.settings(max_examples=10)
@given(st.sampled_from(["vmap", "grad", "eager"]))
def test_no_hooks_left_after_errors(transform: str) -> None:
    """After a capture function raises inside any transform, nothing is left on the model."""
    def boom(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    model = nn.Sequential(nn.Linear(2, 2))
    f = fh.capture(model, fh.observe("0", boom))
    call = {"vmap": torch.func.vmap(f), "grad": torch.func.grad(lambda x: f(x)[0].sum()), "eager": f}[transform]
    with pytest.raises(fh.HookError):
        call(torch.ones(3, 2))
    fh.testing.assert_no_hooks(model)
    assert fh.runs._core.scope.active() == ()
