"""Invariants of what flows through a model forward and back: every activation and gradient
is finite, and a gradient reaches every trainable parameter.

Both explain a failure with a probed pass (``_probe.Flow``): the gradient flowing out of
and back from every module call, and whether each call ran with gradients on and produced
finite values. That names the module that produced a NaN (finite inputs, non-finite
output; or finite output gradient, non-finite input gradient) or cut a gradient path
(never calls a module, calls it under ``torch.no_grad()``, drops or detaches its output,
passes no gradient back). Parameters' ``.grad`` are never touched; afterwards buffers,
train/eval modes and the random state are as before, and no hook is left.

Cost: per drawn input, one forward and one backward pass (``check_finite``: a probed one,
which copies every float input and output once); on failure, shrinking repeats that for
tens to hundreds of inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import SpecError, TransformError

from . import _invariant
from . import _probe

if TYPE_CHECKING:  # pragma: no cover - types only
    import hypothesis

__all__ = ["check_finite", "check_gradients_reach"]

_SEED = 0
"""The random seed every pass starts from (dropout draws the same masks each time)."""


def _forward_culprit(flow: _probe.Flow) -> tuple[str, str] | None:
    """``(path, kind)`` of the innermost module, first in module order, with a call whose
    inputs are finite and whose output is not."""
    found: dict[str, str] = {}
    for path, node in flow.record.items():
        for before, after in zip(node.calls("input_kind"), node.calls("output_kind")):
            if before is None and after is not None:
                found.setdefault(path, after)
    culprit = _invariant.innermost(list(found))
    return None if culprit is None else (culprit, found[culprit])


def _backward_culprit(flow: _probe.Flow) -> tuple[str, str] | None:
    """``(path, kind)`` of the innermost module, first in module order, that receives finite
    gradients at its output and passes a non-finite one to its inputs or parameters."""
    found: dict[str, str] = {}
    bad_params = {_probe.owner(n): k for n, g in flow.param_grads.items() if (k := _probe.kind([g])) is not None}
    for path in flow.record:
        for call, out in enumerate(flow.out_grads.get(path, [])):
            if _probe.kind(out) is not None:
                continue
            ins = flow.in_grads.get(path, [])
            kind = _probe.kind(ins[call]) if call < len(ins) else None
            if kind is None:
                kind = bad_params.get(path)
            if kind is not None:
                found.setdefault(path, kind)
    culprit = _invariant.innermost(list(found))
    return None if culprit is None else (culprit, found[culprit])


_FINITE_FIX = "Guard the operation (clamp what goes into `log` or `sqrt`, add an epsilon to a division)"


def check_finite(model: nn.Module, inputs: _invariant.Inputs, *, loss_fn: _probe.LossFn | None = None,
                 settings: hypothesis.settings | None = None, seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that no activation and no gradient is NaN or infinite, on drawn inputs.

    Every module's inputs and outputs are checked in the forward pass, and the gradient
    each module call receives and passes back in one backward pass of `loss_fn`. The
    blamed module is the innermost one that turns finite inputs into a non-finite output
    (``log`` of a negative, ``exp`` overflowing) or, backward, finite output gradients into
    a non-finite input gradient (``sqrt`` at 0).

    Args:
        model: the model, in the mode to check.
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors);
            example floats are drawn in ``[-3, 3]``, zeros and edges included.
        loss_fn: ``output -> scalar``; default: a fixed random projection of the outputs.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_finite: ...`` naming the value (``nan`` or
            ``inf``), forward or backward, and the module; then the shrunk input.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.Softplus(), nn.Linear(4, 1))
        >>> fh.testing.check_finite(model, torch.randn(2, 3))
    """
    caller = "check_finite"
    loss_fn = _probe.projection_loss if loss_fn is None else loss_fn

    with _invariant.preserved(model) as reset:
        def flow_of(draw: object) -> _probe.Flow:
            reset()
            torch.manual_seed(_SEED)
            return _probe.Flow(model, _invariant.as_args(draw), loss_fn)

        def fails(draw: object) -> bool:
            flow = flow_of(draw)
            grads = [g for by_path in (flow.out_grads, flow.in_grads) for calls in by_path.values()
                     for call in calls for g in call]
            return (_forward_culprit(flow) is not None
                    or _probe.kind([flow.loss, *grads, *flow.param_grads.values()]) is not None)

        draw = _invariant.search(_invariant.as_strategy(inputs, caller), fails, settings, seed)
        if draw is None:
            return
        flow = flow_of(draw)
    forward, backward = _forward_culprit(flow), _backward_culprit(flow)
    if forward is not None:
        found, fix = f"{forward[1]} in the output of module {flow.name(forward[0])}, whose inputs are finite", _FINITE_FIX
    elif _probe.kind([flow.loss]) is not None:
        found, fix = f"a loss of {_probe.kind([flow.loss])} from finite outputs", "Check `loss_fn`"
    elif backward is not None:
        found, fix = (f"{backward[1]} in the gradient that module {flow.name(backward[0])} passes back to its "
                      "inputs, from finite gradients at its output"), _FINITE_FIX
    else:
        found, fix = "a non-finite gradient of the model's output", "Check the backward of `loss_fn`"
    raise AssertionError(f"{caller}: every activation and gradient is finite, got {found}. {fix}.\n"
                         f"input: {_invariant.show(draw)}")


