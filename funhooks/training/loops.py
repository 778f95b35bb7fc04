"""Training and evaluation as generators of frozen :class:`~funhooks.Step` values.

``train`` is the hand-written PyTorch loop turned inside out: each optimizer step yields a
``Step`` holding its epoch, iteration, detached loss and the Record the specs (and optimizer
watches) stored. The step itself is the built-in one (``zero_grad``, forward, ``loss_fn``,
``backward``, ``step``) or yours: ``step=fn(model, batch)`` does forward, backward, optimizer,
scaler, accumulation and clipping as your research code does, and returns the loss. Batches
are any pytree (``(x, y)`` pairs, dicts for ``model(**batch)``), moved to the model's device
with ``to_device=True``, grouped ``accumulate`` at a time into one step. Anything that watches
training, such as activation statistics, is a fold over those values (see
:mod:`funhooks.training.folds`) instead of a callback mutating a trainer.

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
from typing import cast

import torch
from torch import nn

from funhooks._modes import in_mode
from funhooks.errors import LoopError
from funhooks.specs.spec import Spec

from . import _batches
from . import _one_step
from .progress import wrap
from ._one_step import LossFn, Optimizer, Optimizers, Outcome, StepFn
from .recorder import Recorder
from .step import EMPTY_RECORD, Step
from .watch import OptimizerWatch, as_watches

__all__ = ["evaluate", "train", "train_steps"]

_Records = Callable[[int, bool], bool]
"""``records(iteration, training) -> bool``: whether a step's record is read by anyone."""


def train_steps(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn | None,
    opt: Optimizers | None,
    *,
    step: StepFn | None = None,
    specs: Spec | Iterable[Spec] = (),
    watches: OptimizerWatch | Iterable[OptimizerWatch] = (),
    epochs: int = 1,
    accumulate: int = 1,
    to_device: bool = False,
    records: _Records | None = None,
    start_iteration: int = 0,
    caller: str = "train",
    held: bool = False,
) -> Generator[Step, None, None]:
    """:func:`train` without the progress bar, with `records` saying which steps store.

    Arguments are checked (specs resolved against the model, watches' layers found) now;
    each step attaches the specs and watches for its own duration, or with `held` (``fit``,
    whose steps are read by nothing but its reducers) one recording stays attached from step
    to step, paused between them, until the generator ends (:meth:`Recorder.held`; then
    :meth:`Recorder.abort`).
    """
    _one_step.check_loop(model, batches, epochs, caller)
    _one_step.check_step(loss_fn, opt, step, accumulate, to_device, caller)
    _one_step.check_start(start_iteration, caller)
    watches = as_watches(watches, caller)
    if watches and opt is None:
        raise LoopError(f"{caller}: `watches` read the optimizer step, got no optimizer. Pass `opt=` (the "
                        "optimizer your `step` function calls).")
    recorder = Recorder(model, specs, watches, opt, caller)
    # without `step`, check_step made sure of both; with it, neither is called
    builtin = cast(LossFn, loss_fn), cast(Optimizer, opt)
    steps = _train(model, batches, builtin, step, recorder, held, epochs, accumulate, to_device, records,
                   start_iteration, caller)
    return _ending(steps, recorder) if held else steps


def _ending(steps: Generator[Step, None, None], recorder: Recorder) -> Generator[Step, None, None]:
    """`steps`, then the recording :meth:`Recorder.held` kept open stopped, however they end."""
    try:
        yield from steps
    finally:
        recorder.abort()


def _train(model: nn.Module, batches: Iterable[object], builtin: tuple[LossFn, Optimizer], step: StepFn | None,
           recorder: Recorder, held: bool, epochs: int, accumulate: int, to_device: bool, records: _Records | None,
           iteration: int, caller: str) -> Generator[Step, None, None]:
    loss_fn, opt = builtin
    device = _batches.model_device(model) if to_device else None
    walked = recorder.walked  # one walk a step serves the loop and the recording
    for epoch in range(epochs):
        start = 0
        for group in (_batches.group(batches, accumulate) if accumulate > 1 else ([b] for b in batches)):
            if device is not None:
                group = [_batches.to_device(b, device) for b in group]

            def run(group: list[object] = group, start: int = start) -> Outcome:
                if step is None:
                    return _one_step.builtin_step(model, group, start, loss_fn, opt, caller), None
                return _one_step.outcome(step(model, group[0] if accumulate == 1 else group), caller)
            modules = walked()
            with in_mode(model, True, modules):
                if records is None or records(iteration, True):
                    (loss, metrics), record = recorder.held(run, modules) if held else recorder.step(run, modules)
                else:
                    (loss, metrics), record = run(), EMPTY_RECORD
            yield Step(epoch, iteration, loss, record, True, metrics)
            del record
            iteration += 1
            start += len(group)
        if start == 0:
            raise _one_step.empty(f"none in epoch {epoch} from a {type(batches).__name__}", caller)


