"""Training and evaluation as generators of frozen :class:`Step` values.

``train`` is the hand-written PyTorch loop (``zero_grad``, forward, loss, ``backward``,
``step``) turned inside out: each batch yields a ``Step`` holding its epoch, iteration,
detached loss and the Record the specs stored. Anything that watches training, such as
activation statistics, is a fold over those values (see :mod:`funhooks.fold`) instead of a
callback mutating a trainer.

Each step runs inside its own ``with_hooks`` block, in the model mode the loop asks for
(train or eval), and both are undone before the step is yielded: while the consumer's code
runs, and while a generator is suspended or abandoned (a notebook keeping a traceback),
nothing of the loop is attached to the model and the model is in the modes the user left
it in. Closing the generator never changes a mode the user set since.

Cost: per step, a ``with_hooks`` block (wrapping and restoring the hooked modules, a few µs
per module), a walk over the modules for their train/eval flags, and a Step object; it
never calls ``.item()``, so nothing syncs a GPU. Steps whose record nobody reads (see
``records`` in :func:`funhooks.fit`) run with no block at all and carry an empty Record.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from . import progress as _progress
from ._modes import in_mode
from .errors import LoopError
from .record import Record
from .run import Run
from .spec import Spec
from .step import EMPTY_RECORD, Step

__all__ = ["Step", "evaluate", "train"]

Records = Callable[[int, bool], bool]
"""``records(iteration, training) -> bool``: whether a step's record is read by anyone."""


# -- checks ---------------------------------------------------------------------------------


def _describe(batch: Any) -> str:
    if isinstance(batch, torch.Tensor):
        return f"a Tensor of shape {tuple(batch.shape)}"
    if isinstance(batch, (tuple, list)):
        return f"a {type(batch).__name__} of {len(batch)} items"
    if isinstance(batch, dict):
        return f"a dict with keys {list(batch)}"
    return f"a {type(batch).__name__}"


def _pair(batch: Any, index: int, caller: str) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise LoopError(
        f"{caller}: each batch is an `(x, y)` pair for `loss_fn(model(x), y)`, got {_describe(batch)} at batch "
        f"{index}. Yield `(x, y)` tuples, e.g. from a DataLoader over a TensorDataset."
    )


def _check_loop(model: Any, batches: Any, epochs: Any, caller: str) -> None:
    if not isinstance(model, nn.Module):
        raise LoopError(f"{caller}: `model` is an nn.Module, got {type(model).__name__}. Pass the model to run.")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise LoopError(f"{caller}: `epochs` is a positive int, got {epochs!r}. Pass epochs=1 or more.")
    if not isinstance(batches, Iterable):
        raise LoopError(
            f"{caller}: `batches` is an iterable of batches, got {type(batches).__name__}. "
            "Pass a DataLoader or a list of `(x, y)` pairs."
        )
    if epochs > 1 and isinstance(batches, Iterator):
        raise LoopError(
            f"{caller}: `batches` is iterated once per epoch, got a one-shot {type(batches).__name__} with "
            f"epochs={epochs}. Pass a re-iterable such as a list or a DataLoader."
        )


def _check_opt(opt: Any, caller: str) -> None:
    if not (callable(getattr(opt, "step", None)) and callable(getattr(opt, "zero_grad", None))):
        raise LoopError(
            f"{caller}: `opt` is an optimizer with `step()` and `zero_grad()`, got {type(opt).__name__}. "
            "Pass e.g. `torch.optim.SGD(model.parameters(), lr=0.1)`."
        )


def _total(batches: Any, epochs: int) -> int | None:
    try:
        return len(batches) * epochs
    except TypeError:
        return None


def _recorded(specs: tuple[Spec, ...] | None, model: nn.Module, caller: str,
              work: Callable[[], Any]) -> tuple[Any, Record]:
    """``work()`` inside a ``with_hooks`` block of `specs` (none: no block), and its Record."""
    if specs is None:
        return work(), EMPTY_RECORD
    with Run._make(model, specs, caller) as run:
        result = work()
    return result, run.record


# -- the generators ---------------------------------------------------------------------


def train_steps(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    opt: torch.optim.Optimizer,
    *,
    specs: Spec | Iterable[Spec] = (),
    epochs: int = 1,
    records: Records | None = None,
    caller: str = "train",
) -> Generator[Step, None, None]:
    """:func:`train` without the progress bar, with `records` saying which steps store.

    Arguments are checked (and specs resolved against the model) now; each step attaches
    the specs for its own duration.
    """
    _check_loop(model, batches, epochs, caller)
    _check_opt(opt, caller)
    run_specs = Run._make(model, specs, caller).specs
    return _train(model, batches, loss_fn, opt, run_specs or None, epochs, records, caller)


