"""Runs: the same invariants on the public kit's richer random models (conv, norms, forks,
kwargs), and the wrapped-forward lifecycle (nesting, exits in any order, copies, odd classes)."""

from __future__ import annotations

import copy
import pickle
from collections import Counter

import pytest
import torch
from helpers import (
    FIXTURE_OK,
    assert_clean,
    assert_no_global_hooks,
    deep_model,
    forward_backward,
    wrapped_paths,
)
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

# -- the same invariants on the public kit's richer models (conv, norms, forks, kwargs) -------

KIT_OBSERVERS = (fh.outputs("**", clone=True), fh.inputs("**", clone=True), fh.grads("**"))


@FIXTURE_OK
@given(st.data())
def test_observers_are_transparent_on_kit_models(device: torch.device, data: st.DataObject) -> None:
    """funhooks.testing's random models: outputs and gradients bit-identical under observers."""
    model, x = data.draw(fh.testing.models_and_inputs(device=device))
    plain = forward_backward(model, x)
    with fh.with_hooks(model, KIT_OBSERVERS) as run:
        hooked = forward_backward(model, x)
    assert torch.equal(plain[0], hooked[0]) and torch.equal(plain[1], hooked[1])
    assert all(torch.equal(a, b) for a, b in zip(plain[2], hooked[2]))
    assert len(run.record) >= 1
    assert_clean(model)


@given(fh.testing.models_and_inputs())
def test_call_counts_equal_an_independent_count_on_kit_models(model_x: tuple[nn.Module, torch.Tensor]) -> None:
    """Shared modules, loops and kwargs calls: every call is in the Record, none extra."""
    model, x = model_x
    counts: Counter[str] = Counter()
    handles = [m.register_forward_hook(lambda m, a, o, p=p: counts.update([p])) for p, m in model.named_modules()]
    with fh.with_hooks(model, fh.outputs(["", "**"], clone=True)) as run:
        model(x)
    for h in handles:
        h.remove()
    assert {p: len(run.record.calls(p, "output")) for p in run.record} == dict(counts)


