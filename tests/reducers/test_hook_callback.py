"""HookCallback: fastai's results, as a fold."""

from __future__ import annotations

import pytest
import reducer_kit as kit
import torch
from torch import nn

import funhooks as fh

MSE = kit.MSE



def test_hook_callback_stores_the_output(device: torch.device) -> None:
    """fastai's first HookCallback example: hook returning `o` stores the model's prediction."""
    model = nn.Linear(3, 2).to(device)
    batches = kit.batches(5, device=device)
    stored = fh.fit(model, batches, MSE, kit.frozen_opt(model), fh.HookCallback(lambda m, i, o: o, cpu=False))
    assert len(stored) == 5
    for values, (x, _) in zip(stored, batches):
        assert torch.equal(values[0], model(x).detach())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # PyTorch's note: the input needs no grad
def test_hook_callback_backward_gets_the_loss_gradient(device: torch.device) -> None:
    """fastai's second example: a backward hook's grad_output[0] is 2 (pred - y) / n under MSE."""
    model = nn.Linear(1, 1).to(device)
    batches = kit.batches(5, (8, 1), 1, device)
    stored = fh.fit(model, batches, MSE, kit.frozen_opt(model),
                    fh.HookCallback(lambda m, i, o: o, is_forward=False, cpu=False))
    for values, (x, y) in zip(stored, batches):
        pred = model(x).detach()
        torch.testing.assert_close(values[0][0], 2 * (pred - y) / pred.shape[0])


def test_hook_callback_defaults_to_cpu_and_param_leaves(device: torch.device) -> None:
    """cpu=True (fastai's default) moves hook args to the CPU; default modules skip ReLU."""
    model = kit.mlp(device)
    res = fh.fit(model, kit.batches(2, device=device), MSE, kit.frozen_opt(model), fh.HookCallback(lambda m, i, o: o))
    assert [v.device.type for v in res[0]] == ["cpu", "cpu"]
    paramless = fh.HookCallback(lambda m, i, o: o.shape[1], include_paramless=True)
    assert fh.fit(model, kit.batches(1, device=device), MSE, kit.frozen_opt(model), paramless) == ([4, 4, 2],)



@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((3,), {}, "HookCallback: `hook` is a callable `hook(module, input, output)`, got 3. Pass a function."),
        ((print,), {"every": 0}, ("HookCallback: `every` is a positive int or None, got 0. "
                                  "Pass every=1 (or None) to record every train step, every=k for one in k.")),
        ((print,), {"is_forward": "backward"}, ("HookCallback: `is_forward` is a bool, got 'backward'. "
                                                "Pass True or False.")),
        ((print,), {"detach": None}, "HookCallback: `detach` is a bool, got None. Pass True or False."),
        ((print,), {"cpu": 0}, "HookCallback: `cpu` is a bool, got 0. Pass True or False."),
        ((print,), {"include_paramless": "no"}, ("HookCallback: `include_paramless` is a bool, got 'no'. "
                                                 "Pass True or False.")),
        ((print,), {"name": ""}, ("HookCallback: `name` is a non-empty str or None, got ''. "
                                  "Pass the record name, or None for the hook's __name__.")),
    ],
)
def test_hook_callback_arguments_are_checked(args: tuple, kwargs: dict, message: str) -> None:
    """A bad HookCallback argument is a one-line ReducerError naming it, at construction."""
    with pytest.raises(fh.ReducerError) as err:
        fh.HookCallback(*args, **kwargs)
    assert str(err.value) == message
