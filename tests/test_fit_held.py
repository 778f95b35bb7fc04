"""fit keeps one recording attached across its steps, paused between them: what a user sees
is what a with_hooks block per step gave (modules changed mid-epoch, reducers that call the
model, errors), and nothing is left on the model however fit ends."""

from __future__ import annotations

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
    stays on the model and its eval mode is back."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout()).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="reducer failed"):
        fh.fit(model, batches(4), MSE, opt, [fh.ActivationStats(), fh.GradientStats(), Raises(model)])
    fh.testing.assert_no_hooks(model)
    assert not model.training and not model[1].training


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
