"""Specs: constructors, validation messages, and specs as plain values (frozen, hashable,
picklable, touching no model)."""

from __future__ import annotations

import copy
import functools
import pickle

import attrs
import pytest
import torch
from torch import nn

import funhooks as fh


def mean(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A module-level hook function, so specs using it pickle."""
    return output.mean()


def shape(module: nn.Module, args: tuple, output: torch.Tensor) -> tuple[int, ...]:
    return tuple(output.shape)


def make_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


# -- constructors ----------------------------------------------------------------------


def test_outputs_stores_under_output_on_forward() -> None:
    """`outputs` is a forward observer named "output" with the default flags."""
    spec = fh.outputs("0")
    assert (spec.event, spec.name, spec.is_edit) == ("forward", "output", False)
    assert (spec.detach, spec.cpu, spec.gather, spec.clone) == (True, False, False, False)


def test_inputs_grads_names_and_events() -> None:
    """`inputs` is named "input" (taken before the module runs), `grads` is named "grad"."""
    assert (fh.inputs("0").name, fh.inputs("0").event) == ("input", "forward_pre")
    assert fh.grads("0").name == "grad"


def test_observe_name_defaults_to_fn_name() -> None:
    """`observe` stores under `fn.__name__` unless `name=` is given."""
    assert fh.observe("0", mean).name == "mean"
    assert fh.observe("0", mean, name="avg").name == "avg"


def test_observe_of_a_callable_without_name_needs_name() -> None:
    """A partial has no `__name__`: the message says to pass `name=`; with it, it works."""
    fn = functools.partial(shape)
    with pytest.raises(fh.SpecError) as err:
        fh.observe("0", fn)
    assert str(err.value) == (
        f"observe: the record name defaults to `fn.__name__`, got {fn!r} which has none. Pass `name=`."
    )
    assert fh.observe("0", fn, name="shape").name == "shape"


def test_edit_is_an_editor_with_flags_off() -> None:
    """`edit` replaces values; it stores nothing, so it has no record name by default."""
    spec = fh.edit("0", mean, event="forward_pre")
    assert spec.is_edit and spec.name is None and spec.event == "forward_pre"


@pytest.mark.parametrize("event", fh.EVENTS)
def test_every_event_is_accepted(event: str) -> None:
    """Each of the five events builds an observer and an editor."""
    assert fh.observe("0", mean, event=event).event == event
    assert fh.edit("0", mean, event=event).event == event


def test_fastai_spellings_map_to_events_and_names() -> None:
    """Hook/Hooks call the function forward or backward; hook_output(grad=True) stores
    fastai's grad_output tuple under "grad"."""
    lin = nn.Linear(2, 2)
    assert fh.Hook(lin, mean).event == "forward"
    assert fh.Hook(lin, mean, is_forward=False).event == "backward"
    assert fh.Hooks([lin], mean, is_forward=False).event == "backward"
    assert (fh.hook_output(lin).name, fh.hook_output(lin).event) == ("output", "forward")
    assert fh.hook_output(lin, grad=True).name == "grad"
    assert fh.hook_outputs([lin], grad=True).name == "grad"


def test_fastai_hook_takes_any_callable() -> None:
    """fastai's Hook accepts a partial; its record name falls back to "stored"."""
    spec = fh.Hook(nn.Linear(2, 2), functools.partial(shape))
    assert spec.name == "stored"


def test_hooks_of_a_sequential_means_its_children() -> None:
    """fastai iterates `ms`: Hooks(sequential, f) hooks each child."""
    model = make_model()
    with fh.with_hooks(model, fh.Hooks(model, shape)) as run:
        model(torch.randn(5, 4))
    assert run.stored == [(5, 3), (5, 3), (5, 2)]


# -- validation: exact messages ----------------------------------------------------------

BAD_SPECS = [
    (lambda: fh.outputs("0", detach=1), "outputs: `detach` is a bool, got 1. Pass True or False."),
    (lambda: fh.inputs("0", clone="yes"), "inputs: `clone` is a bool, got 'yes'. Pass True or False."),
    (lambda: fh.grads("0", cpu=None), "grads: `cpu` is a bool, got None. Pass True or False."),
    (
        lambda: fh.observe("0", 3),
        "observe: `fn` is a callable taking PyTorch's hook arguments, got 3. "
        "Pass a function such as `lambda module, args, output: output.mean()`.",
    ),
    (
        lambda: fh.edit("0", "relu"),
        "edit: `fn` is a callable taking PyTorch's hook arguments, got 'relu'. "
        "Pass a function such as `lambda module, args, output: output.mean()`.",
    ),
    (
        lambda: fh.observe("0", mean, event="fwd"),
        "observe: `event` is one of ['forward_pre', 'forward', 'backward_pre', 'backward', "
        "'param_grad'], got 'fwd'. Pick one of those.",
    ),
    (
        lambda: fh.edit("0", mean, event="backward_hook"),
        "edit: `event` is one of ['forward_pre', 'forward', 'backward_pre', 'backward', "
        "'param_grad'], got 'backward_hook'. Pick one of those.",
    ),
    (lambda: fh.observe("0", mean, name=""), "observe: `name` is a non-empty str, got ''. Pass a record name."),
    (lambda: fh.edit("0", mean, name=3), "edit: `name` is a non-empty str or None, got 3. Pass a label."),
    (lambda: fh.Hook("0", mean), "Hook: `m` is an nn.Module, got str. Pass the module to hook."),
    (
        lambda: fh.Hook(nn.Linear(1, 1), None),
        "Hook: `hook_func` is a callable taking PyTorch's hook arguments, got None. "
        "Pass a function such as `lambda module, args, output: output.mean()`.",
    ),
    (lambda: fh.Hook(nn.Linear(1, 1), mean, is_forward=0), "Hook: `is_forward` is a bool, got 0. Pass True or False."),
    (
        lambda: fh.Hooks(nn.Linear(1, 1), mean),
        "Hooks: `ms` is an iterable of modules (a list, Sequential or ModuleList), got Linear. "
        "Pass a list of the modules to hook.",
    ),
    (
        lambda: fh.hook_output([nn.Linear(1, 1)]),
        "hook_output: `module` is an nn.Module, got list. Pass the module to hook.",
    ),
    (lambda: fh.hook_output(nn.Linear(1, 1), grad=1), "hook_output: `grad` is a bool, got 1. Pass True or False."),
    (
        lambda: fh.hook_outputs([]),
        "hook_outputs: `modules` is an iterable of modules (a list, Sequential or ModuleList), got list. "
        "Pass a list of the modules to hook.",
    ),
    (
        lambda: fh.hook_outputs([nn.Linear(1, 1), "fc"]),
        "hook_outputs: `modules` is an iterable of modules (a list, Sequential or ModuleList), got list. "
        "Pass a list of the modules to hook.",
    ),
]


@pytest.mark.parametrize(("build", "message"), BAD_SPECS)
def test_bad_spec_arguments_raise_spec_error_with_exact_message(build, message: str) -> None:
    """Each bad constructor argument raises SpecError (a ValueError) with the house message."""
    with pytest.raises(fh.SpecError) as err:
        build()
    assert str(err.value) == message
    assert isinstance(err.value, ValueError)


def test_bad_selector_in_a_constructor_raises_selector_error() -> None:
    """Selectors are validated when the spec is built, not when it runs."""
    with pytest.raises(fh.SelectorError):
        fh.outputs(3.5)
    with pytest.raises(fh.SelectorError):
        fh.observe("a..b", mean)


@pytest.mark.parametrize(
    "spec",
    [fh.hook_output(nn.Linear(2, 2)), fh.hook_outputs([nn.Linear(2, 2)]), fh.Hook(nn.Linear(2, 2), mean)],
    ids=["hook_output", "hook_outputs", "Hook"],
)
def test_with_spec_directly_raises_type_error_saying_how_to_run_it(spec: fh.Spec) -> None:
    """`with fh.hook_output(m):` is fastai's habit: a clear TypeError tells how to run it."""
    with pytest.raises(TypeError) as err:
        with spec:
            pass  # pragma: no cover
    assert str(err.value) == (
        f"{spec.label}: a spec is a value and touches no model, got `with {spec!r}:`. "
        "Run it with `with fh.with_hooks(model, spec) as run:` and read `run.stored` or `run.record`."
    )


# -- specs are values ----------------------------------------------------------------------

VALUE_SPECS = [
    lambda: fh.outputs("features.*", clone=True),
    lambda: fh.inputs([nn.Linear, "head.**"], cpu=True),
    lambda: fh.grads((nn.Linear, nn.Conv2d)),
    lambda: fh.observe(fh.select(nn.Linear) & ~fh.select("head.**"), mean, event="forward"),
    lambda: fh.edit("0", shape, event="forward_pre", name="fix"),
    lambda: fh.observe("", mean, event="param_grad", name="p"),
]


@pytest.mark.parametrize("build", VALUE_SPECS)
def test_specs_equal_when_built_equal_and_hash_equal(build) -> None:
    """Two specs built from the same arguments are equal, hash equal and dedupe in a set."""
    a, b = build(), build()
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1


def test_specs_differ_when_arguments_differ() -> None:
    """A different flag, selector, name or function gives a different spec."""
    base = fh.outputs("0")
    assert base != fh.outputs("0", clone=True)
    assert base != fh.outputs("1")
    assert fh.observe("0", mean) != fh.observe("0", shape)
    assert fh.observe("0", mean) != fh.observe("0", mean, name="m")
    assert fh.hook_output(nn.Linear(1, 1)) != fh.hook_output(nn.Linear(1, 1))  # different instances


@pytest.mark.parametrize("build", VALUE_SPECS)
def test_specs_are_frozen(build) -> None:
    """Assigning to a spec field raises; `attrs.evolve` makes a changed copy."""
    spec = build()
    with pytest.raises(fh.FrozenError):
        spec.clone = True  # type: ignore[misc]
    changed = attrs.evolve(spec, cpu=not spec.cpu)
    assert changed != spec and changed.cpu != spec.cpu


def test_evolve_normalises_the_selector_and_checks_the_event() -> None:
    """`attrs.evolve(spec, where=...)` takes any selector form; a bad event is still refused."""
    spec = fh.outputs("a")
    assert attrs.evolve(spec, where="b.*") == fh.outputs("b.*")
    assert attrs.evolve(spec, where=[nn.Linear]) == fh.outputs([nn.Linear])
    with pytest.raises(fh.SpecError) as err:
        attrs.evolve(spec, event="nope")
    assert str(err.value) == (
        "outputs: `event` is one of ['forward_pre', 'forward', 'backward_pre', 'backward', 'param_grad'], "
        "got 'nope'. Pick one of those."
    )


@pytest.mark.parametrize("build", VALUE_SPECS)
def test_specs_with_module_level_functions_pickle(build) -> None:
    """Specs of module-level functions round-trip through pickle and deepcopy, equal."""
    spec = build()
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert copy.deepcopy(spec) == spec


def test_spec_with_an_instance_pickles_with_its_module() -> None:
    """A spec holding a module instance pickles (it carries a copy of the module)."""
    spec = fh.hook_output(nn.Linear(2, 2))
    back = pickle.loads(pickle.dumps(spec))
    assert isinstance(back.where.value, nn.Linear)


def test_building_specs_touches_no_model() -> None:
    """Building every kind of spec on a model's modules leaves no hook and no state change."""
    model = make_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    specs = [
        fh.Hook(model[0], mean),
        fh.Hook(model[0], mean, is_forward=False),
        fh.Hooks(model, mean),
        fh.hook_output(model[2], grad=True),
        fh.hook_outputs(model),
        fh.outputs(model[0]),
        fh.edit(model[1], shape, event="param_grad"),
    ]
    assert len(specs) == len(set(specs))
    fh.testing.assert_no_hooks(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(getattr(m, "_is_full_backward_hook", None) is None for m in model.modules())


def test_repr_reads_like_the_constructor_call() -> None:
    """A spec's repr is the call that builds it, with non-default options only."""
    assert repr(fh.outputs("features.*", clone=True)) == "outputs('features.*', clone=True)"
    assert repr(fh.observe("a", mean, event="backward", name="g", cpu=True)) == (
        "observe('a', mean, event='backward', name='g', cpu=True)"
    )
    assert repr(fh.inputs(["a", nn.Linear])) == "inputs(['a', Linear])"
    assert repr(fh.grads((nn.Linear, nn.Conv2d))) == "grads((Linear, Conv2d))"
    assert repr(fh.edit("a", mean)) == "edit('a', mean)"
    assert repr(fh.hook_output(nn.Linear(1, 1), grad=True)) == "hook_output(<Linear instance>, grad=True)"


def test_a_param_grad_spec_on_modules_without_parameters_is_refused() -> None:
    """`param_grad` watches the selected modules' own parameters: a selection holding none
    would record nothing silently, so the run refuses it, naming the spec and the fix."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 1)))
    spec = fh.observe([nn.ReLU, "2"], lambda param, grad: grad.norm(), event="param_grad", name="norm")
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(model, spec)
    assert str(err.value) == (
        "with_hooks: a `param_grad` spec watches the own parameters of the modules it selects, got none in ['1', "
        "'2'] for observe([ReLU, '2'], <lambda>, event='param_grad', name='norm'). Select modules that hold "
        "parameters themselves: a container's belong to its children."
    )
    fh.testing.assert_no_hooks(model)
    with fh.with_hooks(model, fh.observe("**", lambda p, g: g.norm(), event="param_grad", name="n")) as run:
        model(torch.ones(1, 2)).sum().backward()
    assert list(run.record) == ["0.weight", "0.bias", "2.0.weight", "2.0.bias"]  # some hold some: fine
