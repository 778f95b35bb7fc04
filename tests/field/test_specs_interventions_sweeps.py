"""Interventions tried as real sweeps use them (issue 26): positions and module indices out of
range, per-call values of the wrong kind, complex values into real outputs and `element` on a
tensor output are refused with one line naming the spec, the module and the value, instead of
editing nothing (or the wrong thing) silently; under `vmap` sweeps keep working."""

from __future__ import annotations

from typing import Any

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from torch import nn

import funhooks as fh

X = torch.randn(2, 4)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))


def _raises(model: nn.Module, call: Any, message: str, error: type = fh.InterventionError) -> None:
    with torch.no_grad():
        before = model(X)
        with pytest.raises(error) as err:
            call()
        assert str(err.value) == message
        assert torch.equal(model(X), before)
    fh.testing.assert_no_hooks(model)


def _at(got: str, spec: str) -> str:
    return (f"capture: `index` is a position along dim 1 (size 6), got {got}, at module '0' for {spec}. "
            "Pass an index in [-6, 6).")


@pytest.mark.parametrize(("index", "got", "shown"), [
    ([7], "7", "[7]"),
    ([1, -7], "-7", "[1, -7]"),
    (torch.tensor(7), "7", "<Tensor of shape ()>"),
    (torch.tensor(-9), "-9", "<Tensor of shape ()>"),
    (torch.tensor([0, 6]), "6", "<Tensor of shape (2,)>"),
])
def test_an_index_past_the_positions_raises_whatever_its_kind(index: Any, got: str, shown: str) -> None:
    """A list or a tensor `index` with a position outside `dim` is refused like an int one,
    naming the axis size and the value; it used to patch nothing."""
    model = _mlp()
    spec = fh.scale("0", 2.0, index=index)
    _raises(model, lambda: fh.capture(model, spec)(X), _at(got, f"scale('0', 2.0, index={shown})"))


@pytest.mark.parametrize("index", [7, [7], torch.tensor(7), torch.tensor(-9)])
def test_a_per_call_index_past_the_positions_raises(index: Any) -> None:
    """The same values given per call through `fh.arg`."""
    model = _mlp()
    f = fh.capture(model, fh.scale("0", 2.0, index=fh.arg("pos")))
    got = str(int(torch.as_tensor(index).reshape(-1)[0]))
    _raises(model, lambda: f(X, pos=index), _at(got, "scale('0', 2.0, index=fh.arg('pos'))"))


@pytest.mark.parametrize(("index", "shown"), [
    (1.0, "1.0"), ([1.5], "[1.5]"), (torch.tensor(1.0), "<Tensor of shape ()>"),
    (torch.tensor([0.0, 2.0]), "<Tensor of shape (2,)>"),
])
def test_a_float_index_is_refused(index: Any, shown: str) -> None:
    """Positions are integers: a float index (which matched a position only by equality)
    is refused."""
    model = _mlp()
    f = fh.capture(model, fh.scale("0", 2.0, index=fh.arg("pos")))
    _raises(model, lambda: f(X, pos=index), (
        f"capture: `index` is an int, ints, a bool mask or an integer tensor, got {shown}, at "
        "module '0' for scale('0', 2.0, index=fh.arg('pos')). Pass integer positions along dim 1."
    ))
    spec = fh.scale("0", 2.0, index=torch.tensor([0.0, 2.0]))
    _raises(model, lambda: fh.capture(model, spec)(X), (
        "capture: `index` is an int, ints, a bool mask or an integer tensor, got <Tensor of shape (2,)>, at module "
        "'0' for scale('0', 2.0, index=<Tensor of shape (2,)>). Pass integer positions along dim 1."
    ))


def test_an_index_in_range_under_vmap_still_sweeps() -> None:
    """Under `vmap` a batched index cannot be checked (no data-dependent test there): a
    sweep of positions in range keeps working, equal to the loop."""
    model = _mlp()
    f = fh.capture(model, fh.ablate("0", index=fh.arg("pos")))
    positions = torch.arange(-6, 6)
    with torch.no_grad():
        swept, _ = torch.func.vmap(lambda p: f(X, pos=p))(positions)
        loop = torch.stack([f(X, pos=p)[0] for p in positions])
    # equal up to the last bits a batched matmul may round differently from single ones
    torch.testing.assert_close(swept, loop, rtol=1e-6, atol=1e-6)


def test_an_nth_past_the_modules_matched_is_refused_when_the_plan_is_made() -> None:
    """`nth=5` where the selector matches 2 modules edits nothing: refused by `with_hooks` and
    `capture` before anything runs."""
    model = _mlp()
    spec = fh.patch(nn.Linear, 0.0, nth=5)
    message = ("{caller}: `nth` is the index of a module the selector matched (2 here: ['0', '2']), got 5, for "
               "patch(Linear, 0.0, nth=5). Pass an `nth` below 2.")
    _raises(model, lambda: fh.with_hooks(model, spec), message.format(caller="with_hooks"))
    _raises(model, lambda: fh.capture(model, spec), message.format(caller="capture"))
    tensor_nth = fh.patch(nn.Linear, 0.0, nth=torch.tensor(2))
    _raises(model, lambda: fh.capture(model, tensor_nth), (
        "capture: `nth` is the index of a module the selector matched (2 here: ['0', '2']), got 2, for "
        "patch(Linear, 0.0, nth=<Tensor of shape ()>). Pass an `nth` below 2."
    ))