_NON_FINITE = "a non-finite gradient"


def _status(grad: torch.Tensor | None) -> str | None:
    """What is wrong with a parameter's gradient, or None."""
    if grad is None:
        return "no gradient"
    if _probe.kind([grad]) is not None:
        return _NON_FINITE
    if not bool((grad != 0).any()):
        return "a zero gradient"
    return None


def _cut(flow: _probe.Flow, path: str) -> tuple[str, str]:
    """``(culprit, reason)``: the module that keeps a gradient from the parameters of `path`."""
    name = flow.name(path)
    first_call = next((i for i, (p, _) in enumerate(flow.order) if p == path), None)
    if first_call is None:
        ran = next(a for a in _probe.ancestors(path) if a in flow.record)
        return ran, f"module {flow.name(ran)} never calls {name}"
    if not flow.grad_enabled(path):
        caller = next((a for a in _probe.ancestors(path) if flow.grad_enabled(a)), "")
        return caller, f"module {flow.name(caller)} calls {name} with gradients off (`torch.no_grad()`)"
    if flow.reached(path, 0):
        return path, (f"module {name} gets a gradient at its output but passes none to its parameters "
                      "(`torch.no_grad()`, `.detach()` or `.data` inside its forward)")
    reached = next((a for a in _probe.ancestors(path) if flow.reached(a, 0)), "")
    stops = [p for p, call in flow.order[first_call + 1:]
             if _invariant.is_inside(p, reached) and not _invariant.is_inside(p, path)
             and not _invariant.is_inside(path, p)
             and flow.reached(p, call) and flow.passes_back(p, call) is False]
    stop = _invariant.innermost(stops)
    if stop is not None:
        return stop, f"module {flow.name(stop)} gets a gradient at its output but passes none back to its input"
    return reached, f"module {flow.name(reached)} drops or detaches the output of {name}"


