"""The property-testing kit tests itself: check_invariant, assert_transparent, assert_no_hooks, the strategies."""

import operator

import hypothesis
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funhooks as fh
from funhooks.testing import (
    assert_no_hooks,
    assert_transparent,
    check_invariant,
    models_and_inputs,
    specs,
)

# The `device` fixture is function scoped but returns an immutable torch.device.

OVERFLOW_AT = 89  # the smallest integer n with exp(float32(n)) == inf


class Exp(nn.Module):
    """A deliberately broken layer: its activations overflow for inputs of 89 and more."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x)


def finite(path: str, name: str, value: torch.Tensor) -> bool:
    return bool(value.isfinite().all())


def _draw_pair(data, **kwargs):
    """A drawn model and an input that needs grad (so even parameter-free models backprop)."""
    model, x = data.draw(models_and_inputs(**kwargs))
    return model, x.requires_grad_(True)


# -- the kit tests itself ------------------------------------------------------------------


def test_check_invariant_shrinks_a_broken_model_and_names_its_module(device):
    """A model whose activations blow up to inf is caught, shrunk to the smallest bad input,
    and the message names the module path."""
    model = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), Exp())).to(device)
    inputs = st.integers(0, 10_000).map(lambda n: torch.full((2,), float(n), device=device))
    with pytest.raises(AssertionError) as info:
        check_invariant(model, finite, inputs, settings=hypothesis.settings(max_examples=200, deadline=None, database=None))
    message = str(info.value)
    first = message.splitlines()[0]
    assert first == (
        "check_invariant: `predicate` must hold for every stored tensor, got False for the 'output' of "
        "module '1.1', call 1 of 1. Fix the model or the invariant."
    )
    assert f"tensor([{OVERFLOW_AT}., {OVERFLOW_AT}.]" in message


def test_check_invariant_passes_when_the_invariant_holds(device):
    """A bounded model satisfies "activations stay finite" on every drawn input."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(device)
    check_invariant(model, finite, fh.testing.tensors((2, 3), min_value=-1e30, max_value=1e30, device=device))
    assert_no_hooks(model)


def test_check_invariant_reports_the_call_and_tensor_of_a_shared_module():
    """A predicate failing on the second call of a module used twice names that call."""
    layer = nn.Linear(1, 1)
    with torch.no_grad():
        layer.weight.fill_(2.0)
        layer.bias.zero_()
    model = nn.Sequential(layer, layer)
    small = lambda path, name, out: bool((out.abs() < 3).all())  # noqa: E731
    with pytest.raises(AssertionError, match=r"module '0', call 2 of 2\. .*") as info:
        check_invariant(model, small, st.just(torch.ones(1, 1)))
    assert "input: tensor([[1.]])" in str(info.value)


def test_check_invariant_runs_backward_for_grad_specs():
    """With a `grads` spec the model runs backward and the predicate sees the gradients."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    seen = []

    def record_names(path: str, name: str, value: torch.Tensor) -> bool:
        seen.append(name)
        return True

    check_invariant(model, record_names, fh.testing.tensors((1, 2)), specs=[fh.grads("0"), fh.outputs("0")])
    assert set(seen) == {"grad", "output"}


def test_check_invariant_takes_a_predicate_over_the_whole_record(device):
    """A one-argument predicate sees the Record: a relation across modules holds; a failing
    one names the innermost module whose record alone makes it false."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Identity(), Exp())).to(device)
    inputs = st.integers(0, 200).map(lambda n: torch.full((1, 2), float(n), device=device))
    same_shapes = lambda rec: rec["1"]["output"].shape == rec["0"]["output"].shape  # noqa: E731
    check_invariant(model, same_shapes, inputs)
    all_finite = lambda rec: all(bool(t.isfinite().all()) for t in rec.tensors())  # noqa: E731
    unbounded = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), Exp())).to(device)
    with pytest.raises(AssertionError) as info:
        check_invariant(unbounded, all_finite, inputs, settings=hypothesis.settings(deadline=None, database=None))
    assert str(info.value).splitlines() == [
        (
            "check_invariant: `predicate` must hold for the Record, got False for the record of module '1.1' "
            "alone. Fix the model or the invariant."
        ),
        f"input: {torch.full((1, 2), float(OVERFLOW_AT), device=device)!r}",
    ]
    assert_no_hooks(unbounded)


