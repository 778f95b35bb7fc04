"""Gradient clipping per parameter with a `param_grad` editor, and observers around it.

`fh.edit(..., event="param_grad")` replaces each parameter's gradient as autograd delivers
it; observers before and after it record the raw and clipped norms of every step.

Run: python examples/grad_clipping.py   (FUNHOOKS_FAST=1: one epoch on a subset)
"""

import os

import torch
from torch import nn

import funhooks as fh
from funhooks.demo import digits, digits_cnn

FAST = os.environ.get("FUNHOOKS_FAST", "") not in ("", "0")
EPOCHS = 1 if FAST else 3
MAX_NORM = 0.5


def clip(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """Scale the gradient down to norm MAX_NORM when it is longer."""
    return grad * (MAX_NORM / grad.norm()).clamp(max=1.0)


def norm(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    return grad.norm()


def main() -> None:
    torch.manual_seed(0)
    (x, y), _ = digits(train_size=256 if FAST else None)
    model = digits_cnn()
    batches = list(zip(x.split(64), y.split(64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    weights = (nn.Conv2d, nn.Linear)
    specs = [
        fh.observe(weights, norm, event="param_grad", name="raw"),  # hooks run in spec order
        fh.edit(weights, clip, event="param_grad"),
        fh.observe(weights, norm, event="param_grad", name="clipped"),
    ]
    for step in fh.train(model, batches, nn.functional.cross_entropy, opt, specs=specs, epochs=EPOCHS, progress=False):
        raw = max(step.record.calls(p, "raw")[-1] for p in step.record)
        clipped = max(step.record.calls(p, "clipped")[-1] for p in step.record)
        if step.iteration % 12 == 0:
            print(f"step {step.iteration:3d}  loss {step.loss.item():.3f}  largest grad norm {raw:.3f} -> {clipped:.3f}")
    assert all(p.grad.norm() <= MAX_NORM * (1 + 1e-5) for p in model.parameters())
    print("parameters of the last step:", sorted(step.record))
    fh.testing.assert_no_hooks(model)


if __name__ == "__main__":
    main()
