"""Equivariance, determinism in eval mode and train/eval consistency: broken models fail
and blame the right module; correct ones pass; modes and hooks are left as they were."""

import hypothesis
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import funhooks as fh
from funhooks.testing import (
    assert_no_hooks,
    check_determinism,
    check_equivariance,
    check_train_eval_consistency,
)

SHRINK = hypothesis.settings(max_examples=25, deadline=None, database=None, derandomize=True)
EQUI = ("check_equivariance: model(transform(x)) equals output_transform(model(x)), got module {} first breaking "
        "it. Look for positions the module treats differently (position embeddings, zero padding, flattening).")


def reverse(x: torch.Tensor) -> torch.Tensor:
    """Reverse the elements of a set ``(batch, elements, features)``."""
    return x.flip(1)


def shift(x: torch.Tensor) -> torch.Tensor:
    """Shift a sequence ``(batch, channels, time)`` one step, circularly."""
    return x.roll(1, dims=-1)


def unchanged(y: torch.Tensor) -> torch.Tensor:
    return y


class Mean(nn.Module):
    """Pools a set: the mean over its elements."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class Position(nn.Module):
    """A deliberately broken layer for a set model: a learned embedding per position."""

    def __init__(self, elements: int, width: int) -> None:
        super().__init__()
        self.embedding = nn.Parameter(torch.randn(elements, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.embedding


class Noisy(nn.Module):
    """A deliberately broken layer: dropout hard-wired on, also in eval mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, 0.5, training=True)


class TrainScale(nn.Module):
    """A deliberately broken layer: scales only while training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if self.training else x


def test_a_set_model_is_permutation_invariant(device):
    """Per-element layers then a mean: reversing the set leaves the output unchanged."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), Mean(), nn.Linear(4, 1)).to(device)
    check_equivariance(model, torch.randn(2, 5, 3, device=device), reverse, output_transform=unchanged)
    assert_no_hooks(model)


def test_a_position_embedding_breaks_permutation_invariance(device):
    """The embedding, not the pooling after it, is blamed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Position(5, 4), nn.ReLU(), Mean(), nn.Linear(4, 1)).to(device)
    with pytest.raises(AssertionError) as info:
        check_equivariance(model, torch.randn(2, 5, 3, device=device), reverse, output_transform=unchanged)
    assert str(info.value).splitlines()[0] == EQUI.format("'1' (Position)")
    assert_no_hooks(model)


def test_zero_padding_breaks_shift_equivariance_of_a_convolution(device):
    """A circular convolution commutes with a circular shift; a zero-padded one does not at
    the edges, which its bias alone shows: the counterexample shrinks to all zeros."""
    circular = nn.Conv1d(2, 2, 3, padding=1, padding_mode="circular")
    model = nn.Sequential(circular, nn.ReLU()).to(device)
    check_equivariance(model, torch.randn(1, 2, 6, device=device), shift)
    padded = nn.Sequential(circular, nn.Conv1d(2, 2, 3, padding=1), nn.ReLU()).to(device)
    with pytest.raises(AssertionError) as info:
        check_equivariance(padded, torch.randn(1, 2, 6, device=device), shift, settings=SHRINK)
    lines = str(info.value).splitlines()
    assert lines[0] == EQUI.format("'1' (Conv1d)")
    assert lines[1].startswith("input: tensor([[[0., 0., 0., 0., 0., 0.],")
    assert_no_hooks(padded)


def test_equivariance_rejects_a_transform_that_is_not_callable():
    """A transform is a function; anything else is a SpecError."""
    with pytest.raises(fh.SpecError) as info:
        check_equivariance(nn.Linear(2, 2), torch.randn(2, 2), "flip")
    assert str(info.value) == (
        "check_equivariance: `transform` is a function `tensor -> tensor`, got 'flip'. "
        "Pass one such as `lambda x: x.flip(1)`."
    )


def test_determinism_in_eval_mode_holds_with_dropout_and_restores_the_mode(device):
    """Dropout is off in eval mode; the model is back in training mode afterwards."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.5), nn.Linear(4, 1)).to(device).train()
    check_determinism(model, torch.randn(2, 3, device=device))
    assert model.training and model[1].training
    assert_no_hooks(model)


def test_determinism_blames_dropout_left_on_in_eval_mode(device):
    """``F.dropout(training=True)`` draws new masks on every call; its module is blamed."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(Noisy()), nn.Linear(3, 1)).to(device)
    with pytest.raises(AssertionError) as info:
        check_determinism(model, torch.randn(2, 3, device=device), settings=SHRINK)
    assert str(info.value).splitlines()[0] == (
        "check_determinism: two runs in eval mode on the same input give the same output, got module "
        "'1.0' (Noisy) first breaking it. Remove randomness from eval mode (dropout with `training=True`, "
        "`torch.rand`, sampling)."
    )
    assert_no_hooks(model)


def test_train_eval_consistency_blames_a_training_branch(device):
    """A layer that scales only in training mode is blamed; the modes are restored."""
    model = nn.Sequential(nn.Linear(3, 3), TrainScale(), nn.Linear(3, 1)).to(device).eval()
    with pytest.raises(AssertionError) as info:
        check_train_eval_consistency(model, torch.randn(2, 3, device=device))
    assert str(info.value).splitlines()[0] == (
        "check_train_eval_consistency: a model without dropout or batch norm gives the same output in train "
        "and eval mode, got module '1' (TrainScale) first breaking it. Look for a `self.training` branch."
    )
    assert not any(m.training for m in model.modules())
    check_train_eval_consistency(nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3)).to(device), torch.randn(2, 3, device=device))
    assert_no_hooks(model)


def test_train_eval_consistency_refuses_a_model_with_dropout():
    """Dropout differs between the modes by design: a SpecError points to determinism."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1))
    with pytest.raises(fh.SpecError) as info:
        check_train_eval_consistency(model, torch.randn(2, 2))
    assert str(info.value) == (
        "check_train_eval_consistency: the model has no dropout or batch norm (they differ between train and "
        "eval mode by design), got Dropout(p=0.1, inplace=False) at '1'. Check `check_determinism` instead, "
        "or build the model without them."
    )
