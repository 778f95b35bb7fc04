"""train / evaluate: generators of frozen Steps whose hooks live only while they run."""

from __future__ import annotations

import copy
import gc
import sys

import attrs
import pytest
import torch
from torch import nn

import funhooks as fh
from funhooks import progress

MSE = nn.functional.mse_loss


def _model(device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).to(device)


def _batches(n: int = 4, device: torch.device | str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g).to(device), torch.randn(6, 2, generator=g).to(device)) for _ in range(n)]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def test_train_matches_a_hand_written_loop(device: torch.device) -> None:
    """Same weights and losses as zero_grad / forward / backward / step by hand."""
    model, batches = _model(device), _batches(device=device)
    ref = copy.deepcopy(model)
    ref_opt = _sgd(ref)
    ref_losses = []
    for _ in range(2):
        for x, y in batches:
            ref_opt.zero_grad()
            loss = MSE(ref(x), y)
            loss.backward()
            ref_opt.step()
            ref_losses.append(loss.detach())
    steps = list(fh.train(model, batches, MSE, _sgd(model), epochs=2))
    assert len(steps) == len(ref_losses)
    assert all(torch.equal(s.loss, r) for s, r in zip(steps, ref_losses))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


def test_steps_count_epochs_and_global_iterations() -> None:
    """`iteration` is the global train-batch index from 0, `epoch` counts passes."""
    model = _model()
    steps = list(fh.train(model, _batches(3), MSE, _sgd(model), epochs=2))
    assert [(s.epoch, s.iteration, s.training) for s in steps] == [
        (0, 0, True), (0, 1, True), (0, 2, True), (1, 3, True), (1, 4, True), (1, 5, True)
    ]


def test_step_loss_is_a_detached_tensor_and_record_is_per_batch() -> None:
    """The loss is a detached 0-d tensor; each record holds exactly its own batch."""
    model = _model()
    steps = list(fh.train(model, _batches(3), MSE, _sgd(model), specs=[fh.outputs("0"), fh.grads("2")]))
    for s in steps:
        assert isinstance(s.loss, torch.Tensor) and s.loss.ndim == 0 and not s.loss.requires_grad
        assert len(s.record.calls("0", "output")) == 1
        assert s.record["2"]["grad"].shape == (6, 2)


def test_step_is_frozen() -> None:
    """Assigning to a Step raises FrozenError; attrs.evolve builds a new one."""
    step = fh.Step(epoch=0, iteration=0, loss=torch.tensor(1.0), record=fh.Record(), training=True)
    with pytest.raises(fh.FrozenError) as err:
        step.loss = torch.tensor(2.0)  # type: ignore[misc]
    assert str(err.value) == (
        "Step: a frozen value cannot be assigned to, got `.loss = ...`. Build a new one with `attrs.evolve(step, loss=...)`."
    )
    assert attrs.evolve(step, iteration=5).iteration == 5


def test_hooks_are_installed_only_while_the_generator_runs() -> None:
    """No hooks before the first step, while suspended they are paused, none after the end."""
    model, batches = _model(), _batches(2)
    steps = fh.train(model, batches, MSE, _sgd(model), specs=fh.outputs(nn.Linear))
    fh.testing.assert_no_hooks(model)
    first = next(steps)
    model(batches[0][0])  # the consumer's own call between steps is not recorded
    second = next(steps)
    assert len(first.record.calls("0", "output")) == 1
    assert len(second.record.calls("0", "output")) == 1
    assert list(steps) == []
    fh.testing.assert_no_hooks(model)


def test_hooks_removed_when_the_generator_is_closed() -> None:
    """close() (GeneratorExit at the yield) leaves nothing; so does breaking out early."""
    model = _model()
    steps = fh.train(model, _batches(4), MSE, _sgd(model), specs=fh.outputs(nn.Linear), progress=False)
    next(steps)
    steps.close()
    fh.testing.assert_no_hooks(model)
    for _ in fh.train(model, _batches(4), MSE, _sgd(model), specs=fh.grads(nn.Linear)):
        break
    fh.testing.assert_no_hooks(model)


@pytest.mark.usefixtures("frozen_heap")
def test_a_suspended_or_abandoned_generator_leaves_nothing_attached_and_no_mode_changed() -> None:
    """While a generator waits at a yield nothing of it is on the model, and the model is in
    the mode the user left it in; an abandoned generator collected later (a notebook kept
    the traceback) never undoes the user's `model.eval()`."""
    model = _model().eval()
    steps = fh.train(model, _batches(3), MSE, _sgd(model), specs=[fh.outputs(nn.Linear), fh.grads("0")],
                     progress=False)
    first = next(steps)
    fh.testing.assert_no_hooks(model)
    assert not model.training  # the step ran in train mode; the user's eval mode is back
    assert first.record["0"]["output"].shape == first.record["0"]["grad"].shape == (6, model[0].out_features)
    model.train()
    second = next(steps)
    assert model.training and len(second.record.calls("0", "output")) == 1
    model.eval()
    del steps
    gc.collect()
    assert not model.training
    fh.testing.assert_no_hooks(model)


def test_evaluate_between_train_steps_keeps_each_mode() -> None:
    """Evaluating while a train generator is suspended runs in eval mode and records only
    its own calls; the next train step is in train mode again."""
    model = _model()
    steps = fh.train(model, _batches(2), MSE, _sgd(model), specs=fh.outputs("0"), progress=False)
    next(steps)
    evals = list(fh.evaluate(model, _batches(1), MSE, specs=fh.outputs("0"), progress=False))
    second = next(steps)
    assert evals[0].training is False and len(evals[0].record.calls("0", "output")) == 1
    assert second.training and len(second.record.calls("0", "output")) == 1
    assert model.training


