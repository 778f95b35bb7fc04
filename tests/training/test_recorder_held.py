"""fit keeps one recording attached across its steps, paused between them: what a user sees
is what a with_hooks block per step gave (modules changed mid-epoch, reducers that call the
model, errors), and nothing is left on the model however fit ends."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import funhooks as fh
from reducer_kit import MSE, Blocks, batches


def test_block_added_mid_epoch_is_recorded_from_the_next_step() -> None:
    """A block a user step appends on iteration 1 has statistics from iteration 2 on, as a
    run per step would give, and fit leaves no hook."""
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(model: Blocks, batch: tuple) -> torch.Tensor:
        opt.zero_grad()
        loss = MSE(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        if len(model.blocks) == 1 and step.calls == 1:
            model.blocks.append(nn.Linear(3, 3))
        step.calls += 1
        return loss

    step.calls = 0  # type: ignore[attr-defined]
    res = fh.fit(model, batches(4), opt=opt, reducers=fh.ActivationStats(), step=step)
    assert res.paths == ("blocks.0", "blocks.1", "head")
    assert [s[1] is None for s in res.stats] == [True, True, False, False]
    fh.testing.assert_no_hooks(model)


class CallsModel:
    """A reducer whose step calls the model (an evaluation between steps): not recorded."""

    specs = ()

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def init(self) -> int:
        return 0

    def step(self, state: int, step: fh.Step) -> int:
        self.model(torch.ones(2, 3))
        return state + 1

    def result(self, state: int) -> int:
        return state


def test_model_called_by_a_reducer_between_steps_is_not_recorded() -> None:
    """Each step's statistics are those of its own batch: a forward a reducer makes between
    steps is left out (the recording is paused there)."""
    model = nn.Sequential(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    data = batches(3)
    res = fh.fit(model, data, MSE, opt, [fh.ActivationStats(), CallsModel(model)])
    out = model(data[1][0]).detach()
    assert res[1] == 3
    assert res[0].stats[1][0]["mean"] == out.float().mean().item()


class Raises(CallsModel):
    def step(self, state: int, step: fh.Step) -> int:
        if state == 1:
            raise ValueError("reducer failed")
        return state + 1


def test_reducer_raising_mid_fit_leaves_no_hook_and_modes() -> None:
    """A reducer raising on the second step ends fit with its error; nothing of the recording
    stays on the model (or on the optimizer, whose hooks fit keeps between steps) and its
    eval mode is back."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout()).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="reducer failed"):
        fh.fit(model, batches(4), MSE, opt, [fh.ActivationStats(), fh.GradientStats(), Raises(model)])
    fh.testing.assert_no_hooks(model)
    assert not model.training and not model[1].training
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_eval_block_added_mid_epoch_trains_in_train_mode_and_is_put_back() -> None:
    """A block in eval mode that a user step appends is in train mode on every later step
    (fit sees the new module though it reuses its walk of the model) and in eval mode again
    after fit; the rest of the model is in the modes the user left."""
    model = Blocks().eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen: list[bool] = []

    def step(model: Blocks, batch: tuple) -> torch.Tensor:
        seen.append(all(m.training for m in model.modules()))
        opt.zero_grad()
        loss = MSE(model(batch[0]), batch[1])
        loss.backward()
        opt.step()
        if len(model.blocks) == 1:
            model.blocks.append(nn.Linear(3, 3).eval())
        return loss

    fh.fit(model, batches(3), opt=opt, reducers=fh.ActivationStats(), step=step)
    assert seen == [True, True, True]
    assert [m.training for m in model.modules()] == [False] * 5


class Keeps(CallsModel):
    """Keeps a weak reference to each step's stored statistics value, and counts, at every
    forward of the model, how many of those values of earlier steps are still alive."""

    specs = fh.ActivationStats(modules="0").specs

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.alive: list[int] = []
        model.register_forward_pre_hook(lambda m, args: self.alive.append(sum(r() is not None for r in self.refs)))

    def step(self, state: int, step: fh.Step) -> int:
        self.refs.append(weakref.ref(step.record["0"][fh.ActivationStats(modules="0").record_name]))
        return state + 1


@pytest.mark.parametrize("route", ["fit", "fold", "fold_all"])
def test_a_steps_record_is_freed_before_the_next_step_runs(route: str) -> None:
    """What a step's record holds (activations kept by ActivationStats) is freed before the
    next step's forward, by fit, fold and fold_all alike: a fold keeps one step's activations
    alive at a time, not two."""
    model = nn.Sequential(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keeps = Keeps(model)
    stats = fh.ActivationStats(modules="0")
    if route == "fit":
        fh.fit(model, batches(4), MSE, opt, [keeps, stats])
    else:
        steps = fh.train(model, batches(4), MSE, opt, specs=keeps.specs)
        fh.fold(keeps, steps) if route == "fold" else fh.fold_all([keeps, stats], steps)
    assert keeps.alive == [0, 0, 0, 0]


class StepsOptimizer(CallsModel):
    """A reducer reading the update ratios' watch, whose step makes an optimizer step of its
    own (e.g. a probe it trains); its state counts the watch's values in each step's record."""

    watches = fh.UpdateRatio().watches

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        super().__init__(model)
        self.opt = opt

    def init(self) -> list[int]:  # type: ignore[override]
        return []

    def records(self, iteration: int, training: bool) -> bool:
        return training

    def step(self, state: list[int], step: fh.Step) -> list[int]:  # type: ignore[override]
        self.opt.step()
        return [*state, len(step.record.calls("0", "update_ratio"))]

    def result(self, state: list[int]) -> list[int]:  # type: ignore[override]
        return state


def test_an_optimizer_step_a_reducer_makes_between_steps_is_not_read_and_no_hook_stays() -> None:
    """fit's optimizer watches read the steps of the training loop only: an optimizer step a
    reducer makes between them is not in the next step's record, and once fit ends the
    optimizer has none of fit's hooks."""
    model = nn.Sequential(nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks))
    assert fh.fit(model, batches(3), MSE, opt, StepsOptimizer(model, opt)) == [1, 1, 1]
    assert (dict(opt._optimizer_step_pre_hooks), dict(opt._optimizer_step_post_hooks)) == hooks
