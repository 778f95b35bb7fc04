"""Pure functions of a model and specs: ``capture`` and ``functional``.

``capture(model, specs)`` returns ``f(*args, **kwargs) -> (output, Record)``: the Record is
built from inside the call and *returned*, never stored by side effect, so the function
composes with ``torch.func`` (``vmap`` returns batched Records, ``grad(..., has_aux=True)``
returns gradients plus Records) and with ``torch.compile`` (dynamo traces the recording: no
graph break for observers). ``functional`` is the same with the parameters passed in, via
``torch.func.functional_call``.

A call is its own scope: it attaches the plan for the duration of the call, sees only the
module calls it makes (calls of the model in other threads meanwhile, and runs open around
it, see nothing of it), so a capture function can be called from many threads at once, each
call's Record holding exactly its own calls. Between calls nothing is attached to anything.

Cost: per call, what a ``with_hooks`` block costs (wrapping the hooked modules for the call).
Under ``torch.compile`` and ``torch.func`` transforms stored tensors are copies (the in-place
check of eager runs reads version counters, which a compiled graph and ``vmap``'s batched
tensors do not keep), so stored values stay right when an in-place op follows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import InterventionError, SpecError, TransformError
from funhooks.records.record import Record
from funhooks.specs.spec import Spec

from ._core import Attached, Frame, Plan, scope, trace
from .run import as_specs, check_model

__all__ = ["CaptureFunction", "capture", "functional"]

_R = TypeVar("_R")
_Params = Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]]
"""What ``functional``'s `params` may be: a dict of names to tensors, or several such dicts."""

def _backward_error(specs: tuple[Spec, ...], caller: str) -> TransformError | None:
    """The error for a backward-event spec, raised when the function is called."""
    for spec in specs:
        if spec.needs_backward:
            return TransformError(
                f"{caller}: a pure function returns its Record when the forward pass ends, so "
                f"backward events (`grads`, `backward`, `backward_pre`, `param_grad`) never reach it "
                f"and module backward hooks do not run under `vmap`/`grad`, got {spec!r}. Use "
                "`fh.activation_grads(model, where, loss_fn)` for gradients of activations, or "
                "`fh.with_hooks` around an eager `backward()`."
            )
    return None


def _check_leaves(record: Record, caller: str) -> None:
    for path, node in record.items():
        for name in node:
            for value in node.calls(name):
                for leaf in _torch.tree_leaves(value):
                    if not isinstance(leaf, torch.Tensor):
                        raise TransformError(
                            f"{caller}: under a torch.func transform every stored value is a tensor "
                            f"or a pytree of tensors, got {type(leaf).__name__} {leaf!r} in {name!r} "
                            f"of module {path!r}. Return tensors from the spec's function (e.g. "
                            "`torch.tensor(value)`), or run it outside the transform."
                        )


class CaptureFunction:
    """Specs resolved on a model, able to record one call of any function of it.

    Each call attaches the plan for itself only (a frame of its own, in a scope of its own)
    and detaches it before returning; traced by dynamo, the attaching is traced too and
    nothing of it exists when the compiled graph runs.
    """

    def __init__(self, model: nn.Module, specs: tuple[Spec, ...], caller: str) -> None:
        self.model, self.specs, self.caller = model, specs, caller
        self.inner = _torch.unwrap(model)
        self.plan = Plan.get(self.inner, specs, caller)
        self.plan.traced()  # built now: building it while dynamo traces a call would be traced too
        self.backward = _backward_error(specs, caller)
        self.args = self.plan.args  # the keyword arguments that are per-call values, not the model's
        _check_args(self.inner, self.args, specs, caller)

    def split(self, kwargs: dict[str, object]) -> tuple[dict[str, object], dict[str, object]]:
        """`kwargs` as (the model's, the per-call values); every per-call value must be there."""
        if not self.args:
            return kwargs, {}
        missing = [name for name in self.args if name not in kwargs]
        if missing:
            spec = next(s for s in self.specs if missing[0] in s.args)
            raise InterventionError(
                f"{self.caller}: every `fh.arg` of the specs is a keyword argument of the call, got none for "
                f"{missing} (read by {spec!r}). Call it as `f(..., {missing[0]}=value)`."
            )
        values = {name: kwargs.pop(name) for name in self.args}
        return kwargs, values

    def current(self) -> Plan:
        """The plan for the model as it is now (rebuilt after a structure change)."""
        return self.plan if _torch.is_compiling() else self._fresh()

    def _fresh(self) -> Plan:
        """:meth:`current`, where dynamo is known not to be tracing."""
        if not self.plan.current():  # current: the common case, no lock
            self.plan = Plan.get(self.inner, self.specs, self.caller)
        return self.plan

    def __call__(self, fn: Callable[..., _R], args: tuple, kwargs: dict,
                 values: dict[str, object] | None = None) -> tuple[_R, Record]:
        if self.backward is not None:
            raise self.backward
        if _torch.is_compiling():
            if _torch.TRACES_RECORDING:
                return self._traced(fn, args, kwargs, values)
            # dynamo cannot trace it on this torch: the same recording, in a frame dynamo skips
            return torch.compiler.disable(self._traced)(fn, args, kwargs, values)
        plan = self._fresh()
        if values:
            plan.check_values(values, self.caller)
        frame = Frame(plan, self.caller, values=values)
        attached = Attached(plan, frame, copies=bool(frame.level))
        token = scope.swap((frame,))
        try:
            out = fn(*args, **kwargs)
        finally:
            scope.reset(token)
            attached.detach()
            frame.close()
        frame.check()
        record = frame.record()
        if frame.level:
            _check_leaves(record, self.caller)
        return out, record

    def _traced(self, fn: Callable[..., _R], args: tuple, kwargs: dict,
                values: dict[str, object] | None) -> tuple[_R, Record]:
        frame = Frame(self.plan, self.caller, 0, values)
        out = trace.record(fn, self.inner, self.plan.traced(), [frame], args, kwargs)
        frame.check()
        frame.buffer = [(key, value, None) for key, value, _ in frame.buffer]  # copies: nothing to check
        record = frame.record()
        if _torch.is_functorch_active():
            _check_leaves(record, self.caller)
        return out, record


