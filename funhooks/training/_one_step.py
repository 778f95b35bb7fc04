"""What one step of ``fh.train`` / ``fh.evaluate`` does, and the checks of their arguments.

The built-in training step is the hand-written loop: ``opt.zero_grad()``, then per
micro-batch ``loss_fn(model(x), y) / k`` and ``backward()``, then ``opt.step()``. A user's step
is any function ``step(model, batch)`` that does its own forward, backward, optimizer,
scaler, accumulation and clipping, and returns the loss, a mapping holding it under
``"loss"`` (the rest becomes the Step's ``metrics``), or None.

Cost: nothing beyond the step itself and a ``detach()`` of what it returns.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, Protocol, TypeAlias, cast

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import LoopError

from . import _batches
from .step import Metrics

__all__ = ["LossFn", "Optimizer", "Optimizers", "Outcome", "StepFn", "builtin_step", "check_loop", "check_start",
           "check_step", "empty", "evaluation", "outcome", "total"]

LossFn: TypeAlias = Callable[[Any, Any], torch.Tensor]
"""The built-in step's ``loss_fn(model(x), y)``: the model's output and the batch's target (the
user's own values) to a one-element tensor."""

StepFn: TypeAlias = Callable[[nn.Module, Any], Any]
"""A user's step ``step(model, batch)`` (the user's batch) returning the loss, a mapping
holding it under ``"loss"``, or None (see :func:`outcome`)."""

Outcome: TypeAlias = tuple[torch.Tensor | None, Metrics | None]
"""``(loss, metrics)`` of one step, detached."""


class Optimizer(Protocol):
    """What the built-in step calls: a ``torch.optim.Optimizer`` or a wrapper of one."""

    def zero_grad(self) -> object: ...

    def step(self) -> object: ...


Optimizers: TypeAlias = "Optimizer | Sequence[Optimizer]"
"""The optimizer a loop's watches read, or a list of them (see :func:`~funhooks.training.watch.optimizers`)."""


def check_loop(model: object, batches: object, epochs: object, caller: str) -> None:
    """The model, the batches and `epochs`, or a LoopError."""
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
    if total(batches, 1) == 0:
        raise empty(f"an empty {type(batches).__name__}", caller)


def empty(got: str, caller: str) -> LoopError:
    """The error for batches that give no batch in an epoch (`got` says how that was seen)."""
    return LoopError(
        f"{caller}: `batches` gives at least one batch per epoch, got {got}. Check the data set's length against "
        "the batch size (`drop_last=True` drops a last partial batch)."
    )


def check_start(start_iteration: object, caller: str) -> None:
    """The iteration of a run's first train step: a non-negative int, or a LoopError."""
    if isinstance(start_iteration, bool) or not isinstance(start_iteration, int) or start_iteration < 0:
        raise LoopError(
            f"{caller}: `start_iteration` is a non-negative int (the iteration of the first step), got "
            f"{start_iteration!r}. Pass the number of optimizer steps already trained, e.g. "
            "start_iteration=trainer_state['step']."
        )


def _check_opt(opt: object, caller: str) -> None:
    """An optimizer with ``step()`` and ``zero_grad()``, or a LoopError."""
    if not (callable(getattr(opt, "step", None)) and callable(getattr(opt, "zero_grad", None))):
        raise LoopError(
            f"{caller}: `opt` is an optimizer with `step()` and `zero_grad()`, got {type(opt).__name__}. "
            "Pass e.g. `torch.optim.SGD(model.parameters(), lr=0.1)`."
        )


def check_step(loss_fn: object, opt: object, step: object, accumulate: object, to_device: object, caller: str) -> None:
    """Either `loss_fn` and `opt` (the built-in step) or a user's `step`; the flags."""
    if step is not None:
        if not callable(step):
            raise LoopError(f"{caller}: `step` is a function `step(model, batch)`, got {step!r}. Pass a function.")
        if loss_fn is not None:
            raise LoopError(
                f"{caller}: a training step is `loss_fn` and `opt`, or your own `step=`, got both `loss_fn` and `step`. "
                "Compute the loss inside your step function."
            )
    else:
        if loss_fn is None:
            raise LoopError(
                f"{caller}: without `step=`, the built-in step needs `loss_fn` and `opt`, got loss_fn=None. "
                "Pass `loss_fn, opt`, or your own `step=fn(model, batch)`."
            )
        _check_opt(opt, caller)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise LoopError(f"{caller}: `accumulate` is a positive int (micro-batches per optimizer step), got "
                        f"{accumulate!r}. Pass accumulate=1 for one batch per step.")
    if not isinstance(to_device, bool):
        raise LoopError(f"{caller}: `to_device` is a bool, got {to_device!r}. Pass True to move batches to the "
                        "model's device.")


def total(batches: Iterable[object], epochs: int, accumulate: int = 1) -> int | None:
    """The number of steps, when `batches` has a length."""
    try:
        return -(-len(cast(Sized, batches)) // accumulate) * epochs
    except TypeError:
        return None


def builtin_step(model: nn.Module, batches: list[Any], start: int, loss_fn: LossFn, opt: Optimizer,
                 caller: str) -> torch.Tensor:
    """One optimizer step over `batches` (micro-batches; usually one): the mean detached loss."""
    pairs = [_batches.pair(b, start + i, caller) for i, b in enumerate(batches)]
    opt.zero_grad()
    if len(pairs) == 1:
        x, y = pairs[0]
        loss = _scalar(loss_fn(model(x), y), caller)
        loss.backward()
        opt.step()
        return loss.detach()
    losses = []
    for x, y in pairs:
        loss = _scalar(loss_fn(model(x), y), caller)
        (loss / len(pairs)).backward()
        losses.append(loss.detach())
    opt.step()
    return torch.stack(losses).mean()


def _scalar(loss: object, caller: str) -> torch.Tensor:
    """What `loss_fn` returned, when it is a one-element tensor; else a LoopError."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss
    got = (f"a Tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
           else f"{type(loss).__name__} {loss!r}")
    raise LoopError(
        f"{caller}: `loss_fn(model(x), y)` returns the loss as a one-element tensor, got {got}. Return the tensor "
        "itself (not `loss.item()`), reduced to one value (e.g. `reduction='mean'`)."
    )


def outcome(out: object, caller: str) -> Outcome:
    """``(loss, metrics)`` of what a user's step returned, detached."""
    if out is None:
        return None, None
    metrics = None
    loss = out
    if isinstance(out, Mapping):
        loss = out.get("loss")
        metrics = {k: _torch.map_tensors(torch.Tensor.detach, v) for k, v in out.items() if k != "loss"}
    if loss is None:
        return None, metrics
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach().reshape(()), metrics
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return torch.tensor(float(loss)), metrics
    got = f"a Tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
    raise LoopError(
        f"{caller}: `step` returns the loss (a 0-d tensor), a dict holding it under 'loss', or None, got {got}. "
        "Return the scalar loss your step backpropagated, e.g. `return loss`."
    )


def evaluation(model: nn.Module, batch: Any, index: int, loss_fn: LossFn | None, step: StepFn | None,
               caller: str) -> Callable[[], Outcome]:
    """The work of one evaluation batch: ``(loss, metrics)``."""
    if step is not None:
        return lambda: outcome(step(model, batch), caller)
    if loss_fn is None:
        x = batch[0] if isinstance(batch, (tuple, list)) and len(batch) == 2 else batch

        def forward() -> tuple[None, None]:
            model(x)
            return None, None

        return forward
    x, y = _batches.pair(batch, index, caller)
    return lambda: (_scalar(loss_fn(model(x), y), caller).detach(), None)