@pytest.mark.parametrize("nth", [2, torch.tensor(5)])
def test_a_per_call_nth_past_the_modules_matched_raises(nth: Any) -> None:
    """The same given per call, checked when the call starts."""
    model = _mlp()
    f = fh.capture(model, fh.patch(nn.Linear, 0.0, nth=fh.arg("layer")))
    _raises(model, lambda: f(X, layer=nth), (
        f"capture: `nth` is the index of a module the selector matched (2 here: ['0', '2']), got {int(nth)}, for "
        "patch(Linear, 0.0, nth=fh.arg('layer')). Pass an `nth` below 2."
    ))
    with torch.no_grad():  # in range, per call and under vmap, it works as before
        swept, _ = torch.func.vmap(lambda k: f(X, layer=k))(torch.arange(2))
        assert torch.equal(swept[1], torch.zeros(2, 3)) and torch.equal(swept[0], model[2].bias.expand(2, 3))


@pytest.mark.parametrize(("spec", "call", "message"), [
    (fh.patch("0", fh.arg("v")), {"v": "abc"},
     "`value` is a tensor, a number or a Record, got 'abc'"),
    (fh.scale("0", fh.arg("k")), {"k": {"a": 1}},
     "`factor` is a tensor or a number, got {'a': 1}"),
    (fh.steer("0", torch.ones(6), scale=fh.arg("k")), {"k": "2"},
     "`scale` is a tensor or a number, got '2'"),
    (fh.scale("0", 2.0, index=fh.arg("pos")), {"pos": "a"},
     "`index` is an int, ints, a bool mask or an integer tensor, got 'a'"),
    (fh.scale("0", 2.0, nth=fh.arg("n")), {"n": "0"},
     "`nth` is an int >= 0 or an integer tensor, got '0'"),
])
def test_a_per_call_value_of_the_wrong_kind_is_refused(spec: fh.Spec, call: dict, message: str) -> None:
    """A str or dict given through `fh.arg` raises an InterventionError naming the spec,
    not a torch TypeError."""
    model = _mlp()
    with pytest.raises(fh.InterventionError, match="^capture: " + message.replace("[", r"\[").replace("(", r"\(")
                       .replace("{", r"\{").replace("}", r"\}")):
        fh.capture(model, spec)(X, **call)
    fh.testing.assert_no_hooks(model)


def test_a_record_given_per_call_as_a_steering_vector_is_refused() -> None:
    """`steer`'s constructor refuses a Record as the vector; the same Record per call is
    refused the same way instead of being added."""
    model = _mlp()
    _, rec = fh.capture(model, fh.outputs("0"))(X)
    f = fh.capture(model, fh.steer("0", fh.arg("v")))
    _raises(model, lambda: f(X, v=rec), (
        "capture: `vector` is a tensor or a number, got <Record of 1 module>, at module '0' for "
        "steer('0', fh.arg('v')). Pass one of those per call."
    ))


@pytest.mark.parametrize("spec", [
    fh.patch("0", torch.full((6,), 1 + 2j)),
    fh.scale("0", torch.tensor(1j)),
    fh.steer("0", torch.ones(6), scale=torch.tensor(2j)),
])
def test_a_complex_value_into_a_real_output_is_refused(spec: fh.Spec) -> None:
    """The imaginary part used to be dropped silently."""
    model = _mlp()
    _raises(model, lambda: fh.capture(model, spec)(X), (
        f"capture: an intervention's value is real where the value it edits is real (torch.float32), got a complex "
        f"value, at module '0' for {spec!r}. Pass a real value, or edit a complex output."
    ))


@pytest.mark.parametrize("element", [3, "k"])
def test_element_on_a_tensor_output_is_refused(element: int | str) -> None:
    """`element` picks an item of a tuple, list or dict output: on a tensor output it was
    ignored, editing the whole tensor."""
    model = _mlp()
    spec = fh.scale("0", 2.0, element=element)
    _raises(model, lambda: fh.capture(model, spec)(X), (
        f"capture: `element` picks an item of a tuple, list or dict output, got element {element!r} of a Tensor, "
        f"at module '0' for {spec!r}. Leave `element` out for a module returning a tensor."
    ))


@hypothesis.settings(deadline=None, max_examples=25)
@hypothesis.given(size=st.integers(1, 5), k=st.integers(0, 3), data=st.data())
def test_a_vmapped_index_edits_its_positions_and_one_out_of_range_edits_nothing(size: int, k: int, data: Any) -> None:
    """Under `vmap` each call's integer `index` (one position, or `k` of them, negative ones
    counted from the end) edits exactly those positions; a position out of range, which
    cannot be read there, edits nothing."""
    shape = () if k == 0 else (k,)
    rows = data.draw(st.lists(st.lists(st.integers(-size - 2, size + 1), min_size=max(k, 1), max_size=max(k, 1)),
                              min_size=1, max_size=4))
    index = torch.tensor(rows).reshape((len(rows),) + shape)
    f = fh.capture(nn.Identity(), fh.scale("", 2.0, index=fh.arg("pos")))
    x = torch.ones(1, size, 3)
    out, _ = torch.func.vmap(lambda pos: f(x, pos=pos))(index)
    for got, row in zip(out, rows):
        edited = {i % size for i in row if -size <= i < size}
        expected = torch.tensor([2.0 if p in edited else 1.0 for p in range(size)]).reshape(1, size, 1).expand(1, size, 3)
        assert torch.equal(got, expected)
