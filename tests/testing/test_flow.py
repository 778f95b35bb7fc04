"""Finite activations and gradients, and gradients reaching every parameter: broken models
fail and blame the module that produced the NaN or cut the path; correct ones pass."""

import hypothesis
import pytest
import torch
from torch import nn

from funhooks.testing import assert_no_hooks, check_finite, check_gradients_reach

SHRINK = hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True)
FINITE = "check_finite: every activation and gradient is finite, got "
GUARD = " Guard the operation (clamp what goes into `log` or `sqrt`, add an epsilon to a division)."
REACH = "check_gradients_reach: every trainable parameter gets a finite, non-zero gradient, got "
LOOK = " Look there for `.detach()`, `torch.no_grad()` or an output that is never used."


class Log(nn.Module):
    """A deliberately broken layer: ``log(x + 0.5)`` is NaN for inputs below -0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + 0.5)


class Sqrt(nn.Module):
    """Finite forward, but an infinite gradient at 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


class Detached(nn.Module):
    """A deliberately broken block: its branch is detached."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.branch = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + self.branch(x).detach()


class NoGrad(Detached):
    """A deliberately broken block: its branch runs under ``torch.no_grad()``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            side = self.branch(x)
        return self.main(x) + side


class Unused(Detached):
    """A deliberately broken block: its branch is built but never called."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x)


class FrozenLinear(nn.Linear):
    """A deliberately broken layer: ``torch.no_grad()`` left inside its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return super().forward(x)


class StopGradient(nn.Module):
    """A deliberately broken layer: detaches its input before its own linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.detach())


def first_line(info: pytest.ExceptionInfo) -> str:
    return str(info.value).splitlines()[0]


def test_finite_blames_a_log_of_a_negative(device):
    """The input shrinks to zeros and one -1, the simplest value the log sees negative; the
    log, not its container, is blamed."""
    model = nn.Sequential(nn.Identity(), nn.Sequential(nn.Identity(), Log()), nn.Linear(3, 1)).to(device)
    with pytest.raises(AssertionError) as info:
        check_finite(model, torch.randn(2, 3, device=device), settings=SHRINK)
    assert first_line(info) == FINITE + "nan in the output of module '1.1' (Log), whose inputs are finite." + GUARD
    assert str(info.value).splitlines()[1:] == f"input: {torch.tensor([[0.0, 0, 0], [0, 0, -1]], device=device)!r}".splitlines()
    assert_no_hooks(model)


def test_finite_blames_the_backward_of_a_sqrt_at_zero(device):
    """``sqrt(relu(x))`` is finite forward; at 0 its gradient is infinite."""
    model = nn.Sequential(nn.ReLU(), nn.Sequential(Sqrt()), nn.Linear(3, 1)).to(device)
    with pytest.raises(AssertionError) as info:
        check_finite(model, torch.randn(2, 3, device=device))
    assert first_line(info) == FINITE + (
        "inf in the gradient that module '1.0' (Sqrt) passes back to its inputs, from finite gradients at its output."
    ) + GUARD
    assert_no_hooks(model)


def test_finite_holds_for_a_bounded_model_and_leaves_grads_alone(device):
    """A tanh model is finite forward and back; parameters' `.grad` stay None."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(device)
    check_finite(model, torch.randn(2, 3, device=device))
    assert all(p.grad is None for p in model.parameters())
    assert_no_hooks(model)


CUTS = [
    (Detached(), "no gradient for 2 parameter(s) of '1.branch' (Linear), cut in module '1' (Detached).",
     "module '1' (Detached) drops or detaches the output of '1.branch' (Linear)"),
    (NoGrad(), "no gradient for 2 parameter(s) of '1.branch' (Linear), cut in module '1' (NoGrad).",
     "module '1' (NoGrad) calls '1.branch' (Linear) with gradients off (`torch.no_grad()`)"),
    (Unused(), "no gradient for 2 parameter(s) of '1.branch' (Linear), cut in module '1' (Unused).",
     "module '1' (Unused) never calls '1.branch' (Linear)"),
    (FrozenLinear(3, 3), "no gradient for 2 parameter(s) of '0' (Linear), cut in module '1' (FrozenLinear).",
     "module '1' (FrozenLinear) gets a gradient at its output but passes none back to its input"),
    (StopGradient(), "no gradient for 2 parameter(s) of '0' (Linear), cut in module '1' (StopGradient).",
     "module '1' (StopGradient) gets a gradient at its output but passes none back to its input"),
]


@pytest.mark.parametrize(("body", "found", "reason"), CUTS, ids=[type(c[0]).__name__ for c in CUTS])
def test_gradients_reach_names_the_module_that_cut_the_path(device, body, found, reason):
    """A detached branch, a branch under no_grad, an unused branch, no_grad inside a layer
    and a detached input: the first failing parameter's module and the cut are named."""
    model = nn.Sequential(nn.Linear(3, 3), body, nn.Linear(3, 1)).to(device)
    with pytest.raises(AssertionError) as info:
        check_gradients_reach(model, torch.randn(8, 3, device=device))
    lines = str(info.value).splitlines()
    assert lines[0] == REACH + found + LOOK
    assert lines[1] == reason
    assert all(p.grad is None for p in model.parameters())
    assert_no_hooks(model)


def test_gradients_reach_names_own_parameters_cut_inside_a_layer(device):
    """The layer left under no_grad is blamed for its own weight and bias too."""
    model = nn.Sequential(FrozenLinear(3, 3), nn.Linear(3, 1)).to(device)
    with pytest.raises(AssertionError) as info:
        check_gradients_reach(model, torch.randn(8, 3, device=device))
    lines = str(info.value).splitlines()
    assert lines[0] == REACH + "no gradient for 2 parameter(s) of '0' (FrozenLinear), cut in module '0' (FrozenLinear)." + LOOK
    assert lines[2:4] == ["no gradient: '0.weight'", "no gradient: '0.bias'"]


def test_gradients_reach_every_parameter_of_a_healthy_model(device):
    """Every weight and bias of a small MLP gets a gradient."""
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1)).to(device)
    check_gradients_reach(model, torch.randn(8, 3, device=device))
    assert_no_hooks(model)
