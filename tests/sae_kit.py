"""What the SAE tests share: a ReLU SAE of the usual shape and a model run with a hand-written
forward hook (the floor every splice is compared with)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class SAE(nn.Module):
    """A ReLU SAE of the usual shape: ``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_in)``."""

    def __init__(self, d_in: int = 32, d_sae: int = 64, seed: int = 0, scale: float = 0.3) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) * scale)
        self.b_enc = nn.Parameter(torch.randn(d_sae, generator=g) * 0.1)
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) * scale)
        self.b_dec = nn.Parameter(torch.randn(d_in, generator=g) * 0.1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec


def hand(model: nn.Module, block: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], *args: Any,
         **kwargs: Any) -> Any:
    """The model run with a hand-written forward hook replacing `block`'s output by ``fn(x)``."""
    handle = block.register_forward_hook(lambda m, a, out: fn(out) if isinstance(out, torch.Tensor)
                                         else (fn(out[0]), *out[1:]))
    try:
        return model(*args, **kwargs)
    finally:
        handle.remove()