def _check_args(model: nn.Module, names: tuple[str, ...], specs: tuple[Spec, ...], caller: str) -> None:
    """A per-call value may not take a keyword argument the model's forward takes."""
    try:
        taken = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature: nothing to compare
        return
    for name in names:
        param = taken.get(name)
        if param is not None and param.kind not in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            spec = next(s for s in specs if name in s.args)
            raise SpecError(
                f"{caller}: an `fh.arg` name is a keyword argument for the specs alone, got {name!r} in {spec!r}, "
                f"which {type(model).__name__}.forward takes too. Rename it, e.g. `fh.arg({name + '_value'!r})`."
            )


def _prepare(model: object, specs: Spec | Iterable[Spec], caller: str) -> CaptureFunction:
    model = check_model(model, caller)
    return CaptureFunction(model, as_specs(specs, caller), caller)


def capture(model: nn.Module, specs: Spec | Iterable[Spec]) -> Callable[..., tuple[Any, Record]]:
    """Turn `model` and `specs` into a pure function ``f(*args, **kwargs) -> (output, Record)``.

    The Record is returned, not stored, so ``f`` composes with ``torch.func.vmap`` (the
    Record comes back batched, equal to the stacked per-example Records),
    ``torch.func.grad(..., has_aux=True)``, ``jacrev``, ``jvp`` and ``torch.compile``.
    Nothing stays attached to the model between calls.

    Args:
        model: the model to call. Wrappers (DDP, DataParallel, ``torch.compile``) are
            looked through and the inner model is called eagerly: compile the returned
            function instead, ``torch.compile(fh.capture(model, specs))``.
        specs: a Spec or an iterable of forward-event Specs (observers and editors).

    Returns:
        ``f(*args, **kwargs)`` calling ``model(*args, **kwargs)`` and returning
        ``(output, Record)``. Keyword arguments named by the specs' ``fh.arg``
        placeholders are the specs' per-call values, not the model's: ``f(x, pos=3)``
        (``vmap`` over them, through a function taking them positionally, runs a sweep).

    Raises:
        TransformError: (when called) for backward-event specs, or a non-tensor stored value
            under a ``torch.func`` transform; (at once) for a TorchScript model or modules
            whose hooks would never fire (inside TorchScript, inlined by fx).
        SpecError: for things that are not specs, or an ``fh.arg`` name the model's
            ``forward`` takes too; SelectorError for a selector matching nothing.
        InterventionError: (when called) for a per-call value not given.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> f = fh.capture(model, fh.outputs("0"))
        >>> out, rec = torch.func.vmap(f)(torch.randn(5, 3))
        >>> out.shape, rec["0"]["output"].shape
        (torch.Size([5, 1]), torch.Size([5, 4]))
    """
    recorder = _prepare(model, specs, "capture")

    def captured(*args: object, **kwargs: object) -> tuple[Any, Record]:
        kwargs, values = recorder.split(kwargs)
        # a model compiled before this function existed: its wrapper is looked through and
        # the model runs eagerly (compile the capture function itself for speed)
        return recorder(recorder.inner, args, kwargs, values)

    return captured


