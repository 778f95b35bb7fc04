"""A wrapped forward through its states: one run observing, one run editing, several runs on
one module, left under someone else's forward; each change of state made by a run joining or
leaving, and what a user sees after each (docs/architecture.md, "One call, step by step")."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_clean
from torch import nn

import funhooks as fh


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


def _doubled(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output * 2


def seen(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output


X = torch.randn(4, 3)


@pytest.mark.parametrize("inner_exits_first", [True, False])
def test_an_editing_run_and_an_observing_run_on_one_module_exit_in_either_order(inner_exits_first: bool) -> None:
    """An editing run and an observing run share module '0': the observer records the edited
    output while both are open, each records alone once the other left, and both plans work
    as before afterwards."""
    model = _model()
    plain = model[0](X)
    editing = fh.with_hooks(model, [fh.edit("0", _doubled), fh.observe("0", seen)])
    observing = fh.with_hooks(model, fh.outputs(["0", "2"]))
    editing.__enter__()
    observing.__enter__()
    model(X)
    first, second = (observing, editing) if inner_exits_first else (editing, observing)
    first.__exit__(None, None, None)
    model(X)
    second.__exit__(None, None, None)
    assert torch.equal(observing.record.calls("0", "output")[0], plain * 2)
    assert torch.equal(editing.record.calls("0", "seen")[0], plain * 2)
    assert len(editing.record.calls("0", "seen")) == (2 if inner_exits_first else 1)
    assert len(observing.record.calls("0", "output")) == (1 if inner_exits_first else 2)
    if not inner_exits_first:  # the observer alone again: the module's own output
        assert torch.equal(observing.record.calls("0", "output")[1], plain)
    assert_clean(model)
    with fh.with_hooks(model, [fh.edit("0", _doubled), fh.observe("0", seen)]) as again:
        model(X)
    with fh.with_hooks(model, fh.outputs(["0", "2"])) as alone:
        model(X)
    assert torch.equal(again.record["0"]["seen"], plain * 2)
    assert torch.equal(alone.record["0"]["output"], plain)
    assert_clean(model)


def test_a_forward_kept_from_an_earlier_run_calls_what_the_module_holds_now() -> None:
    """A wrapped forward looked up in one run and called in a later one, while its plan's run
    shares the module with another run: the call goes through the module's forward of now,
    recorded once by each open run."""
    model = _model()
    with fh.with_hooks(model, fh.outputs("0")):
        kept = model[0].forward
    with fh.with_hooks(model, fh.outputs(["0", "2"])) as other:
        with fh.with_hooks(model, fh.outputs("0")) as same_plan:
            y = kept(X)
    assert torch.equal(y, model[0](X))
    assert len(other.record.calls("0", "output")) == 1
    assert len(same_plan.record.calls("0", "output")) == 1
    assert torch.equal(kept(X), model[0](X))  # after every run: the module's own forward
    assert_clean(model)


def test_a_plan_whose_forward_was_left_under_a_library_wrapper_records_again() -> None:
    """A library wraps a run's forward inside its block and keeps its wrapper after it: the
    run's forward then passes calls through, and the next run of the same plan, which wraps
    the library's forward with a new one, records each call once."""
    model = _model()
    layer = model[0]
    with fh.with_hooks(model, fh.edit("0", _doubled)):
        inner = layer.forward
        layer.forward = lambda t: inner(t) + 1
    assert torch.equal(layer(X), nn.Linear.forward(layer, X) + 1)  # the run's editor left with the run
    for _ in range(2):
        with fh.with_hooks(model, [fh.edit("0", _doubled), fh.outputs("0")]) as run:
            y = model[0](X)
        assert len(run.record.calls("0", "output")) == 1
        assert torch.equal(y, (nn.Linear.forward(layer, X) + 1) * 2)
    del layer.forward
    assert_clean(model)