def test_check_invariant_blames_the_whole_record_for_a_relation_across_modules():
    """A relation that no single module's record breaks is reported for the whole Record."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.copy_(torch.tensor([1.0, -1.0]))
    grows = lambda rec: bool(rec["1"]["output"].sum() >= rec["0"]["output"].abs().sum())  # noqa: E731
    with pytest.raises(AssertionError) as info:
        check_invariant(model, grows, st.just(torch.zeros(1, 2)))
    assert str(info.value).splitlines()[0] == (
        "check_invariant: `predicate` must hold for the Record, got False for the whole Record (no module's "
        "record alone makes it false). Fix the model or the invariant."
    )


def test_check_invariant_rejects_a_non_callable_predicate():
    """A predicate that is not callable is a SpecError with the rule and a fix."""
    with pytest.raises(fh.SpecError) as info:
        check_invariant(nn.Linear(1, 1), "finite", st.just(torch.ones(1, 1)))
    assert str(info.value) == (
        "check_invariant: `predicate` is a callable `(path, name, tensor) -> bool` or `(record) -> bool`, got 'finite'. "
        "Pass a function such as `lambda path, name, out: bool(out.isfinite().all())`."
    )


def test_assert_transparent_catches_an_observer_that_writes_in_place():
    """An observer that modifies the output in place is reported as changing the output."""

    def double(module, args, output):
        return output.mul_(2)

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    with pytest.raises(AssertionError, match=r"^assert_transparent: observers must change no output, got output 0 changed"):
        assert_transparent(model, fh.observe("0", double, detach=False), torch.ones(3, 2))
    assert_no_hooks(model)


def test_assert_transparent_rejects_editors():
    """Editors change values by design: passing one is a SpecError."""
    spec = fh.edit("0", lambda module, args, output: output)
    with pytest.raises(fh.SpecError, match=r"^assert_transparent: `specs` are observers, got the editor edit\('0'"):
        assert_transparent(nn.Sequential(nn.Linear(1, 1)), spec, torch.ones(1, 1))


def test_assert_transparent_leaves_gradients_and_state_as_they_were():
    """The check restores parameters' `.grad` and BatchNorm statistics."""
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    model(torch.randn(4, 2)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert_transparent(model, fh.outputs("**"), torch.randn(4, 2))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_assert_no_hooks_names_a_leftover_module_hook():
    """A hook left on a submodule fails with the path and the hook dict."""
    model = nn.Sequential(nn.Linear(1, 1), nn.Sequential(nn.ReLU()))
    handle = model[1][0].register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(AssertionError, match=r"^assert_no_hooks: module '1\.0' has 1 hook\(s\) in `_forward_hooks`"):
            assert_no_hooks(model)
    finally:
        handle.remove()
    assert_no_hooks(model)


def test_assert_no_hooks_names_a_leftover_parameter_hook():
    """A gradient hook left on a parameter fails with the parameter and module."""
    model = nn.Sequential(nn.Linear(1, 1))
    handle = model[0].bias.register_hook(lambda g: g)
    try:
        with pytest.raises(AssertionError, match=(
            r"^assert_no_hooks: tensor 'bias' of module '0' has 1 hook\(s\) in `_backward_hooks` installed by "
            r"\['test_testing\.test_assert_no_hooks_names_a_leftover_parameter_hook\.<locals>\.<lambda>'\], "
            r"not by funhooks, got .*Remove them, or pass `funhooks_only=True`")):
            assert_no_hooks(model)
        assert_no_hooks(model, funhooks_only=True)
    finally:
        handle.remove()


def test_assert_no_hooks_names_a_wrapped_forward():
    """Inside a `with_hooks` block the run has wrapped the hooked module's forward."""
    model = nn.Sequential(nn.Linear(1, 1))
    with fh.with_hooks(model, fh.outputs("0")):
        with pytest.raises(AssertionError) as info:
            assert_no_hooks(model)
    assert str(info.value) == (
        "assert_no_hooks: module '0' still has its `forward` wrapped by funhooks, got <funhooks-wrapped "
        f"{model[0].forward!r}> with 1 active run(s). Exit every `with_hooks` block and close every "
        "`train`/`evaluate` generator."
    )
    assert_no_hooks(model)


def test_assert_no_hooks_tells_funhooks_leftovers_from_other_libraries_hooks():
    """A run left open (never exited) is funhooks': named so, even with `funhooks_only`; a
    hook another library keeps on purpose (HF installs output-capturing forward hooks) is
    named by its owner, and `funhooks_only=True` ignores it."""
    model = nn.Sequential(nn.Linear(1, 1))
    run = fh.with_hooks(model, fh.observe(nn.Linear, lambda p, g: g.sum(), event="param_grad", name="g"))
    run.__enter__()
    try:
        with pytest.raises(AssertionError, match=(
                r"^assert_no_hooks: tensor 'weight' of module '0' has 1 funhooks hook\(s\) in `_backward_hooks`, "
                r"got \[<function .*>\]\. Exit every `with_hooks` block and close every `train`/`evaluate` generator\.$")):
            assert_no_hooks(model, funhooks_only=True)
    finally:
        run.__exit__(None, None, None)
    handle = model[0].register_forward_hook(operator.truediv)  # any library's function
    try:
        with pytest.raises(AssertionError, match=r"installed by \['_operator\.truediv'\], not by funhooks"):
            assert_no_hooks(model)
        assert_no_hooks(model, funhooks_only=True)
    finally:
        handle.remove()
    assert_no_hooks(model)


@given(models_and_inputs())
def test_drawn_models_run_forward_and_backward(pair):
    """Every drawn model accepts its input, returns a float batch and backpropagates."""
    model, x = pair
    x = x.clone().requires_grad_(True)
    y = model(x)
    assert y.shape[0] == x.shape[0] and y.is_floating_point()
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


FEATURES = {
    "in-place activation": lambda m: getattr(m, "inplace", False),
    "tuple output": lambda m: type(m).__name__ == "_Fork",
    "keyword argument": lambda m: type(m).__name__ == "_Scale",
    "convolution": lambda m: isinstance(m, nn.Conv2d),
    "norm": lambda m: isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)),
    "module list": lambda m: isinstance(m, nn.ModuleList),
}


def test_drawn_models_cover_every_feature():
    """Within a hundred draws the strategy reaches in-place activations, a shared module,
    tuple outputs, keyword arguments, convolutions, norms and module lists."""
    seen = set()

    @hypothesis.settings(max_examples=100, database=None, derandomize=True, deadline=None)
    @given(models_and_inputs())
    def collect(pair):
        mods = list(pair[0].named_modules(remove_duplicate=False))
        seen.update(f for f, test in FEATURES.items() if any(test(m) for _, m in mods))
        if len(mods) > len({id(m) for _, m in mods}):
            seen.add("shared module")

    collect()
    assert seen == {*FEATURES, "shared module"}


@given(st.data())
def test_drawn_specs_are_accepted_by_with_hooks(data):
    """Every drawn spec tuple resolves on its model, and the run leaves no hook."""
    model, x = _draw_pair(data)
    drawn = data.draw(specs(model, clone=True))
    with fh.with_hooks(model, drawn) as run:
        model(x).sum().backward()
    run.record  # noqa: B018 - reading it checks nothing went stale
    assert_no_hooks(model)
