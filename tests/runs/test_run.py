"""Runs: hooks installed inside the block and always removed, the Run object (run(x), record,
stored, take, paused), and errors raised before anything is attached."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Iterator

import pytest
import torch
from helpers import (
    assert_clean,
    make_model,
    output_mean,
    raise_value_error,
    wrapped_paths,
)
from torch import nn

import funhooks as fh

# -- lifetime ----------------------------------------------------------------------------

ALL_SPECS = [
    fh.outputs("**"),
    fh.inputs("**"),
    fh.grads("**"),
    fh.observe("0", output_mean),
    fh.observe("2", lambda m, gi, go: go[0].sum(), event="backward", name="b"),
    fh.observe("2", lambda m, go: go[0].sum(), event="backward_pre", name="bp"),
    fh.observe(nn.Linear, lambda p, g: g.norm(), event="param_grad", name="pg"),
    fh.edit("1", lambda m, args: None, event="forward_pre"),
]


def test_hooks_removed_after_normal_exit(device: torch.device) -> None:
    """Every kind of spec is installed inside the block and gone after it."""
    model = make_model(device)
    with fh.with_hooks(model, ALL_SPECS) as run:
        model(torch.randn(2, 4, device=device)).sum().backward()
        assert wrapped_paths(model) == ["0", "1", "2"]  # forward-wrapped; backward events ride on the calls
        assert not any(m._backward_hooks or m._backward_pre_hooks for m in model.modules())
    assert_clean(model)
    rec = run.record
    assert list(rec) == ["0", "0.weight", "0.bias", "1", "2", "2.weight", "2.bias"]
    assert set(rec["2"]) == {"output", "input", "grad", "b", "bp"}


def test_hooks_removed_after_exception(device: torch.device) -> None:
    """An exception inside the block propagates unchanged and leaves no hook."""
    model = make_model(device)
    with pytest.raises(RuntimeError, match="mid-run"):
        with fh.with_hooks(model, ALL_SPECS):
            model(torch.randn(2, 4, device=device))
            raise RuntimeError("mid-run")
    assert_clean(model)


def test_hooks_removed_after_keyboard_interrupt() -> None:
    """KeyboardInterrupt (not an Exception) still removes the hooks and is not wrapped."""
    model = make_model()

    def interrupt(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        raise KeyboardInterrupt

    handle = model[1].register_forward_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        with fh.with_hooks(model, ALL_SPECS):
            model(torch.randn(2, 4))
    handle.remove()
    assert_clean(model)


def test_hooks_removed_when_a_generator_is_closed() -> None:
    """A generator holding a run removes the hooks when closed early."""
    model = make_model()

    def batches() -> Iterator[fh.Record]:
        with fh.with_hooks(model, fh.outputs(nn.Linear)) as run:
            while True:
                model(torch.randn(2, 4))
                yield run.take()

    gen = batches()
    first = next(gen)
    assert list(first) == ["0", "2"]
    with pytest.raises(AssertionError):  # installed while the generator is suspended
        fh.testing.assert_no_hooks(model)
    gen.close()
    assert_clean(model)


def test_nested_runs_each_remove_only_their_own() -> None:
    """An inner run's exit leaves the outer run working; the outer's exit cleans all."""
    model = make_model()
    x = torch.randn(2, 4)
    with fh.with_hooks(model, [fh.outputs("0"), fh.observe("2", raise_value_error, event="backward", name="b")]) as outer:
        with fh.with_hooks(model, [fh.outputs("**"), fh.observe("2", output_mean, event="backward", name="b2")]) as inner:
            model(x)
        assert len(model[2].forward.current_users()) == 1  # the inner run left; the outer one stays
        model(x)
    assert_clean(model)
    assert len(inner.record.calls("0", "output")) == 1 and list(inner.record) == ["0", "1", "2"]
    assert len(outer.record.calls("0", "output")) == 2


def test_user_hooks_stay(device: torch.device) -> None:
    """Hooks the user registered before the run are still there, and still fire, after it."""
    model = make_model(device)
    seen: list[str] = []
    forward = model[0].register_forward_hook(lambda m, i, o: seen.append("fwd"))
    backward = model[2].register_full_backward_hook(lambda m, gi, go: seen.append("bwd"))
    with fh.with_hooks(model, ALL_SPECS):
        model(torch.randn(2, 4, device=device)).sum().backward()
    assert seen == ["fwd", "bwd"]
    assert list(model[0]._forward_hooks.values()) and list(model[2]._backward_hooks.values())
    model(torch.randn(2, 4, device=device)).sum().backward()
    assert seen == ["fwd", "bwd", "fwd", "bwd"]
    forward.remove()
    backward.remove()
    fh.testing.assert_no_hooks(model)


def test_old_style_backward_hook_allowed_after_a_backward_run() -> None:
    """A `backward` run leaves no mark: `register_backward_hook` works afterwards."""
    model = make_model()
    with fh.with_hooks(model, fh.observe("2", lambda m, gi, go: go[0].sum(), event="backward", name="b")):
        model(torch.randn(2, 4)).sum().backward()
    assert model[2]._is_full_backward_hook is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the old-style API may be deprecated
        model[2].register_backward_hook(lambda m, gi, go: None).remove()


def test_model_unchanged_after_exit(device: torch.device) -> None:
    """After a run the model pickles, deep-copies and has the same state_dict as before."""
    model = make_model(device).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with fh.with_hooks(model, ALL_SPECS):
        model(torch.randn(2, 4, device=device)).sum().backward()
    model.zero_grad(set_to_none=True)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    clone = pickle.loads(pickle.dumps(model))
    copied = copy.deepcopy(model)
    x = torch.randn(3, 4, device=device)
    assert torch.equal(clone(x), model(x)) and torch.equal(copied(x), model(x))
    fh.testing.assert_no_hooks(clone)
    fh.testing.assert_no_hooks(copied)
    assert model.training


def test_a_run_is_entered_once() -> None:
    """Entering the same Run twice is an error; `with_hooks` again makes a new one."""
    model = make_model()
    run = fh.with_hooks(model, fh.outputs("0"))
    with run:
        pass
    with pytest.raises(RuntimeError) as err:
        with run:
            pass  # pragma: no cover
    assert str(err.value) == "with_hooks: a run is entered once, got a second `with`. Call `with_hooks` again."


def test_run_is_frozen() -> None:
    """A Run cannot be assigned to."""
    run = fh.with_hooks(make_model(), fh.outputs("0"))
    with pytest.raises(fh.FrozenError):
        run.record = None  # type: ignore[misc]


def test_nothing_recorded_outside_the_block(device: torch.device) -> None:
    """Calls after the block store nothing; the record stays what it was."""
    model = make_model(device)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        model(torch.randn(2, 4, device=device))
    model(torch.randn(2, 4, device=device))
    assert len(run.record.calls("0", "output")) == 1


# -- run(x), record, stored, take, paused ------------------------------------------------


def test_run_call_record_and_stored(device: torch.device) -> None:
    """`run(x)` calls the model; `run.record` is valid inside and after; `run.stored` is
    one value per hooked module, in module order."""
    model = make_model(device)
    x = torch.randn(2, 4, device=device)
    with fh.with_hooks(model, fh.outputs(nn.Linear)) as run:
        y = run(x)
        inside = run.record
        assert torch.equal(inside["2"]["output"], y)
    after = run.record
    assert after.equal(inside)
    assert [s.shape for s in run.stored] == [torch.Size([2, 8]), torch.Size([2, 3])]
    assert torch.equal(run.stored[1], y)


def test_record_is_a_snapshot() -> None:
    """A record read inside the block does not grow with later calls."""
    model = make_model()
    with fh.with_hooks(model, fh.outputs("0")) as run:
        model(torch.randn(2, 4))
        first = run.record
        model(torch.randn(2, 4))
    assert len(first.calls("0", "output")) == 1 and len(run.record.calls("0", "output")) == 2


def test_stored_is_the_last_call_and_none_for_modules_that_did_not_run() -> None:
    """fastai's `stored` keeps the last call per module, None where none happened."""
    model = make_model()
    with fh.with_hooks(model, fh.outputs("**")) as run:
        assert run.stored == [None, None, None]
        model(torch.randn(2, 4))
        y = model(torch.randn(2, 4))
    assert torch.equal(run.stored[2], y)


