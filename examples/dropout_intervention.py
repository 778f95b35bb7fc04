"""An intervention: dropout after every conv, added by a spec instead of editing the model.

With the edit active at inference (Monte Carlo dropout), repeated predictions differ, and
their spread says which digits the model is unsure about. Outside the block the model is
exactly the one trained: no hook is left behind.

Run: python examples/dropout_intervention.py   (FUNHOOKS_FAST=1: one epoch on a subset)
"""

import os

import torch
from torch import nn

import funhooks as fh
from funhooks.demo import digits, digits_cnn

FAST = os.environ.get("FUNHOOKS_FAST", "") not in ("", "0")
EPOCHS = 1 if FAST else 5
P_DROP = 0.2
SAMPLES = 20  # stochastic passes per image


def dropout(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Drop whole channels of a conv's output, in training and in eval mode alike."""
    return nn.functional.dropout2d(output, P_DROP, training=True)


def main() -> None:
    torch.manual_seed(0)
    (x, y), (xv, yv) = digits(train_size=256 if FAST else None)
    model = digits_cnn()
    batches = list(zip(x.split(64), y.split(64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    drop = fh.edit(nn.Conv2d, dropout)  # a value: nothing touches the model yet
    for step in fh.train(model, batches, nn.functional.cross_entropy, opt, specs=drop, epochs=EPOCHS, progress=False):
        pass
    print(f"trained {step.iteration + 1} steps with dropout after each conv, last loss {step.loss.item():.3f}")

    model.eval()
    with torch.no_grad():
        reference = model(xv)
        with fh.with_hooks(model, drop):
            probs = torch.stack([model(xv).softmax(-1) for _ in range(SAMPLES)])
        assert torch.equal(model(xv), reference)  # hooks gone: the plain model again
    mean, spread = probs.mean(0), probs.std(0).max(-1).values
    accuracy = (mean.argmax(-1) == yv).float().mean()
    print(f"MC-dropout accuracy {100 * accuracy:.1f}% over {SAMPLES} passes")
    worst = spread.argsort(descending=True)[:5].tolist()
    print("most uncertain validation images (index: label, predicted, spread):",
          [(i, yv[i].item(), mean[i].argmax().item(), round(spread[i].item(), 3)) for i in worst])
    fh.testing.assert_no_hooks(model)


if __name__ == "__main__":
    main()
