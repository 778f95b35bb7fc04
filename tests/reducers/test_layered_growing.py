"""Models that change mid-training: layers that arrive are watched from then on, layers that
leave drop out of later steps, and paths stay in module order."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch
from torch import nn

import funhooks as fh
from reducer_kit import MSE, Blocks, batches


class Epochs:
    """The same batches every epoch; `change()` runs before every epoch after the first."""

    def __init__(self, data: list, change: Callable[[], None]) -> None:
        self.data, self.change, self.epochs = data, change, 0

    def __len__(self) -> int:
        return len(self.data)

    def __iter__(self) -> Iterator:
        if self.epochs:
            self.change()
        self.epochs += 1
        return iter(self.data)


def test_block_added_after_epoch_zero_is_watched_in_module_order() -> None:
    """A block appended after epoch 0 (with opt.add_param_group) shows in GradientStats and
    UpdateRatio from then on, and every result lists paths in module order."""
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def grow() -> None:
        model.blocks.append(nn.Linear(3, 3))
        opt.add_param_group({"params": list(model.blocks[1].parameters())})

    reducers = {"acts": fh.ActivationStats(), "grads": fh.GradientStats(), "update": fh.UpdateRatio()}
    res = fh.fit(model, Epochs(batches(2), grow), MSE, opt, reducers, epochs=2)
    for r in res.values():
        assert r.paths == ("blocks.0", "blocks.1", "head")
    norms = res["grads"].layer_stats("blocks.1")[0]
    assert [math.isnan(n) for n in norms] == [True, True, False, False]
    assert [math.isnan(r) for r in res["update"].layer(1)] == [True, True, False, False]


def test_activation_swapped_mid_fit_drops_out_of_later_steps() -> None:
    """ReLU swapped for Tanh after epoch 0: DeadUnits' selector matches nothing from then on,
    and fit finishes, the layer absent from the later steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def swap() -> None:
        model[1] = nn.Tanh()

    res = fh.fit(model, Epochs(batches(2), swap), MSE, opt, {"dead": fh.DeadUnits(), "loss": fh.LossCurve()},
                 epochs=2)
    assert res["dead"].paths == ("1",) and len(res["loss"]) == 4
    assert [math.isnan(f) for f in res["dead"].layer("1")] == [False, False, True, True]


def test_watched_layer_removed_mid_fit_drops_out() -> None:
    """A layer a GradientStats selects by path, removed mid-fit, is absent from later steps."""
    model = Blocks()
    model.blocks.append(nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def shrink() -> None:
        del model.blocks[1]

    res = fh.fit(model, Epochs(batches(2), shrink), MSE, opt, fh.GradientStats(modules="blocks.1"), epochs=2)
    assert res.paths == ("blocks.1",)
    assert [math.isnan(n) for n in res.layer_stats(0)[0]] == [False, False, True, True]
