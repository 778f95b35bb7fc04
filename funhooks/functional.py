"""Pure functions of a model and specs: ``capture`` and ``functional``.

``capture(model, specs)`` returns ``f(*args, **kwargs) -> (output, Record)``: the Record is
built from inside the call and *returned*, never stored by side effect, so the function
composes with ``torch.func`` (``vmap`` returns batched Records, ``grad(..., has_aux=True)``
returns gradients plus Records) and with ``torch.compile`` (the dispatcher is traced, no
graph breaks for observers). ``functional`` is the same with the parameters passed in, via
``torch.func.functional_call``.

Cost: a capture function holds the global forward dispatcher hook for as long as it is
alive (so that ``torch.compile`` never sees a hook being registered); while it is held,
every module call in the process goes through PyTorch's hook path and one empty loop.
Under ``torch.compile`` and ``torch.func`` transforms stored tensors are copies (the
in-place check of eager runs reads version counters, which a compiled graph and ``vmap``'s
batched tensors do not keep), so stored values stay right when an in-place op follows.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from . import _torch
from . import run as _run
from .errors import SpecError, TransformError
from .record import Record
from .select import resolve
from .spec import Spec

__all__ = ["capture", "functional"]

_BACKWARD_EVENTS = ("backward_pre", "backward", "param_grad")
_BACKWARD_ROLES = ("grad", "grad_output")
_HOOK_KINDS = ("forward", "forward_pre")


def _backward_error(specs: tuple[Spec, ...], caller: str) -> TransformError | None:
    """The error for a backward-event spec, raised when the function is called."""
    for spec in specs:
        if spec.event in _BACKWARD_EVENTS or spec.role in _BACKWARD_ROLES:
            return TransformError(
                f"{caller}: a pure function returns its Record when the forward pass ends, so "
                f"backward events (`grads`, `backward`, `backward_pre`, `param_grad`) never reach it "
                f"and module backward hooks do not run under `vmap`/`grad`, got {spec!r}. Use "
                "`fh.activation_grads(model, where, loss_fn)` for gradients of activations, or "
                "`fh.with_hooks` around an eager `backward()`."
            )
    return None


def _check_hookable(model: nn.Module, specs: tuple[Spec, ...], caller: str) -> None:
    """Refuse selections whose hooks would never fire: TorchScript and fx-inlined modules."""
    called: set[str] | None = None
    inner = _torch.unwrap(model)
    if isinstance(inner, torch.fx.GraphModule):
        called = {"", *(str(n.target) for n in inner.graph.nodes if n.op == "call_module")}
    scripted = [p for p, m in _torch.named_modules(inner) if isinstance(m, torch.jit.ScriptModule)]
    for spec in specs:
        for path, _ in resolve(spec.where, inner, caller=caller, spec=spec):
            if any(path.startswith(f"{s}.") for s in scripted):
                raise TransformError(
                    f"{caller}: hooks on modules inside a TorchScript module never fire, got module "
                    f"{path!r} selected by {spec!r}. Hook the eager model before scripting it."
                )
            if called is not None and path not in called:
                raise TransformError(
                    f"{caller}: fx inlined module {path!r} into the GraphModule's code, so hooks on it "
                    f"never fire, got it selected by {spec!r}; the called modules are {sorted(called)}. "
                    "Hook the eager model, or keep the module a leaf when tracing."
                )


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


class _Recorder:
    """Specs resolved on a model, able to record one call of any function of it.

    Holds the global dispatcher hooks for its own lifetime (released by a finalizer), so
    that a call, traced by dynamo or not, only pushes a frame on the active-run stack.
    """

    def __init__(self, model: nn.Module, specs: tuple[Spec, ...], caller: str) -> None:
        self.model, self.specs, self.caller = model, specs, caller
        self.inner = _torch.unwrap(model)
        _check_hookable(model, specs, caller)
        self.plan = _run._Plan.get(self.inner, specs, caller)
        self.copy_plan = _run._Plan.get(self.inner, self.plan.copy_specs(), caller)
        self.has_backward = _backward_error(specs, caller) is not None
        # the forward-pre hook only when a spec needs it: every hold slows every model
        kinds = _HOOK_KINDS if self.plan.forward_pre else _HOOK_KINDS[:1]
        for kind in kinds:
            _run.acquire(kind)
            weakref.finalize(self, _run.release, kind)
        if self.plan.compiled:  # submodules compiled on their own must retrace the dispatcher
            _run.hold_forever(kinds)

    def __call__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[Any, Record]:
        if self.has_backward:
            raise _backward_error(self.specs, self.caller)  # type: ignore[misc]
        compiling = _torch.is_compiling()
        copies = compiling or self.plan.compiled or _torch.is_functorch_active()
        plan = self.copy_plan if copies else self.plan
        if not compiling and plan.generation != _run._GENERATION[0]:
            self.plan = plan = _run._Plan.get(self.inner, self.specs, self.caller)
            self.copy_plan = _run._Plan.get(self.inner, self.plan.copy_specs(), self.caller)
        frame = _run._Frame(plan)
        frame.open = True
        _run._STACK.append(frame)
        try:
            out = fn(*args, **kwargs)
        finally:
            frame.open = False
            _run._STACK.remove(frame)
        if copies:  # version counters are not kept by graphs and vmap; stored values are copies
            record = _run._build(frame.buffer, [], plan, self.caller, copies=True)
        else:
            record = _run._build(frame.buffer, frame.extra_checks, plan, self.caller)
        if _torch.is_functorch_active():
            _check_leaves(record, self.caller)
        return out, record


def _prepare(model: Any, specs: Spec | Iterable[Spec], caller: str) -> _Recorder:
    model = _run._check_model(model, caller)
    return _Recorder(model, _run._as_specs(specs, caller), caller)


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
        ``(output, Record)``.

    Raises:
        TransformError: (when called) for backward-event specs, or a non-tensor stored value
            under a ``torch.func`` transform; (at once) for a TorchScript model or modules
            whose hooks would never fire (inside TorchScript, inlined by fx).
        SpecError: for things that are not specs; SelectorError for a selector matching nothing.

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

    # a model compiled before this function existed never runs the dispatcher hook: run
    # the eager model (compile the capture function itself for speed)
    target = recorder.inner

    def captured(*args: Any, **kwargs: Any) -> tuple[Any, Record]:
        return recorder(target, args, kwargs)

    captured._recorder = recorder  # type: ignore[attr-defined]  # keeps the hooks alive with f
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
        for attr, tensor in [*module._parameters.items(), *module._buffers.items()]:
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


def _merge_params(params: Any, caller: str) -> dict[str, torch.Tensor]:
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
    names = [(_run._GENERATION[0], _slots(recorder.inner))]

    def call(params: dict[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
        return torch.func.functional_call(recorder.inner, params, args, kwargs, tie_weights=False, strict=False)

    def functionally(params: Any, *args: Any, **kwargs: Any) -> tuple[Any, Record]:
        merged = _merge_params(params, "functional")
        if names[0][0] != _run._GENERATION[0]:
            names[0] = (_run._GENERATION[0], _slots(recorder.inner))
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
        return recorder(call, (slotted, args, kwargs), {})

    functionally._recorder = recorder  # type: ignore[attr-defined]
    return functionally