def test_take_returns_per_batch_records() -> None:
    """`take` returns what was stored since the last take."""
    model = make_model()
    with fh.with_hooks(model, fh.outputs("2")) as run:
        ys = [model(torch.randn(2, 4)) for _ in range(2)]
        first = run.take()
        ys.append(model(torch.randn(2, 4)))
        second = run.take()
    assert len(first.calls("2", "output")) == 2 and torch.equal(second["2"]["output"], ys[2])


def test_paused_stores_nothing() -> None:
    """Inside `run.paused()` the run's hooks store nothing."""
    model = make_model()
    with fh.with_hooks(model, fh.outputs("0")) as run:
        with run.paused():
            model(torch.randn(2, 4))
        model(torch.randn(2, 4))
    assert len(run.record.calls("0", "output")) == 1


def test_equal_specs_installed_once() -> None:
    """Passing the same spec twice stores once."""
    model = make_model()
    with fh.with_hooks(model, [fh.outputs("0"), fh.outputs("0")]) as run:
        model(torch.randn(2, 4))
    assert len(run.record.calls("0", "output")) == 1 and len(run.specs) == 1


# -- errors before registration --------------------------------------------------------------


def test_clash_of_record_names_raises_before_registration() -> None:
    """Two specs storing one name on one module: SpecError naming both, nothing registered."""
    model = make_model()
    a, b = fh.observe("0", output_mean), fh.observe(nn.Linear, output_mean, cpu=True)
    with pytest.raises(fh.SpecError) as err:
        fh.with_hooks(model, [a, b])
    assert str(err.value) == (
        "with_hooks: two specs store 'output_mean' on module '0', got observe('0', output_mean) and "
        "observe(Linear, output_mean, cpu=True). Give one of them another `name=`."
    )
    assert_clean(model)