def check_gradients_reach(model: nn.Module, inputs: _invariant.Inputs, *, loss_fn: _probe.LossFn | None = None,
                          settings: hypothesis.settings | None = None, seed: int | None = _invariant.DRAW_SEED) -> None:
    """Check that backward passes give every trainable parameter a finite, non-zero gradient.

    It catches a branch cut by ``.detach()``, a forward left under ``torch.no_grad()``, a
    layer that is built but never called, a parameter multiplied by zero. A missing or zero
    gradient is judged across all draws (a ReLU gate closed on one input, an expert not
    routed to, fail nothing), a non-finite one on each draw. The message names the
    parameters and the module that cut their path: the one that never calls their module,
    calls it with gradients off, or drops, detaches or stops the gradient of its output.

    Args:
        model: the model, in the mode to check (``requires_grad`` parameters are checked).
        inputs: a Hypothesis strategy of inputs, or an example tensor (or tuple of tensors);
            example floats are drawn from a standard normal (zero inputs give zero weight
            gradients to a first linear layer), a mask stays the example's.
        loss_fn: ``output -> scalar``; default: a fixed random projection of the outputs.
        settings: Hypothesis settings; default: at most 25 examples, no deadline.
        seed: the seed of the draws, so a failure reproduces; None: new draws each call.

    Raises:
        AssertionError: first line ``check_gradients_reach: ...`` naming what the first
            failing parameter got and the module that cut its path; then the reason, every
            failing parameter and the input (the shrunk one for a non-finite gradient, the
            first drawn one for a gradient that no draw gives).
        SpecError: for a model without trainable parameters.
        TransformError: for a model sharded by FSDP2, whose shards autograd never sees.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> fh.testing.check_gradients_reach(model, torch.randn(8, 3))
    """
    caller = "check_gradients_reach"
    if any(_torch.is_fsdp_module(m) for m in model.modules()):
        raise TransformError(
            f"{caller}: the parameters checked are those autograd differentiates, got {type(model).__name__}, "
            "sharded by FSDP2, whose parameter shards autograd never sees (FSDP fills their `.grad` after the "
            "backward). Check the model before `fully_shard`."
        )
    loss_fn = _probe.projection_loss if loss_fn is None else loss_fn
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params:
        every = list(model.parameters())
        raise SpecError(
            f"{caller}: the model has trainable parameters (`requires_grad=True`) to check, got {type(model).__name__} "
            f"with {len(every)} parameter tensor(s) ({sum(p.numel() for p in every)} values), none trainable. "
            "Check a model with parameters, or make them trainable with `model.requires_grad_()`."
        )
    reached: set[str] = set()  # parameters with a finite, non-zero gradient on some draw
    drawn: list[object] = []

    with _invariant.preserved(model) as reset:
        def statuses(draw: object) -> list[tuple[str, str]]:
            """``(name, what is wrong)`` of every failing parameter, from a bare pass."""
            reset()
            torch.manual_seed(_SEED)
            with torch.enable_grad():
                loss = loss_fn(model(*_invariant.as_args(draw)))
                grads: Sequence[torch.Tensor | None] = [None] * len(params)
                if isinstance(loss, torch.Tensor) and loss.requires_grad:
                    grads = torch.autograd.grad(loss, [p for _, p in params], allow_unused=True)
            return [(n, s) for (n, _), g in zip(params, grads) if (s := _status(g)) is not None]

        def non_finite(draw: object) -> bool:
            drawn.append(draw)
            failing = dict(statuses(draw))
            reached.update(n for n, _ in params if n not in failing)
            return _NON_FINITE in failing.values()

        draw = _invariant.search(_invariant.as_strategy(inputs, caller, normal=True), non_finite, settings, seed)
        if draw is not None:
            failing = [(n, s) for n, s in statuses(draw) if s == _NON_FINITE]
            shown = f"input: {_invariant.show(draw)}"
        else:
            draw = drawn[0]
            failing = [(n, s) for n, s in statuses(draw) if n not in reached]
            shown = f"the same on all {len(drawn)} drawn inputs; the first one:\ninput: {_invariant.show(draw)}"
        if not failing:
            return
        reset()
        torch.manual_seed(_SEED)
        flow = _probe.Flow(model, _invariant.as_args(draw), loss_fn)
    name, status = failing[0]
    group = [n for n, s in failing if _probe.owner(n) == _probe.owner(name) and s == status]
    culprit = _backward_culprit(flow) if status == _NON_FINITE else None
    if culprit is not None:
        path, reason = culprit[0], f"module {flow.name(culprit[0])} passes back {culprit[1]}; see `check_finite`"
    else:
        path, reason = _cut(flow, _probe.owner(name))
    listed = "\n".join(f"{s}: {n!r}" for n, s in failing)
    raise AssertionError(
        f"{caller}: every trainable parameter gets a finite, non-zero gradient, got {status} for "
        f"{len(group)} parameter(s) of {flow.name(_probe.owner(name))}, cut in module {flow.name(path)}. "
        f"Look there for `.detach()`, `torch.no_grad()` or an output that is never used.\n{reason}\n"
        f"{listed}\n{shown}"
    )