def test_hooks_removed_when_loss_fn_raises() -> None:
    """An exception in `loss_fn` propagates and leaves no hook; the mode is restored."""
    model = _model().eval()

    def bad_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        list(fh.train(model, _batches(2), bad_loss, _sgd(model), specs=[fh.outputs("**"), fh.grads("0")]))
    fh.testing.assert_no_hooks(model)
    assert not model.training


def test_hooks_removed_when_a_spec_raises() -> None:
    """A spec function raising inside a step surfaces as HookError with no hooks left."""
    model = _model()

    def boom(m: nn.Module, i: tuple, o: torch.Tensor) -> None:
        raise RuntimeError("bad hook")

    with pytest.raises(fh.HookError):
        list(fh.train(model, _batches(2), MSE, _sgd(model), specs=fh.observe("0", boom)))
    fh.testing.assert_no_hooks(model)


def test_batch_that_is_not_a_pair_names_what_was_received() -> None:
    """A tensor batch where the loss needs `(x, y)` is a LoopError saying what came."""
    model = _model()
    with pytest.raises(fh.LoopError) as err:
        list(fh.train(model, [torch.randn(6, 3)], MSE, _sgd(model), specs=fh.outputs("0")))
    assert str(err.value) == (
        "train: each batch is an `(x, y)` pair for `loss_fn(model(x), y)`, got a Tensor of shape (6, 3) at batch 0. "
        "Yield `(x, y)` tuples, e.g. from a DataLoader over a TensorDataset, or pass your own `step=fn(model, batch)`."
    )
    fh.testing.assert_no_hooks(model)
    with pytest.raises(fh.LoopError, match=r"got a tuple of 3 items at batch 1"):
        list(fh.evaluate(model, [_batches(1)[0], (1, 2, 3)], MSE))


def test_bad_loop_arguments() -> None:
    """One-shot iterators with epochs > 1, bad epochs and optimizers are refused at once."""
    model = _model()
    with pytest.raises(fh.LoopError) as err:
        fh.train(model, iter(_batches(2)), MSE, _sgd(model), epochs=2)
    assert str(err.value) == (
        "train: `batches` is iterated once per epoch, got a one-shot list_iterator with epochs=2. "
        "Pass a re-iterable such as a list or a DataLoader."
    )
    with pytest.raises(fh.LoopError, match=r"`epochs` is a positive int, got 0"):
        fh.train(model, _batches(2), MSE, _sgd(model), epochs=0)
    with pytest.raises(fh.LoopError, match=r"`opt` is an optimizer with `step\(\)` and `zero_grad\(\)`, got float"):
        fh.train(model, _batches(2), MSE, 0.1)
    with pytest.raises(fh.SelectorError):
        fh.train(model, _batches(2), MSE, _sgd(model), specs=fh.outputs("nope"))


def test_evaluate_runs_without_grad_in_eval_mode(device: torch.device) -> None:
    """Evaluation steps: training=False, no gradient, the right loss, mode restored."""
    model = nn.Sequential(nn.Linear(3, 2), nn.Dropout(0.5)).to(device)
    batches = _batches(3, device)
    steps = list(fh.evaluate(model, batches, MSE, specs=fh.outputs("0")))
    assert [(s.epoch, s.iteration, s.training) for s in steps] == [(0, 0, False), (0, 1, False), (0, 2, False)]
    with torch.no_grad():
        model.eval()
        expected = [MSE(model(x), y) for x, y in batches]
        model.train()
    assert all(torch.equal(s.loss, e) for s, e in zip(steps, expected))
    assert not steps[0].record["0"]["output"].requires_grad
    assert model.training
    assert torch.is_grad_enabled()


def test_evaluate_without_loss_accepts_inputs_alone() -> None:
    """Without `loss_fn`, a batch may be `x` or `(x, y)`; the loss is None."""
    model = _model()
    steps = list(fh.evaluate(model, [torch.randn(2, 3), _batches(1)[0]], specs=fh.outputs("2")))
    assert [s.loss for s in steps] == [None, None]
    assert [s.record["2"]["output"].shape[0] for s in steps] == [2, 6]


def test_progress_is_off_outside_a_terminal_and_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default bar needs a terminal and no CI variable; True without tqdm names the extra."""
    monkeypatch.setenv("CI", "true")
    assert progress._is_enabled(None) is False
    monkeypatch.delenv("CI")
    assert progress._is_enabled(None) is sys.stderr.isatty()
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(fh.ExtraError) as err:
        progress._is_enabled(True)
    assert str(err.value) == (
        "progress: a progress bar needs tqdm, got `progress=True` without it installed. "
        "Install the extra: pip install 'funhooks[progress]'."
    )


def test_progress_bar_shows_steps_and_closing_it_removes_hooks(capsys: pytest.CaptureFixture[str]) -> None:
    """progress=True draws a tqdm bar; closing the wrapper closes the loop."""
    model = _model()
    steps = list(fh.train(model, _batches(3), MSE, _sgd(model), progress=True))
    assert len(steps) == 3
    assert "train" in capsys.readouterr().err
    wrapped = fh.train(model, _batches(3), MSE, _sgd(model), specs=fh.outputs("0"), progress=True)
    next(wrapped)
    wrapped.close()  # type: ignore[attr-defined]
    fh.testing.assert_no_hooks(model)