def test_not_a_spec_raises() -> None:
    """Passing something other than specs says what was passed."""
    for bad, shown in (("features", "'features'"), ([fh.outputs("0"), "x"], "'x'"), (3, "3")):
        with pytest.raises(fh.SpecError) as err:
            fh.with_hooks(make_model(), bad)
        assert str(err.value) == (
            f"with_hooks: `specs` is a Spec or an iterable of Specs, got {shown}. "
            "Build specs with fh.outputs, fh.inputs, fh.grads, fh.observe or fh.edit."
        )


def test_not_a_model_raises() -> None:
    """The model must be an nn.Module."""
    with pytest.raises(fh.SpecError) as err:
        fh.with_hooks(lambda x: x, fh.outputs("0"))
    assert str(err.value) == "with_hooks: `model` is an nn.Module, got function. Pass the model to hook."


def test_torchscript_module_raises_transform_error() -> None:
    """Hooks never fire on a scripted module: refused with the fix, before registration."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript is deprecated in torch
        scripted = torch.jit.script(make_model())
    with pytest.raises(fh.TransformError) as err:
        fh.with_hooks(scripted, fh.outputs("0"))
    assert str(err.value) == (
        "with_hooks: hooks on a TorchScript module never fire, got RecursiveScriptModule. "
        "Hook the eager model before scripting it."
    )


def test_selector_errors_leave_the_model_untouched() -> None:
    """A spec list with one bad selector registers none of the good ones."""
    model = make_model()
    with pytest.raises(fh.SelectorError):
        fh.with_hooks(model, [fh.grads("0"), fh.observe("0", output_mean, event="backward"), fh.outputs("nope")])
    assert_clean(model)


@pytest.mark.parametrize(
    ("spec", "event_text"),
    [
        (fh.observe("1", raise_value_error), "observe('1', raise_value_error)"),
        (fh.observe("1", raise_value_error, event="forward_pre"), "observe('1', raise_value_error, event='forward_pre')"),
        (fh.edit("1", raise_value_error), "edit('1', raise_value_error)"),
        (fh.observe("1", raise_value_error, event="backward"), "observe('1', raise_value_error, event='backward')"),
        (fh.observe("1", raise_value_error, event="backward_pre"),
         "observe('1', raise_value_error, event='backward_pre')"),
        (fh.observe("2", raise_value_error, event="param_grad"), "observe('2', raise_value_error, event='param_grad')"),
    ],
)
def test_hook_function_raising_is_a_hook_error_with_path(spec: fh.Spec, event_text: str) -> None:
    """A raising fn becomes HookError naming spec and module, cause kept, hooks removed."""
    model = make_model()
    with pytest.raises(fh.HookError) as err:
        with fh.with_hooks(model, spec):
            model(torch.randn(2, 4)).sum().backward()
    # a parameter hook fires for whichever parameter's gradient is ready first
    path = next(p for p in ("1", "2.weight", "2.bias") if f"on module '{p}'" in str(err.value))
    assert path.startswith("2") == (spec.event == "param_grad")
    assert str(err.value) == (
        f"with_hooks: the function of {event_text} raised ValueError on module '{path}': boom. "
        "Fix the function; the model's hooks were removed."
    )
    assert isinstance(err.value.__cause__, ValueError)
    assert_clean(model)


def test_hook_error_on_the_root_names_the_root() -> None:
    """The root module has the empty path; the message spells it out."""
    model = make_model()
    with pytest.raises(fh.HookError, match=r"on module '' \(the root\): boom"):
        with fh.with_hooks(model, fh.observe("", raise_value_error)):
            model(torch.randn(2, 4))
