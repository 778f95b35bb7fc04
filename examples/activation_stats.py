"""Train a small MLP, fold ActivationStats over the training steps, save its plots.

Run: ``python examples/activation_stats.py --out plots/`` (needs the ``plot`` extra).
"""

from __future__ import annotations

import argparse
import pathlib

import torch
from torch import nn

import funhooks as fh


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("."), help="where the PNG files go")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    w = torch.randn(8, 1)
    xs = [torch.randn(64, 8) for _ in range(40)]
    batches = [(x, x @ w) for x in xs]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.ActivationStats(with_hist=True, every=2), epochs=3)
    for i, path in enumerate(res.paths):
        means, stds, near_zero = res.layer_stats(i)
        print(f"layer {path}: mean {means[-1]:+.3f}  std {stds[-1]:.3f}  near zero {near_zero[-1]:.0%}")

    args.out.mkdir(parents=True, exist_ok=True)
    res.plot_layer_stats(0).savefig(args.out / "layer_stats.png")
    res.color_dim(0).figure.savefig(args.out / "color_dim.png")
    print(f"wrote {args.out / 'layer_stats.png'} and {args.out / 'color_dim.png'}")


if __name__ == "__main__":
    main()
