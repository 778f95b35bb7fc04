"""What ActivationStats learns about a model (whether a later op changes a module's output in
place) belongs to the run that learned it: a module reused by another run, or a model changed
mid-run, gets exact statistics (issue 36, items 1 and 2)."""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Iterator

import pytest
import reducer_kit as kit
import torch
from torch import nn

import funhooks as fh
from funhooks.training.recorder import learned
from funhooks.training.stepwise import Stepwise


def hand_stats(model: nn.Module, batches: list, opt: torch.optim.Optimizer,
               swap: dict[int, tuple[str, nn.Module]] | None = None) -> list[list[tuple[float, float, float]]]:
    """fastai-style hand hooks on every Linear that clone the output in the hook: per step,
    per Linear (module order), ``(mean, std, near-zero share)``; `swap` replaces a child of
    `model` before the step of that index, as the training below does."""
    current: list[tuple[float, float, float]] = []

    def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        o = output.detach().clone().float()
        current.append((o.mean().item(), o.std().item(), (o <= 0.05).sum().item() / o.numel()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Linear)]
    out = []
    try:
        for i, (x, y) in enumerate(batches):
            if swap and i in swap:
                setattr(model, *swap[i])
            current.clear()
            opt.zero_grad()
            kit.MSE(model(x), y).backward()
            opt.step()
            out.append(list(current))
    finally:
        for h in handles:
            h.remove()
    return out


def numbers(res: fh.ActivationStatsResult) -> list[list[tuple[float, float, float]]]:
    return [[(s["mean"], s["std"], s["near_zero"]) for s in step if s is not None] for step in res.stats]


def test_a_module_reused_in_a_later_run_is_learned_afresh() -> None:
    """A Linear whose output nothing changed in one fit is reused in another model where a
    ReLU(inplace=True) changes it after its hook: the second fit runs to its end with the
    statistics of what the Linear returned (before: StaleTensorError at step 0)."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 4)
    first = nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 2))
    fh.fit(first, kit.batches(2), kit.MSE, kit.frozen_opt(first), fh.ActivationStats(modules=nn.Linear))
    second = nn.Sequential(shared, nn.ReLU(inplace=True), nn.Linear(4, 2))
    reference = copy.deepcopy(second)
    batches = kit.batches(4)
    res = fh.fit(second, batches, kit.MSE, torch.optim.SGD(second.parameters(), lr=0.1),
                 fh.ActivationStats(modules=nn.Linear))
    assert numbers(res) == hand_stats(reference, batches, torch.optim.SGD(reference.parameters(), lr=0.1))
    fh.testing.assert_no_hooks(second)


def test_the_same_reducer_on_two_models_sharing_a_module_is_exact_in_both() -> None:
    """One ActivationStats value reused, the module shared, through `fh.train` + `fh.fold`."""
    torch.manual_seed(0)
    shared = nn.Linear(3, 4)
    stats = fh.ActivationStats(modules=nn.Linear)
    quiet = nn.Sequential(shared, nn.Tanh(), nn.Linear(4, 2))
    fh.fold(stats, fh.train(quiet, kit.batches(2), kit.MSE, kit.frozen_opt(quiet), specs=stats.specs))
    loud = nn.Sequential(shared, nn.ReLU(inplace=True), nn.Linear(4, 2))
    reference = copy.deepcopy(loud)
    batches = kit.batches(3)
    res = fh.fold(stats, fh.train(loud, batches, kit.MSE, kit.frozen_opt(loud), specs=stats.specs))
    assert numbers(res) == hand_stats(reference, batches, kit.frozen_opt(reference))


def swapping(batches: list, model: nn.Module, at: int, name: str, new: nn.Module) -> Iterator[tuple]:
    """`batches`, with `model.<name>` replaced by `new` before batch `at` is handed out."""
    for i, batch in enumerate(batches):
        if i == at:
            setattr(model, name, new)
        yield batch


@pytest.mark.parametrize("route", ["fit", "train", "folding", "trainer callbacks"])
def test_an_activation_swapped_for_an_in_place_one_mid_run_goes_on(route: str) -> None:
    """`Tanh` swapped for `ReLU(inplace=True)` mid-training (docs/field.md, "Models that
    change"): the run goes on, and every step's statistics are those of hand hooks that clone
    (before: StaleTensorError on the step of the swap)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(model)
    batches = kit.batches(6)
    stats = fh.ActivationStats(modules=nn.Linear)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fed = swapping(batches, model, 3, "1", nn.ReLU(inplace=True))
    if route == "fit":
        res = fh.fit(model, fed, kit.MSE, opt, stats)
    elif route == "train":
        res = fh.fold(stats, fh.train(model, fed, kit.MSE, opt, specs=stats.specs))
    elif route == "trainer callbacks":  # what the Lightning and Hugging Face callbacks drive
        fold = Stepwise(stats, "FoldCallback")
        fold.start(model, opt)
        for i, (x, y) in enumerate(fed):
            fold.begin(0, i)
            opt.zero_grad()
            loss = kit.MSE(model(x), y)
            loss.backward()
            opt.step()
            fold.add(loss)
            fold.end()
        res = fold.result()
    else:
        with fh.folding(model, stats, opt=opt) as fold:
            for x, y in fed:
                opt.zero_grad()
                kit.MSE(model(x), y).backward()
                opt.step()
                fold.step()
        res = fold.result()
    expected = hand_stats(reference, batches, torch.optim.SGD(reference.parameters(), lr=0.1),
                          swap={3: ("1", nn.ReLU(inplace=True))})
    assert numbers(res) == expected
    fh.testing.assert_no_hooks(model)


@pytest.mark.usefixtures("frozen_heap")
def test_nothing_a_run_learned_outlives_it() -> None:
    """After a fit, no recording's knowledge is visible, and nothing keeps the model alive."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    fh.fit(model, kit.batches(3), kit.MSE, kit.frozen_opt(model), fh.ActivationStats(modules=nn.Linear))
    assert learned() is None
    ref = weakref.ref(model[0])
    del model
    gc.collect()
    assert ref() is None