class _Pair(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


class _ChangesItsPairAfter(nn.Module):
    """Calls `_Pair` with a nested tuple, then changes one of its tensors in place."""

    def __init__(self) -> None:
        super().__init__()
        self.pair = _Pair()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pair = (x * 1, x * 2)
        y = self.pair(pair)
        pair[0].relu_()
        return y


def test_in_place_change_of_a_nested_stored_tensor_is_caught(device: torch.device) -> None:
    """Version checks reach tensors nested in stored tuples, for inputs and observers."""
    model = _ChangesItsPairAfter().to(device)
    x = torch.randn(5, device=device)
    with fh.with_hooks(model, fh.inputs("pair")) as run:
        model(x)
    with pytest.raises(fh.StaleTensorError, match="'input' of module 'pair'"):
        run.record
    with fh.with_hooks(model, fh.inputs("pair", clone=True)) as run:
        model(x)
    (args, kwargs), = run.record.calls("pair", "input")
    assert torch.equal(args[0][0], x * 1) and kwargs == {}


def test_an_eager_run_wraps_only_its_modules_forwards_and_registers_no_hook(device: torch.device) -> None:
    """On an eager model a run wraps the forwards of exactly the modules it hooks: no module
    hook, no global hook, so every module keeps PyTorch's hook-free call path."""
    model = deep_model(device)
    with fh.with_hooks(model, [fh.outputs(["2", "8"]), fh.inputs("4")]) as run:
        assert wrapped_paths(model) == ["2", "4", "8"]
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
        assert_no_global_hooks()
        y = model(torch.randn(3, 4, device=device))
    assert list(run.record) == ["2", "4", "8"]
    assert wrapped_paths(model) == []
    assert_clean(model)
    assert y.shape == (3, 4)


def test_records_equal_what_hand_written_hooks_see(device: torch.device) -> None:
    """A run with outputs, inputs, forward and forward-pre editors and an observer on every
    module gives the output and values that hand-registered PyTorch hooks give (editors
    registered first, so the hand hooks also see edited values)."""
    model = deep_model(device)
    x = torch.randn(3, 4, device=device)
    specs = [fh.outputs(["0", "6"]), fh.inputs("4"), fh.edit("2", lambda m, a, o: o * 0.5),
             fh.edit("8", lambda m, a: (a[0] + 1,), event="forward_pre"),
             fh.observe("**", lambda m, a, o: o.sum(), name="total")]
    with fh.with_hooks(model, specs) as run:
        y = model(x)
    seen: dict[str, list] = {}
    handles = [model[2].register_forward_hook(lambda m, a, o: o * 0.5),
               model[8].register_forward_pre_hook(lambda m, a: (a[0] + 1,)),
               model[4].register_forward_pre_hook(lambda m, a: seen.setdefault("4-in", []).append(a[0].clone()))]
    for path, module in model.named_children():
        handles.append(module.register_forward_hook(lambda m, a, o, p=path: seen.setdefault(p, []).append(o.detach().clone())))
    y_hand = model(x)
    for handle in handles:
        handle.remove()
    assert torch.equal(y, y_hand)
    rec = run.record
    assert torch.equal(rec["0"]["output"], seen["0"][0]) and torch.equal(rec["6"]["output"], seen["6"][0])
    assert torch.equal(rec["4"]["input"][0][0], seen["4-in"][0])
    assert all(torch.equal(rec[p]["total"], seen[p][0].sum()) for p in seen if p != "4-in")
    assert_clean(model)


def test_nested_runs_with_different_plans_each_record_the_same_call(device: torch.device) -> None:
    """An outer and an inner run on one module (one wrapper, two users) both see the call."""
    model = deep_model(device)
    with fh.with_hooks(model, fh.outputs("0")) as outer:
        with fh.with_hooks(model, fh.outputs("**")) as inner:
            model(torch.randn(2, 4, device=device))
    assert len(outer.record.calls("0", "output")) == 1
    assert len(inner.record) == 12
    assert torch.equal(outer.record["0"]["output"], inner.record["0"]["output"])
    assert_clean(model)


def test_runs_sharing_a_module_exit_in_any_order(device: torch.device) -> None:
    """Two runs wrapping one module: the first to exit leaves the other recording, and the
    last one restores the module."""
    model = deep_model(device)
    x = torch.randn(2, 4, device=device)
    first = fh.with_hooks(model, fh.outputs("0"))
    second = fh.with_hooks(model, [fh.outputs("0"), fh.outputs("2")])
    first.__enter__()
    second.__enter__()
    model(x)
    first.__exit__(None, None, None)  # not the innermost
    model(x)
    assert wrapped_paths(model) == ["0", "2"]
    second.__exit__(None, None, None)
    model(x)
    assert len(first.record.calls("0", "output")) == 1
    assert len(second.record.calls("0", "output")) == 2
    assert len(second.record.calls("2", "output")) == 2
    assert_clean(model)


def test_a_wrapped_forward_is_removed_after_an_exception(device: torch.device) -> None:
    """Wrapped forwards go on every exit."""
    model = deep_model(device)
    with pytest.raises(KeyError):
        with fh.with_hooks(model, fh.outputs("4")):
            model(torch.randn(2, 4, device=device))
            raise KeyError("mid-run")
    assert_clean(model)
    assert wrapped_paths(model) == []


def test_a_forward_set_on_the_instance_before_the_run_is_kept(device: torch.device) -> None:
    """A ``forward`` the user (or a library like accelerate) set on the instance runs inside
    the block and is the very same object after it."""
    model = deep_model(device)
    layer = model[0]
    plain = layer.forward

    def doubled(x: torch.Tensor) -> torch.Tensor:
        return plain(x) * 2

    layer.forward = doubled
    x = torch.randn(2, 4, device=device)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        model(x)
    assert torch.equal(run.record["0"]["output"], plain(x) * 2)
    assert layer.__dict__["forward"] is doubled
    del layer.forward
    assert_clean(model)


def test_a_forward_replaced_inside_the_block_stays(device: torch.device) -> None:
    """A forward the user sets on top of funhooks' inside the block is theirs after it:
    it still runs, and funhooks' wrapper under it records nothing any more."""
    model = deep_model(device)
    layer = model[0]
    x = torch.randn(2, 4, device=device)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        inner = layer.forward
        layer.forward = lambda t: inner(t) + 1
        model(x)
    kept = layer.forward
    with fh.with_hooks(model, fh.outputs("0")) as again:
        y = model(x)
    assert len(run.record.calls("0", "output")) == 1
    assert len(again.record.calls("0", "output")) == 1
    assert layer.forward is kept
    assert torch.equal(y, model(x))
    del layer.forward
    assert_clean(model)


def test_a_model_copied_or_pickled_inside_the_block_is_plain(device: torch.device) -> None:
    """``copy.deepcopy`` and pickling inside a block give models that compute the same and
    record nothing; the run records only its own model."""
    model = deep_model(device)
    x = torch.randn(2, 4, device=device)
    with fh.with_hooks(model, fh.outputs(["", "0"])) as run:
        twin = copy.deepcopy(model)
        loaded = pickle.loads(pickle.dumps(model))
        assert "forward" not in twin[0].__dict__ and "__reduce_ex__" not in twin[0].__dict__
        assert "forward" not in loaded[0].__dict__
        y = model(x)
        assert torch.equal(twin(x), y)
        assert torch.equal(loaded(x), y)
    assert len(run.record.calls("0", "output")) == 1
    assert torch.equal(twin[0](x), model[0](x))
    assert_clean(model)


def test_a_wrapped_forward_keeps_its_signature(device: torch.device) -> None:
    """Code that inspects ``module.forward`` (signature, name) sees the module's own."""
    import inspect

    model = deep_model(device)
    before = inspect.signature(model[0].forward)
    with fh.with_hooks(model, fh.outputs("0")):
        assert inspect.signature(model[0].forward) == before
        assert model[0].forward.__name__ == "forward"
        assert model[0].forward.__self__ is model[0]


class _PropertyForward(nn.Module):
    """A module whose ``forward`` is a property: an instance attribute cannot replace it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @property
    def forward(self):  # noqa: ANN201 - the odd pattern under test
        return self.lin.forward


def test_a_module_whose_forward_is_a_property_is_wrapped_through_call_impl(device: torch.device) -> None:
    """Where ``forward`` is a property (an instance attribute cannot replace it), the run
    wraps the module's ``_call_impl`` instead, and records the same."""
    model = nn.Sequential(_PropertyForward(), nn.ReLU()).to(device)
    x = torch.randn(2, 4, device=device)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        assert "_call_impl" in model[0].__dict__
        y = model(x)
    assert torch.equal(run.record["0"]["output"], model[0](x))
    assert y.shape == (2, 4)
    assert "_call_impl" not in model[0].__dict__
    assert_clean(model)


def test_a_data_parallel_model_on_one_device_records(device: torch.device) -> None:
    """DataParallel on one device (or the CPU) calls the module itself: runs record through it."""
    model = deep_model(device)
    x = torch.randn(2, 4, device=device)
    for wrapped in (nn.DataParallel(model), nn.Sequential(nn.DataParallel(model))):
        with fh.with_hooks(wrapped, fh.outputs(model[0])) as run:
            y = wrapped(x)
        assert torch.equal(run.record.stored()[0], model[0](x))
        assert torch.equal(y, model(x))
        assert_clean(model)


def test_data_parallel_over_several_devices_is_refused() -> None:
    """DataParallel over several devices runs replicas (new module objects no run sees): the
    run refuses it up front instead of recording nothing."""
    model = deep_model("cpu")
    wrapped = nn.DataParallel(model)
    wrapped.device_ids = [0, 1]  # what DataParallel holds on a machine with two GPUs
    with pytest.raises(fh.TransformError, match=r"`nn.DataParallel` runs replicas.*devices \[0, 1\]"):
        fh.with_hooks(wrapped, fh.outputs("0"))
    assert_clean(model)


@given(fh.testing.models_and_inputs(), st.permutations(range(3)), st.permutations(range(3)))
def test_runs_entered_and_exited_in_any_order_each_see_their_calls(
    model_x: tuple[nn.Module, torch.Tensor], enter_order: list[int], exit_order: list[int]
) -> None:
    """Three runs over overlapping modules, entered and exited in random orders with a model
    call after each step: each run records exactly the calls made while it was open, and
    the model ends exactly as it began."""
    model, x = model_x
    model.eval()
    before = {p: dict(m.__dict__) for p, m in model.named_modules()}
    counts: Counter[str] = Counter()
    handles = [m.register_forward_hook(lambda m, a, o, p=p: counts.update([p])) for p, m in model.named_modules()]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    selectors = [["", "**"], "", ["", "**"]]  # the first and last share one plan
    runs = [fh.with_hooks(model, fh.outputs(sel, clone=True)) for sel in selectors]
    open_calls = [0, 0, 0]
    with torch.no_grad():
        for i in enter_order:
            runs[i].__enter__()
            model(x)
            for j, run in enumerate(runs):
                open_calls[j] += repr(run).endswith(", open)")
        for i in exit_order:
            runs[i].__exit__(None, None, None)
            model(x)
            for j, run in enumerate(runs):
                open_calls[j] += repr(run).endswith(", open)")
    for run, calls in zip(runs, open_calls):
        for path in run.record:
            assert len(run.record.calls(path, "output")) == calls * counts[path]
    assert {p: dict(m.__dict__) for p, m in model.named_modules()} == before
    assert_clean(model)


class _Unreadable:
    """A `forward` that raises when looked up (a broken module class)."""

    def __get__(self, obj: object, owner: type | None = None) -> object:
        if obj is None:
            return self
        raise RuntimeError("forward is not readable")


class _BrokenForward(nn.Module):
    forward = _Unreadable()


def test_a_run_that_fails_while_wrapping_leaves_no_module_wrapped() -> None:
    """Wrapping stops at a module whose forward cannot be read: the error propagates and the
    forwards already wrapped are restored."""
    model = nn.Sequential(nn.Linear(2, 2), _BrokenForward())
    with pytest.raises(RuntimeError, match="forward is not readable"):
        with fh.with_hooks(model, fh.outputs("**")):
            pass  # never reached
    assert wrapped_paths(model) == []
    assert_clean(model)
