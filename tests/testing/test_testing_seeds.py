"""Every check draws its inputs from a seed: the same call finds the same counterexample
on every run, another seed other draws (issue 26, item 16)."""

import inspect

import hypothesis
import pytest
import torch
from torch import nn

import funhooks as fh

CHECKS = sorted(name for name in fh.testing.__all__ if name.startswith("check_"))
RAW = hypothesis.settings(max_examples=25, deadline=None, database=None, phases=[hypothesis.Phase.generate])
"""No shrinking: the message shows the first failing draw as drawn."""


class Log(nn.Module):
    """A deliberately broken layer: ``log(x + 0.5)`` is NaN for inputs below -0.5."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x + 0.5)


class MixBatch(nn.Module):
    """A deliberately broken layer: a reshape where a transpose was meant mixes the examples."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[1], x.shape[0]).t()


@pytest.mark.parametrize("name", CHECKS)
def test_every_check_takes_a_seed_keyword_with_a_fixed_default(name):
    """`seed=` is keyword-only and 0 by default, so a plain call is reproducible."""
    parameter = inspect.signature(getattr(fh.testing, name)).parameters["seed"]
    assert parameter.kind == parameter.KEYWORD_ONLY and parameter.default == 0


def finite(**seed):
    fh.testing.check_finite(nn.Sequential(Log()), torch.randn(2, 3), settings=RAW, **seed)


def independent(**seed):
    fh.testing.check_batch_independence(nn.Sequential(MixBatch()), torch.randn(4, 3),
                                        settings=RAW, **seed)


def invariant(**seed):
    small = lambda path, name, out: bool((out.abs() < 2).all())
    fh.testing.check_invariant(nn.Sequential(nn.Identity()), small, fh.testing.tensors((2, 3)), settings=RAW, **seed)


def counterexample(check, **seed) -> str:
    with pytest.raises(AssertionError) as info:
        check(**seed)
    return str(info.value).partition("input: ")[2]


@pytest.mark.parametrize("check", [finite, independent, invariant])
def test_a_failure_reproduces_from_its_seed(check):
    """Two calls with the default seed, or with one seed, find the same input; another seed another."""
    first = counterexample(check)
    assert counterexample(check) == first == counterexample(check, seed=0)
    assert counterexample(check, seed=1) == counterexample(check, seed=1) != first
