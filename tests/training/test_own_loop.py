"""fh.folding: reducers folded over a loop you write give what fh.fit gives (issue 16)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss
EPOCHS = 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


def _reducers() -> dict:
    return {
        "acts": fh.ActivationStats(with_hist=True),
        "sparse": fh.ActivationStats(every=2),
        "hooks": fh.HookCallback(lambda m, i, o: o.sum(), every=3),
        "grads": fh.GradientStats(),
        "update": fh.UpdateRatio(every=2),
        "dead": fh.DeadUnits(),
        "loss": fh.LossCurve(),
    }


def _same(a: dict, b: dict) -> None:
    assert len(a["acts"].stats) == len(b["acts"].stats)
    for x, y in zip(a["acts"].stats, b["acts"].stats):
        assert [{k: v.tolist() if k == "hist" else v for k, v in s.items()} for s in x] == \
            [{k: v.tolist() if k == "hist" else v for k, v in s.items()} for s in y]
    assert a["sparse"].iterations == b["sparse"].iterations and a["sparse"].stats == b["sparse"].stats
    assert [[float(v) for v in vs] for vs in a["hooks"]] == [[float(v) for v in vs] for vs in b["hooks"]]
    assert a["grads"].stats == b["grads"].stats and a["update"].ratios == b["update"].ratios
    assert a["update"].iterations == (0, 2, 4, 6)
    assert a["dead"].dead == b["dead"].dead and a["loss"].losses == b["loss"].losses


def test_your_own_loop_gives_what_fit_gives() -> None:
    """The same training by fh.fit and by a hand-written loop marked with fold.step: every
    reducer (activation, hook, gradient, update, dead-unit, loss statistics) gives the same."""
    model, batches = _model(), _batches(4)
    mine = copy.deepcopy(model)
    fitted = fh.fit(model, batches, MSE, torch.optim.SGD(model.parameters(), lr=0.1), _reducers(), epochs=EPOCHS)
    opt = torch.optim.SGD(mine.parameters(), lr=0.1)
    mine.train()
    with fh.folding(mine, _reducers(), opt=opt) as fold:
        for epoch in range(EPOCHS):
            for x, y in batches:
                opt.zero_grad()
                loss = MSE(mine(x), y)
                loss.backward()
                opt.step()
                step = fold.step(loss, epoch=epoch)
    assert (step.epoch, step.iteration) == (1, 7)
    _same(fold.result(), fitted)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), mine.parameters()))
    fh.testing.assert_no_hooks(mine)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_paused_blocks_and_other_threads_are_not_recorded() -> None:
    """An evaluation inside `fold.paused()` and calls from another thread are not in the steps."""
    model = _model()
    calls = fh.HookCallback(lambda m, i, o: o.shape[0], modules="0")
    with fh.folding(model, calls) as fold:
        model(torch.randn(6, 3))
        with fold.paused():
            model(torch.randn(5, 3))
        worker = threading.Thread(target=lambda: model(torch.randn(4, 3)))
        worker.start()
        worker.join()
        fold.step(torch.tensor(1.0))
        model(torch.randn(7, 3))
        fold.step(None, training=False)  # an evaluation step: reducers skip it
    assert fold.result() == ([6],)


def test_an_exception_in_the_loop_leaves_nothing_attached() -> None:
    """Leaving the block by an exception removes the model's wrappers and the optimizer's hooks."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ArithmeticError):
        with fh.folding(model, [fh.ActivationStats(), fh.GradientStats()], opt=opt) as fold:
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            fold.step(torch.tensor(0.0))
            raise ArithmeticError("nan loss")
    fh.testing.assert_no_hooks(model)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks
    assert len(fold.result()[0].stats) == 1


def test_marks_outside_the_block_and_missing_optimizers_are_refused() -> None:
    """fold.step outside the block, a second `with`, and watches without `opt` are LoopErrors."""
    model = _model()
    fold = fh.folding(model, [fh.LossCurve()])
    with pytest.raises(fh.LoopError) as err:
        fold.step(torch.tensor(1.0))
    assert str(err.value) == (
        "folding: `step` marks an iteration inside the `with fh.folding(...)` block, got a call outside it. "
        "Mark iterations inside the block."
    )
    with fold:
        pass
    with pytest.raises(fh.LoopError, match=r"^folding: a folding block is entered once, got a second `with`"):
        with fold:
            pass
    with pytest.raises(fh.LoopError) as err:
        fh.folding(model, [fh.UpdateRatio()])
    assert str(err.value) == (
        "folding: a reducer watches the optimizer step (`watches`), got no optimizer. Pass `opt=` (the optimizer "
        "your loop steps)."
    )


def test_states_merge_across_ranks() -> None:
    """fold.states has the shape of the reducers; merge_across_ranks takes each (one process: as is)."""
    model = _model()
    stats = fh.ActivationStats()
    with fh.folding(model, {"acts": stats}) as fold:
        model(torch.randn(2, 3))
        fold.step(torch.tensor(0.5))
    merged = fh.merge_across_ranks(stats, fold.states["acts"])
    assert stats.result(merged).stats == fold.result()["acts"].stats