def _slots(model: nn.Module) -> tuple[frozenset[str], dict[str, str], dict[str, list[str]]]:
    """Parameter names, each known name -> its slot's first name, and tied names per slot.

    A module used at two paths is one slot (``torch.func.functional_call`` would swap it
    twice and leave a transformed tensor behind); one tensor held by two modules is two
    slots that must receive the same value.
    """
    canonical: dict[str, str] = {}
    first_of_slot: dict[tuple[int, str], str] = {}
    first_of_tensor: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        for attr, tensor in [*_torch.own_parameters(module).items(), *_torch.own_buffers(module).items()]:
            if tensor is None:
                continue
            full, slot = prefix + attr, (id(module), attr)
            if slot in first_of_slot:
                canonical[full] = first_of_slot[slot]
                continue
            first_of_slot[slot] = canonical[full] = full
            owner = first_of_tensor.setdefault(id(tensor), full)
            if owner != full:
                canonical[full] = owner
                tied.setdefault(owner, []).append(full)
    required = frozenset(canonical[n] for n, _ in model.named_parameters())
    return required, canonical, tied


def _merge_params(params: object, caller: str) -> dict[str, torch.Tensor]:
    if isinstance(params, Mapping):
        return dict(params)
    if isinstance(params, (tuple, list)) and all(isinstance(p, Mapping) for p in params):
        merged: dict[str, torch.Tensor] = {}
        for part in params:
            merged.update(part)
        return merged
    raise SpecError(
        f"{caller}: `params` is a dict of parameter and buffer names to tensors (or a tuple of "
        f"such dicts), got {type(params).__name__}. Pass `dict(model.named_parameters())`."
    )


def functional(model: nn.Module, specs: Spec | Iterable[Spec]) -> Callable[..., tuple[Any, Record]]:
    """Like :func:`capture`, with the parameters as an argument: ``f(params, *args, **kwargs)``.

    The model runs through ``torch.func.functional_call`` with `params` in place of its own
    parameters and buffers, so ``torch.func.grad`` and ``vmap`` can differentiate and batch
    over them (per-example gradients plus per-example Records with
    ``vmap(grad(loss, has_aux=True), in_dims=(None, 0))``).

    Args:
        model: the model (wrappers are looked through; names are those of the inner model).
        specs: a Spec or an iterable of forward-event Specs.

    Returns:
        ``f(params, *args, **kwargs) -> (output, Record)``. `params` maps names of
        ``model.named_parameters()`` (all of them) and optionally of
        ``model.named_buffers()`` to tensors; buffers not given are the model's own.
        Per-call values (``fh.arg``) are keyword arguments, as for :func:`capture`.

    Raises:
        SpecError: (when called) when `params` misses parameters or has unknown names; the
            message lists both.
        TransformError: as for :func:`capture`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 2), nn.Tanh())
        >>> f = fh.functional(model, fh.outputs("0"))
        >>> params = {k: torch.zeros_like(v) for k, v in model.named_parameters()}
        >>> out, rec = f(params, torch.ones(1, 3))
        >>> rec["0"]["output"]
        tensor([[0., 0.]])
    """
    recorder = _prepare(model, specs, "functional")
    names = [(recorder.plan, _slots(recorder.inner))]

    def call(params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> object:
        return torch.func.functional_call(recorder.inner, params, args, kwargs, tie_weights=False, strict=False)

    def functionally(params: _Params, *args: object, **kwargs: object) -> tuple[Any, Record]:
        kwargs, values = recorder.split(kwargs)
        merged = _merge_params(params, "functional")
        plan = recorder.current()
        if names[0][0] is not plan:  # the model's structure changed: its names may have too
            names[0] = (plan, _slots(recorder.inner))
        required, canonical, tied = names[0][1]
        slotted = {canonical.get(k, k): v for k, v in merged.items()}
        for owner, others in tied.items():
            if owner in slotted:
                slotted.update(dict.fromkeys(others, slotted[owner]))
        if not _torch.is_compiling():
            missing, unexpected = sorted(required - set(slotted)), sorted(set(merged) - set(canonical))
            if missing or unexpected:
                raise SpecError(
                    f"functional: `params` names every parameter of {type(recorder.inner).__name__} "
                    f"(buffers optional) and nothing else, got missing {missing} and unexpected "
                    f"{unexpected}. Build it from `dict(model.named_parameters())`."
                )
        return recorder(call, (slotted, args, kwargs), {}, values)

    return functionally
