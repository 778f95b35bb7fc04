"""Field round 3 (issue 26): a resumed run numbers its steps after the first run's, an empty
loader is refused, a loss that is not a tensor is named."""

from __future__ import annotations

import copy

import pytest
import toolz
import torch
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss


def _setup(n: int = 12) -> tuple[nn.Module, list]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    g = torch.Generator().manual_seed(2)
    return model, [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(n)]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


def test_a_resumed_fit_numbers_its_steps_after_the_first() -> None:
    """Two fits over halves of the data, the second from `start_iteration=6`, give what one fit
    over all of it gives: iterations 6..11, the `every` rule on the global iteration."""
    model, batches = _setup()
    whole = copy.deepcopy(model)
    reducers = {"loss": fh.LossCurve(), "acts": fh.ActivationStats(every=4)}
    first = fh.fit(model, batches[:6], MSE, opt := _sgd(model), reducers)
    second = fh.fit(model, batches[6:], MSE, opt, reducers, start_iteration=6)
    once = fh.fit(whole, batches, MSE, _sgd(whole), reducers)
    assert first["loss"].iterations == (0, 1, 2, 3, 4, 5)
    assert second["loss"].iterations == (6, 7, 8, 9, 10, 11)
    assert first["loss"].losses + second["loss"].losses == once["loss"].losses
    assert first["acts"].iterations + second["acts"].iterations == once["acts"].iterations == (0, 4, 8)
    assert first["acts"].stats + second["acts"].stats == once["acts"].stats


def test_states_of_a_run_and_its_resumption_merge_into_every_step() -> None:
    """The merged states of the two halves hold 12 steps, none averaged with another."""
    model, batches = _setup()
    whole = copy.deepcopy(model)
    curve, stats = fh.LossCurve(), fh.ActivationStats()

    def states(model: nn.Module, batches: list, opt: torch.optim.Optimizer, **kwargs: int) -> list:
        steps = list(fh.train(model, batches, MSE, opt, specs=stats.specs, **kwargs))
        return [toolz.reduce(r.step, steps, r.init()) for r in (curve, stats)]

    a = states(model, batches[:6], opt := _sgd(model))
    b = states(model, batches[6:], opt, start_iteration=6)
    once = states(whole, batches, _sgd(whole))
    merged = curve.result(curve.merge(a[0], b[0]))
    assert merged.iterations == tuple(range(12)) and merged.losses == curve.result(once[0]).losses
    assert stats.result(stats.merge(b[1], a[1])).stats == stats.result(once[1]).stats


def test_your_own_loop_resumes_at_an_iteration() -> None:
    """`fh.folding(..., start_iteration=k)` numbers its first train step k."""
    model, _ = _setup()
    with fh.folding(model, [fh.LossCurve()], start_iteration=6) as fold:
        steps = [fold.step(torch.tensor(v)) for v in (3.0, 2.0)]
    assert [s.iteration for s in steps] == [6, 7] and fold.result()[0].iterations == (6, 7)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "6"])
def test_a_bad_start_iteration_is_refused(bad: object) -> None:
    model, batches = _setup(2)
    msg = (f"train: `start_iteration` is a non-negative int (the iteration of the first step), got {bad!r}. "
           "Pass the number of optimizer steps already trained, e.g. start_iteration=trainer_state['step'].")
    with pytest.raises(fh.LoopError) as err:
        fh.train(model, batches, MSE, _sgd(model), start_iteration=bad)  # type: ignore[arg-type]
    assert str(err.value) == msg
    with pytest.raises(fh.LoopError, match="^folding: `start_iteration`"):
        fh.folding(model, [fh.LossCurve()], start_iteration=bad)  # type: ignore[arg-type]


def test_an_empty_loader_is_refused() -> None:
    """drop_last=True with fewer rows than a batch: no step could run, so fit raises instead of
    returning zero-step results; a one-shot iterable that yields nothing raises when it ends."""
    model, _ = _setup()
    data = torch.utils.data.TensorDataset(torch.randn(3, 3), torch.randn(3, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, drop_last=True)
    msg = ("fit: `batches` gives at least one batch per epoch, got an empty DataLoader. Check the data set's "
           "length against the batch size (`drop_last=True` drops a last partial batch).")
    with pytest.raises(fh.LoopError) as err:
        fh.fit(model, loader, MSE, _sgd(model), [fh.LossCurve()])
    assert str(err.value) == msg
    with pytest.raises(fh.LoopError, match=r"^evaluate: `batches` gives at least one batch per epoch, got an empty "
                                           r"DataLoader\."):
        fh.evaluate(model, loader, MSE)
    with pytest.raises(fh.LoopError, match=r"^train: `batches` gives at least one batch per epoch, got none in "
                                           r"epoch 0 from a generator\."):
        list(fh.train(model, (b for b in []), MSE, _sgd(model)))
    fh.testing.assert_no_hooks(model)


def test_a_loss_fn_returning_a_float_is_named() -> None:
    """A `loss_fn` returning `loss.item()` (or an unreduced loss) gets a LoopError, not an
    AttributeError from `.backward()`; the model is left unchanged."""
    model, batches = _setup(2)
    before = copy.deepcopy(model.state_dict())
    msg = ("fit: `loss_fn(model(x), y)` returns the loss as a one-element tensor, got float 0.5. Return the "
           "tensor itself (not `loss.item()`), reduced to one value (e.g. `reduction='mean'`).")
    with pytest.raises(fh.LoopError) as err:
        fh.fit(model, batches, lambda out, y: 0.5, _sgd(model), [fh.ActivationStats()])
    assert str(err.value) == msg
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(fh.LoopError, match=r"^train: `loss_fn\(model\(x\), y\)` returns the loss as a one-element "
                                           r"tensor, got a Tensor of shape \(5, 2\)\."):
        list(fh.train(model, batches, lambda out, y: (out - y) ** 2, _sgd(model)))
    with pytest.raises(fh.LoopError, match=r"^evaluate: `loss_fn\(model\(x\), y\)` returns the loss"):
        list(fh.evaluate(model, batches, lambda out, y: 0.5))
    fh.testing.assert_no_hooks(model)