def _train(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    opt: Any,
    run_specs: tuple[Spec, ...] | None,
    epochs: int,
    records: Records | None,
    caller: str,
) -> Generator[Step, None, None]:
    iteration = 0
    for epoch in range(epochs):
        for index, batch in enumerate(batches):
            x, y = _pair(batch, index, caller)
            wanted = run_specs if records is None or records(iteration, True) else None
            with in_mode(model, True):
                loss, record = _recorded(wanted, model, caller, lambda: _step(model, x, y, loss_fn, opt))
            yield Step(epoch, iteration, loss, record, True)
            iteration += 1


def _step(model: nn.Module, x: Any, y: Any, loss_fn: Callable[[Any, Any], torch.Tensor], opt: Any) -> torch.Tensor:
    opt.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def train(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    opt: torch.optim.Optimizer,
    *,
    specs: Spec | Iterable[Spec] = (),
    epochs: int = 1,
    progress: bool | None = None,
) -> Iterator[Step]:
    """Train `model`, yielding one frozen :class:`Step` per batch.

    Each batch ``(x, y)`` runs ``opt.zero_grad()``, ``loss = loss_fn(model(x), y)``,
    ``loss.backward()``, ``opt.step()``. The specs are installed for the whole generator and
    removed when it is exhausted, raises, or is closed; each step's Record holds what they
    stored during that batch (forward and backward). The model is left in the train/eval
    mode it was in.

    Args:
        model: the model to train.
        batches: an iterable of ``(x, y)`` pairs, iterated once per epoch (a list or a
            DataLoader; a one-shot iterator only with ``epochs=1``).
        loss_fn: ``loss_fn(model(x), y)`` returns a scalar tensor.
        opt: the optimizer.
        specs: a Spec or an iterable of Specs to run on every step.
        epochs: how many times to go over `batches`.
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        A generator of Steps with ``training=True``; nothing runs until it is iterated.

    Raises:
        LoopError: for a bad model, optimizer, `epochs`, or a batch that is not a pair.
        SpecError, SelectorError: for bad specs, before anything runs.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> batches = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(3)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> steps = list(fh.train(model, batches, nn.functional.mse_loss, opt, specs=fh.outputs("0"), epochs=2))
        >>> [(s.epoch, s.iteration) for s in steps]
        [(0, 0), (0, 1), (0, 2), (1, 3), (1, 4), (1, 5)]
        >>> steps[0].record["0"]["output"].shape, steps[0].loss.requires_grad
        (torch.Size([8, 4]), False)
        >>> fh.testing.assert_no_hooks(model)
    """
    steps = train_steps(model, batches, loss_fn, opt, specs=specs, epochs=epochs)
    return _progress.wrap(steps, total=_total(batches, epochs), desc="train", progress=progress)


def evaluate(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    *,
    specs: Spec | Iterable[Spec] = (),
    progress: bool | None = None,
) -> Iterator[Step]:
    """Run `model` in eval mode without gradients, yielding one frozen :class:`Step` per batch.

    Args:
        model: the model.
        batches: an iterable of ``(x, y)`` pairs; without `loss_fn` a batch may also be the
            input ``x`` alone.
        loss_fn: ``loss_fn(model(x), y)``; None gives steps with ``loss=None``.
        specs: a Spec or an iterable of Specs to run on every batch.
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        A generator of Steps with ``training=False``, ``epoch=0`` and ``iteration`` the batch
        index. The model's train/eval mode is restored when it finishes.

    Raises:
        LoopError: for a bad model, or a batch that is not a pair where `loss_fn` needs one.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        >>> xs = [torch.ones(4, 3), torch.zeros(2, 3)]
        >>> steps = list(fh.evaluate(model, xs, specs=fh.outputs("1")))
        >>> [(s.iteration, s.training, s.loss) for s in steps]
        [(0, False, None), (1, False, None)]
        >>> steps[1].record["1"]["output"].shape, model.training
        (torch.Size([2, 2]), True)
    """
    _check_loop(model, batches, 1, "evaluate")
    run_specs = Run._make(model, specs, "evaluate").specs
    steps = _evaluate(model, batches, loss_fn, run_specs or None)
    return _progress.wrap(steps, total=_total(batches, 1), desc="evaluate", progress=progress)


def _evaluate(
    model: nn.Module, batches: Iterable[Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None,
    run_specs: tuple[Spec, ...] | None,
) -> Generator[Step, None, None]:
    for index, batch in enumerate(batches):
        if loss_fn is None:
            x = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch

            def work() -> None:
                model(x)
        else:
            x, y = _pair(batch, index, "evaluate")

            def work() -> torch.Tensor:
                return loss_fn(model(x), y).detach()
        with in_mode(model, False), torch.no_grad():
            loss, record = _recorded(run_specs, model, "evaluate", work)
        yield Step(0, index, loss, record, False)
