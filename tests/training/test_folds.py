"""fold / fold_all / fit: the reducer protocol, one pass, union of specs, hooks always removed."""

from __future__ import annotations

import attrs
import hypothesis
import pytest
import toolz
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss


def _setup(n: int = 5) -> tuple[nn.Module, list, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(n)]
    return model, batches, torch.optim.SGD(model.parameters(), lr=0.05)


@attrs.frozen
class MeanLoss:
    """A reducer with no specs: the mean loss over train steps."""

    specs: tuple = ()

    def init(self) -> tuple[torch.Tensor, int]:
        return torch.zeros(()), 0

    def step(self, state: tuple[torch.Tensor, int], step: fh.Step) -> tuple[torch.Tensor, int]:
        return state[0] + step.loss, state[1] + 1

    def result(self, state: tuple[torch.Tensor, int]) -> float:
        return float(state[0] / state[1])


@attrs.frozen
class Raises:
    """A reducer whose step raises on the second step."""

    specs: tuple = (fh.outputs(nn.Linear),)

    def init(self) -> int:
        return 0

    def step(self, state: int, step: fh.Step) -> int:
        if state == 1:
            raise KeyError("reducer broke")
        return state + 1

    def result(self, state: int) -> int:
        return state


def test_fold_is_reduce_plus_result() -> None:
    """fold(r, steps) == r.result(toolz.reduce(r.step, steps, r.init()))."""
    model, batches, opt = _setup()
    steps = list(fh.train(model, batches, MSE, opt))
    assert fh.fold(MeanLoss(), steps) == MeanLoss().result(toolz.reduce(MeanLoss().step, steps, MeanLoss().init()))
    assert fh.fold(MeanLoss(), steps) == pytest.approx(sum(float(s.loss) for s in steps) / len(steps))


def test_reducer_without_the_protocol_is_refused() -> None:
    """A value lacking `result` (or the others) is a ReducerError naming what lacks."""

    @attrs.frozen
    class NoResult:
        specs: tuple = ()

        def init(self) -> int:
            return 0

        def step(self, state: int, step: fh.Step) -> int:
            return state

    with pytest.raises(fh.ReducerError) as err:
        fh.fold(NoResult(), [])
    assert str(err.value) == (
        "fold: a reducer has `specs`, `init()`, `step(state, step)` and `result(state)`, got "
        "NoResult(specs=()) which lacks result. Give it "
        "those members (see docs/folds.md), or use fh.ActivationStats / fh.HookCallback."
    )
    model, batches, opt = _setup()
    with pytest.raises(fh.ReducerError, match=r"^fit: a reducer has .* got 3 which lacks specs, init, step, result"):
        fh.fit(model, batches, MSE, opt, [3])
    with pytest.raises(fh.ReducerError, match=r"`reducers` is a dict or a list of reducers, got int"):
        fh.fit(model, batches, MSE, opt, 3)
    fh.testing.assert_no_hooks(model)


@hypothesis.given(every=st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=1, max_size=3), n=st.integers(1, 7))
def test_fold_all_equals_separate_folds(every: list[int | None], n: int) -> None:
    """One pass over several reducers gives what separate folds give, in the same shape."""
    model, batches, opt = _setup(n)
    reducers = [fh.ActivationStats(every=e) for e in every] + [MeanLoss()]
    specs = tuple(s for r in reducers for s in r.specs)
    steps = list(fh.train(model, batches, MSE, opt, specs=specs))
    together = fh.fold_all(reducers, steps)
    assert isinstance(together, list)
    for r, res in zip(reducers, together):
        alone = fh.fold(r, steps)
        if isinstance(r, MeanLoss):
            assert res == alone
        else:
            assert res.stats == alone.stats
    as_dict = fh.fold_all({i: r for i, r in enumerate(reducers)}, steps)
    assert list(as_dict) == list(range(len(reducers)))
    assert isinstance(fh.fold_all(tuple(reducers), steps), tuple)


def test_fit_returns_results_in_the_shape_of_reducers() -> None:
    """dict -> dict, list -> list, a single reducer -> its result."""
    model, batches, opt = _setup()
    res = fh.fit(model, batches, MSE, opt, {"loss": MeanLoss(), "acts": fh.ActivationStats()})
    assert set(res) == {"loss", "acts"} and len(res["acts"].stats) == len(batches)
    assert len(fh.fit(model, batches, MSE, opt, [fh.ActivationStats(every=2)])[0].stats) == 3
    assert isinstance(fh.fit(model, batches, MSE, opt, MeanLoss()), float)
    fh.testing.assert_no_hooks(model)


def test_fit_installs_equal_specs_once() -> None:
    """Two equal reducers share one spec: the hook runs once per module call."""
    calls = []

    def count(m: nn.Module, i: tuple, o: torch.Tensor) -> int:
        calls.append(1)
        return len(calls)

    model, batches, opt = _setup(3)
    a, b = fh.HookCallback(count), fh.HookCallback(count)
    res = fh.fit(model, batches, MSE, opt, [a, b])
    assert len(calls) == 3 * 2  # 3 steps x 2 Linear modules, not twice that
    assert res[0] == res[1]


def test_fit_pauses_hooks_on_steps_no_reducer_records() -> None:
    """With every=3, the spec function runs only on iterations 0, 3, 6 (ceil(n/3) steps)."""
    seen = []

    def count(m: nn.Module, i: tuple, o: torch.Tensor) -> None:
        seen.append(o.shape)

    model, batches, opt = _setup(7)
    res = fh.fit(model, batches, MSE, opt, [fh.HookCallback(count, every=3), MeanLoss()])
    assert len(res[0]) == 3
    assert len(seen) == 3 * 2


def test_fit_removes_hooks_when_a_reducer_raises() -> None:
    """An exception in a reducer's step closes the training generator: no hook is left."""
    model, batches, opt = _setup()
    with pytest.raises(KeyError, match="reducer broke"):
        fh.fit(model, batches, MSE, opt, [Raises()])
    fh.testing.assert_no_hooks(model)


def test_fit_removes_hooks_when_loss_fn_raises() -> None:
    """An exception in the loss propagates out of fit with no hook left."""
    model, batches, opt = _setup()

    def bad(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise ArithmeticError("nan loss")

    with pytest.raises(ArithmeticError):
        fh.fit(model, batches, bad, opt, {"a": fh.ActivationStats()})
    fh.testing.assert_no_hooks(model)


def test_fit_without_specs_installs_nothing() -> None:
    """Reducers without specs need no hooks; every step still reaches them."""
    model, batches, opt = _setup()
    assert fh.fit(model, batches, MSE, opt, [MeanLoss()])[0] > 0


def test_running_yields_a_result_per_step() -> None:
    """running() is the lazy accumulate view: one result after each step."""
    model, batches, opt = _setup(4)
    stats = fh.ActivationStats()
    views = list(fh.running(stats, fh.train(model, batches, MSE, opt, specs=stats.specs)))
    assert [len(v) for v in views] == [1, 2, 3, 4]
    fh.testing.assert_no_hooks(model)
