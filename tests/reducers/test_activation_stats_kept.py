"""ActivationStats keeps activations without a copy only where nothing changes them in place later."""

from __future__ import annotations

import gc

import pytest
import reducer_kit as kit
import torch
from torch import nn

import funhooks as fh

# -- activations kept without a copy (issue 16) ---------------------------------------------------


class Bumped(nn.Module):
    """A Linear whose output the parent changes in place on the calls listed in `bump_on`."""

    def __init__(self, bump_on: set[int]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.bump_on, self.calls = bump_on, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.calls in self.bump_on:
            y.mul_(2)  # after fc's hook: what a `+=` residual or an in-place activation does
        self.calls += 1
        return self.head(y)


def test_outputs_changed_in_place_later_are_copied_on_every_step() -> None:
    """An output changed in place after its hook on every step (learned from the first one)
    still gives the statistics of what the module returned, on every step."""
    model = Bumped(set(range(5)))
    batches = kit.batches(5)
    res = fh.fit(model, batches, kit.MSE, kit.frozen_opt(model), fh.ActivationStats(modules="fc"))
    for step, (x, _) in zip(res.stats, batches):
        o = model.fc(x).detach()
        assert (step[0]["mean"], step[0]["std"]) == (o.mean().item(), o.std().item())


def test_an_output_changed_in_place_only_later_raises_and_the_next_run_learns_afresh() -> None:
    """A module whose output nothing changed on earlier steps is kept without a copy; when a
    later step changes it after the hook, that step's statistics are lost: StaleTensorError
    says so and how to avoid it, and nothing stays attached. What the run learned goes with
    it (issue 36, item 1): the next run learns from its own first step, so it meets the same."""
    model = Bumped({3})
    batches = kit.batches(5)
    message = (
        "fit: an output kept without a copy (ActivationStats keeps so the outputs no later op changed on earlier "
        "steps) must not change after its hook, got the output of module 'fc' changed in place on this step, which "
        "the earlier steps of this recording never did, so its statistics on this step are lost. Change it out of "
        "place on every step or on none (`y = y * 2`, `inplace=False`), or leave the module out with `modules=`."
    )
    for _ in range(2):
        model.calls = 0
        with pytest.raises(fh.StaleTensorError) as err:
            fh.fit(model, batches, kit.MSE, kit.frozen_opt(model), fh.ActivationStats(modules="fc"))
        assert str(err.value) == message
        fh.testing.assert_no_hooks(model)


class Sliced(nn.Module):
    """Returns the first rows of a larger tensor: a contiguous output that does not own its storage."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x, x, x])[: len(x)]


def test_an_output_sharing_a_larger_storage_is_copied() -> None:
    """A kept activation never holds a larger storage alive: a slice is copied in the hook."""
    model = nn.Sequential(nn.Linear(3, 3), Sliced(), nn.Linear(3, 2))
    stats = fh.ActivationStats(modules=Sliced)
    steps = list(fh.train(model, kit.batches(3), kit.MSE, kit.frozen_opt(model), specs=stats.specs))
    fh.fold(stats, steps)
    kept = [s.record["1"][stats.record_name] for s in steps]
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in kept)



@pytest.mark.usefixtures("frozen_heap")
def test_a_freed_modules_knowledge_does_not_pass_to_a_new_module() -> None:
    """What ActivationStats learned of a module (nothing changes its output) goes with it: a
    new module, which may reuse the freed one's memory, is copied on its first step, so a
    later op changing its output in place costs nothing (no StaleTensorError, exact stats)."""
    for _ in range(20):
        quiet = Bumped(set())
        fh.fit(quiet, kit.batches(1), kit.MSE, kit.frozen_opt(quiet), fh.ActivationStats(modules="fc"))
        del quiet
        gc.collect()
        model = Bumped(set(range(2)))
        batches = kit.batches(2)
        res = fh.fit(model, batches, kit.MSE, kit.frozen_opt(model), fh.ActivationStats(modules="fc"))
        o = model.fc(batches[1][0]).detach()
        assert res.stats[1][0]["std"] == o.std().item()
