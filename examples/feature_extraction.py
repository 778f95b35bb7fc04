"""Feature extraction: read a trained CNN's penultimate features without editing the model.

A nearest-class-mean classifier on those features shows they carry the digit's identity.

Run: python examples/feature_extraction.py   (FUNHOOKS_FAST=1: one epoch on a subset)
"""

import os

import torch
from torch import nn

import funhooks as fh
from funhooks.demo import digits, digits_cnn

FAST = os.environ.get("FUNHOOKS_FAST", "") not in ("", "0")
EPOCHS = 1 if FAST else 5
FEATURES = "7"  # the Flatten before the linear head: 64 features per image


def main() -> None:
    torch.manual_seed(0)
    (x, y), (xv, yv) = digits(train_size=256 if FAST else None)
    model = digits_cnn()
    batches = list(zip(x.split(64), y.split(64)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in fh.train(model, batches, nn.functional.cross_entropy, opt, epochs=EPOCHS, progress=False):
        pass
    print(f"trained {step.iteration + 1} steps, last loss {step.loss.item():.3f}")

    extract = fh.capture(model.eval(), fh.outputs(FEATURES))  # a pure function: x -> (logits, Record)
    with torch.no_grad():
        _, rec = extract(x)
        train_features = rec[FEATURES]["output"]
        _, rec = extract(xv)
        valid_features = rec[FEATURES]["output"]
    print("features:", tuple(train_features.shape), "train,", tuple(valid_features.shape), "validation")

    centroids = torch.stack([train_features[y == c].mean(0) for c in range(10)])
    predicted = torch.cdist(valid_features, centroids).argmin(1)
    print(f"nearest-class-mean accuracy on the features: {100 * (predicted == yv).float().mean():.1f}%")
    fh.testing.assert_no_hooks(model)


if __name__ == "__main__":
    main()
