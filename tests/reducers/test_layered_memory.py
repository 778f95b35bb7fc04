"""Per-step values on the CPU are kept without a tensor per step (ActivationStats too: its exact
statistics are checked against fastai's in test_activation_stats*.py on this path), so a long CPU run's memory
stays flat (tiny tensors kept per step pin freed heap pages)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import funhooks as fh
from reducer_kit import MSE, batches, mlp


def tensors_in(value: Any) -> int:
    """How many tensor objects a state holds (walking tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, (tuple, list)):
        return sum(tensors_in(v) for v in value)
    if isinstance(value, dict):
        return sum(tensors_in(v) for v in value.values())
    return 0


def state_after(reducer: Any, n: int) -> Any:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = fh.train(model, batches(n), MSE, opt, specs=reducer.specs, watches=getattr(reducer, "watches", ()))
    state = reducer.init()
    for step in steps:
        state = reducer.step(state, step)
    return state


REDUCERS = [fh.LossCurve(), fh.UpdateRatio(), fh.GradientStats(), fh.DeadUnits(), fh.ActivationStats(),
            fh.ActivationStats(with_hist=True)]


@pytest.mark.parametrize("reducer", REDUCERS, ids=lambda r: repr(r)[:40])
def test_cpu_state_holds_no_tensor_per_step(reducer: Any) -> None:
    """After many CPU steps the state holds as many tensors as after a few (none)."""
    few, many = state_after(reducer, 2), state_after(reducer, 12)
    assert tensors_in(many) == tensors_in(few) == 0


@pytest.mark.parametrize("reducer", REDUCERS, ids=lambda r: repr(r)[:40])
def test_cpu_values_merge_and_read_as_before(reducer: Any) -> None:
    """States kept as host values still merge (two ranks' halves, chunks) and give results."""
    state = state_after(reducer, 3)
    merged = reducer.merge(state, state)
    assert repr(reducer.result(merged)) == repr(reducer.result(state))

