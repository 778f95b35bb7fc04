"""What the FSDP2 tests share: a sharded model with its plain twin, per-rank inputs, gradient specs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import funhooks as fh

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_gloo_available():
    pytest.skip("FSDP2 (`torch.distributed.fsdp.fully_shard`) with gloo is not available", allow_module_level=True)
if torch.__version__ < (2, 7):  # its own CPU streams lack `record_event`: sharded steps fail inside torch
    pytest.skip("FSDP2 on the CPU needs a torch newer than 2.6", allow_module_level=True)

WORLD = 2
BATCH = 4
COLLECTIVE_TIMEOUT_S = 60
STEPS = 3


def models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """`(sharded, plain)`: Linear-ReLU-Linear with each Linear and the root sharded, and an
    unsharded copy with the same parameters."""
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    sharded = copy.deepcopy(plain)
    fsdp.fully_shard(sharded[0])
    fsdp.fully_shard(sharded[2])
    fsdp.fully_shard(sharded)
    return sharded, plain


def rank_input(rank: int, step: int = 0) -> torch.Tensor:
    return torch.arange(BATCH * 3, dtype=torch.float32).reshape(BATCH, 3) / 10 - 0.5 + rank + step / 3


def grad_value(param, grad):
    return grad


def clip(param, grad):
    return grad.clamp(-0.5, 0.5)


GRAD_SPECS = (fh.observe("**", grad_value, event="param_grad", name="shard"),
              fh.observe("**", grad_value, event="param_grad", name="full", gather=True))
