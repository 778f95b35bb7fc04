"""Models, data and helpers the reducer tests share."""

from __future__ import annotations

import torch
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss


def batches(n: int, shape: tuple[int, ...] = (6, 3), out: int = 2, device: torch.device | str = "cpu") -> list:
    """`n` seeded `(x, y)` pairs of the given input shape and `out` targets."""
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(*shape, generator=g).to(device), torch.randn(shape[0], out, generator=g).to(device))
            for _ in range(n)]


def mlp(device: torch.device | str = "cpu") -> nn.Module:
    """Linear(3, 4), ReLU, Linear(4, 2), seeded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(device)


def frozen_opt(model: nn.Module) -> torch.optim.Optimizer:
    """lr=0: the weights never change, so outputs can be recomputed after the fold."""
    return torch.optim.SGD(model.parameters(), lr=0.0)


class Blocks(nn.Module):
    """Residual Linear blocks in a ModuleList, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(3, 3)])
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class StochasticDepth(nn.Module):
    """Residual Linear blocks; call k runs the blocks that ``masks[k % len(masks)]`` keeps
    (stochastic depth, as in the issue: a module skipped on a step did not run there)."""

    def __init__(self, masks: list[tuple[bool, ...]], width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(len(masks[0])))
        self.gain = nn.Parameter(torch.ones(()))  # the root's own: a step that skips every block still trains
        self.masks = masks
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.masks[self.calls % len(self.masks)]
        self.calls += 1
        for block, keep in zip(self.blocks, mask):
            if keep:
                x = x + block(x)
        return x * self.gain

    def outputs(self, x: torch.Tensor, mask: tuple[bool, ...]) -> dict[str, torch.Tensor]:
        """Each kept block's output on `x` under `mask`, by path (no hooks, no call counted)."""
        out = {}
        with torch.no_grad():
            for i, (block, keep) in enumerate(zip(self.blocks, mask)):
                if keep:
                    out[f"blocks.{i}"] = block(x)
                    x = x + out[f"blocks.{i}"]
        return out



def plain(res: fh.ActivationStatsResult) -> list:
    """The stats with histograms as lists, so results compare with ==."""
    return [[plain_one(s) for s in step] for step in res.stats]


def plain_one(s: dict | None) -> dict | None:
    return None if s is None else {k: (v.tolist() if k == "hist" else v) for k, v in s.items()}