def train(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn | None = None,
    opt: Optimizers | None = None,
    *,
    step: StepFn | None = None,
    specs: Spec | Iterable[Spec] = (),
    watches: OptimizerWatch | Iterable[OptimizerWatch] = (),
    epochs: int = 1,
    accumulate: int = 1,
    to_device: bool = False,
    start_iteration: int = 0,
    progress: bool | None = None,
) -> Iterator[Step]:
    """Train `model`, yielding one frozen :class:`~funhooks.Step` per optimizer step.

    The built-in step, for ``(x, y)`` batches: ``opt.zero_grad()``, ``loss = loss_fn(model(x),
    y)``, ``loss.backward()``, ``opt.step()`` (with ``accumulate=k``: ``loss / k`` backward for
    each of k micro-batches, one ``opt.step()``; the Step's loss is their mean). Your own step,
    ``step=fn(model, batch)``, does all of that itself (autocast, a ``GradScaler``, clipping, a
    scheduler, ``model(**batch).loss``) and returns the loss, a dict holding it under
    ``"loss"`` (the rest becomes ``Step.metrics``), or None; with ``accumulate=k`` it gets a list
    of k micro-batches. The specs and watches are attached for each step and removed when it
    ends; each Step's Record holds what they stored during that step (every micro-batch). The
    model is left in the train/eval mode it was in.

    Args:
        model: the model to train.
        batches: an iterable of batches, iterated once per epoch (a list or a DataLoader; a
            one-shot iterator only with ``epochs=1``): ``(x, y)`` pairs for the built-in step,
            any pytree for yours.
        loss_fn: ``loss_fn(model(x), y)`` returns a scalar tensor (the built-in step).
        opt: the optimizer (the built-in step's; with your `step`, the one it calls, needed
            only by optimizer watches).
        step: your training step ``step(model, batch)``; None: the built-in one.
        specs: a Spec or an iterable of Specs to run on every step.
        watches: an :class:`~funhooks.OptimizerWatch` or an iterable of them, read at every
            optimizer step of `opt`.
        epochs: how many times to go over `batches`.
        accumulate: batches per optimizer step (micro-batches, one Step).
        to_device: move every tensor of each batch to the model's device first.
        start_iteration: the ``iteration`` of the first Step; resuming a run, the number of
            optimizer steps already trained, so that steps number on from the first run's
            (and the reducers' ``every`` rule and ``merge`` see the global iteration).
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        A generator of Steps with ``training=True``; nothing runs until it is iterated.

    Raises:
        LoopError: for a bad model, optimizer, `epochs`, `accumulate`, `start_iteration`, a
            step that is both or neither built-in and yours, `batches` that give no batch in an
            epoch (an empty DataLoader: now; a one-shot iterable: when it ends), a batch that is
            not a pair for the built-in step, a `loss_fn` that returns no one-element tensor, or
            a step returning something that is not a loss.
        SpecError, SelectorError: for bad specs or watches, before anything runs.

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
        >>> def my_step(model, batch):                # any step your research code has
        ...     opt.zero_grad()
        ...     loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
        ...     loss.backward()
        ...     opt.step()
        ...     return {"loss": loss, "scale": torch.tensor(2.0)}
        >>> dicts = [{"x": x, "y": y} for x, y in batches]
        >>> steps = list(fh.train(model, dicts, step=my_step, specs=fh.outputs("0"), to_device=True))
        >>> len(steps), steps[0].record["0"]["output"].shape, float(steps[0].metrics["scale"])
        (3, torch.Size([8, 4]), 2.0)
        >>> fh.testing.assert_no_hooks(model)
    """
    steps = train_steps(model, batches, loss_fn, opt, step=step, specs=specs, watches=watches, epochs=epochs,
                        accumulate=accumulate, to_device=to_device, start_iteration=start_iteration)
    return wrap(steps, total=_one_step.total(batches, epochs, accumulate), desc="train", progress=progress)


def evaluate(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn | None = None,
    *,
    step: StepFn | None = None,
    specs: Spec | Iterable[Spec] = (),
    to_device: bool = False,
    progress: bool | None = None,
) -> Iterator[Step]:
    """Run `model` in eval mode without gradients, yielding one frozen :class:`~funhooks.Step` per batch.

    Args:
        model: the model.
        batches: an iterable of batches: ``(x, y)`` pairs; without `loss_fn` and `step`, a
            batch may also be the input ``x`` alone.
        loss_fn: ``loss_fn(model(x), y)``; None (and no `step`) gives steps with ``loss=None``.
        step: your evaluation step ``step(model, batch)``, returning the loss, a dict holding
            it under ``"loss"``, or None; it runs under ``torch.no_grad()``.
        specs: a Spec or an iterable of Specs to run on every batch.
        to_device: move every tensor of each batch to the model's device first.
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        A generator of Steps with ``training=False``, ``epoch=0`` and ``iteration`` the batch
        index. The model's train/eval mode is restored when it finishes.

    Raises:
        LoopError: for a bad model, `batches` that give no batch, a batch that is not a pair
            where `loss_fn` needs one, or a `loss_fn` that returns no one-element tensor.

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
    _one_step.check_loop(model, batches, 1, "evaluate")
    if step is not None and not callable(step):
        raise LoopError(f"evaluate: `step` is a function `step(model, batch)`, got {step!r}. Pass a function.")
    recorder = Recorder(model, specs, (), None, "evaluate")
    steps = _evaluate(model, batches, loss_fn, step, recorder, to_device)
    return wrap(steps, total=_one_step.total(batches, 1), desc="evaluate", progress=progress)


def _evaluate(model: nn.Module, batches: Iterable[object], loss_fn: LossFn | None, step: StepFn | None,
              recorder: Recorder, to_device: bool) -> Generator[Step, None, None]:
    device = _batches.model_device(model) if to_device else None
    index = -1
    for index, batch in enumerate(batches):
        if device is not None:
            batch = _batches.to_device(batch, device)
        run = _one_step.evaluation(model, batch, index, loss_fn, step, "evaluate")
        with in_mode(model, False), torch.no_grad():
            (loss, metrics), record = recorder.step(run)
        yield Step(0, index, loss, record, False, metrics)
    if index < 0:
        raise _one_step.empty(f"none from a {type(batches).__name__}", "evaluate")
