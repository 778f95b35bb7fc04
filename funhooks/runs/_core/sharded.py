"""Gradients of FSDP2-sharded parameters, for ``param_grad`` specs.

``fully_shard`` (FSDP2) keeps each parameter as a ``DTensor`` shard between passes. For a
forward it all-gathers the shards into a plain *unsharded* parameter, which autograd
differentiates; after the backward it reduce-scatters that gradient into the shard's
``.grad``: each rank holds its shard of the gradient averaged over the ranks, which is what
the optimizer steps with. A hook on the sharded parameter never fires, so a run watches it
in two steps:

1. while the FSDP module that manages the parameter runs its forward (a run's wrapped
   forward runs inside FSDP's hooks, with the unsharded parameters in place), a gradient
   hook goes on the unsharded parameter, once per run and tensor;
2. when that hook fires, the shard's ``.grad`` is noted, and a callback runs once the
   backward pass is over, after FSDP's own final callback has finished the reduce-scatters.
   It gives each spec ``fn(param, grad)`` the sharded parameter and the gradient this
   backward added to its ``.grad``, a ``DTensor`` shard: editors first, their result is put
   in ``.grad`` (the optimizer sees it), then observers, which see the edited value
   (``gather=True`` stores ``grad.full_tensor()``, the full gradient, on every rank).

Where ``.grad`` already holds a gradient (accumulation without ``zero_grad``), FSDP adds to it
in place; the run hands FSDP a copy to add to instead, so a ``.grad`` an observer stored
earlier keeps its value, and the difference is this backward's part.

A backward that does not reduce (``set_requires_gradient_sync(False)``) adds nothing to the
shards: the specs run at the next backward that does, with the gradient accumulated since.
Both the forward and the backward must run inside the block.

Cost: per run and unsharded parameter, one tensor hook; per backward pass, one callback per
watching FSDP module; where ``.grad`` already holds a gradient, a copy of the shard and a
subtraction.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import HookError, TransformError
from funhooks.specs.selector import path_label
from funhooks.specs.spec import Spec

from .entries import call_spec, checked_edit
from .frame import Frame
from .types import Check, Key, Pending, WatchState
from .values import Prep, preparer

__all__ = ["Param", "Watch", "managers", "shard_of"]


def managers(modules: list[tuple[str, nn.Module]]) -> Callable[[str], tuple[str, nn.Module] | None]:
    """For a module path, the FSDP2 module that all-gathers the parameters there: the nearest
    at or above it; None without one (a ``DTensor`` parameter of tensor parallelism, which
    autograd differentiates itself). The modules are listed on the first call."""
    found: dict[str, nn.Module] | None = None

    def manager(path: str) -> tuple[str, nn.Module] | None:
        nonlocal found
        if found is None:
            found = {p: m for p, m in modules if _torch.is_fsdp_module(m)}
        while True:
            module = found.get(path)
            if module is not None:
                return path, module
            if not path:
                return None
            path = path.rpartition(".")[0]

    return manager


def shard_of(manager: nn.Module, param: torch.Tensor) -> torch.Tensor | None:
    """The ``DTensor`` shard behind `param` of a module `manager` shards: `param` itself between
    passes; the shard it was all-gathered from when FSDP left it unsharded (after a forward
    without backward, as under ``no_grad``, the root keeps its parameters unsharded); None
    for a parameter FSDP ignores."""
    if _torch.is_dtensor(param):
        return param
    return next((s for _, s, u in _torch.fsdp_parameters(manager) if u is param), None)


class Param:
    """One sharded parameter and the specs watching it (editors first)."""

    __slots__ = ("__weakref__", "name", "owner", "path", "preps", "sharded", "specs")

    def __init__(self, path: str, owner: nn.Module, name: str, sharded: torch.Tensor) -> None:
        self.path, self.name = path, name
        self.owner, self.sharded = weakref.ref(owner), weakref.ref(sharded)
        self.specs: list[tuple[Spec, Key]] = []
        self.preps: list[Prep | None] = []

    def add(self, spec: Spec, key: Key) -> None:
        at = 0 if spec.is_edit else len(self.specs)
        self.specs.insert(at, (spec, key))
        # a gradient has no autograd history to detach from, and a DTensor's `detach()` would
        # give a local tensor whose version counter the Record's in-place check cannot follow
        self.preps.insert(at, preparer(attrs.evolve(spec, detach=False)))


class Watch:
    """The sharded parameters one FSDP module manages that ``param_grad`` specs watch; its
    :meth:`entry` is a forward-pre entry of the module's wrapped forward."""

    __slots__ = ("params", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self.params: dict[int, Param] = {}

    def param(self, path: str, owner: nn.Module, name: str, sharded: torch.Tensor) -> Param:
        found = self.params.get(id(sharded))
        if found is None:
            found = self.params[id(sharded)] = Param(path, owner, name, sharded)
        return found

    def entry(self, frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Hook the unsharded parameters in place now (FSDP's pre-forward put them there)."""
        if not torch.is_grad_enabled():
            return
        if frame.level:
            raise TransformError(
                f"{frame.caller}: `param_grad` specs on FSDP-sharded parameters need autograd's backward, got module "
                f"{path_label(self.path)} called inside a torch.func transform. Run the sharded model outside transforms."
            )
        if frame.watches is None:
            frame.watches = {}
        state = frame.watches.get(id(self))
        if state is None:
            state = frame.watches[id(self)] = WatchState()
        for param in self.params.values():
            owner = param.owner()
            tensor = None if owner is None else _torch.own_parameters(owner).get(param.name)
            if tensor is None or tensor is param.sharded() or not tensor.requires_grad:
                continue
            if state.hooked.get(id(param)) is not tensor:
                state.hooked[id(param)] = tensor
                frame.grad_hooks.append(tensor.register_hook(self._on_grad(frame, state, param)))

    def _on_grad(self, frame: Frame, state: WatchState, param: Param) -> Callable[[torch.Tensor], None]:
        def on_unsharded_grad(grad: torch.Tensor) -> None:
            if not frame.open:
                return
            pass_id = _torch.backward_pass()
            if pass_id != state.pass_id:
                state.pass_id, state.pending = pass_id, {}
                pending = state.pending
                _torch.after_backward(lambda: self._finish(frame, pending))
            if param not in state.pending:
                sharded: Any = param.sharded()  # a DTensor
                old = None if sharded is None else sharded.grad
                if old is not None:  # FSDP will add to `.grad` in place: let it add to a copy, and keep `old`
                    sharded.grad = copy = old.clone()
                    state.pending[param] = (old, copy, copy.to_local()._version)
                else:
                    state.pending[param] = None

        return on_unsharded_grad

    def _finish(self, frame: Frame, pending: dict[object, Pending | None]) -> None:
        """After the backward pass: run the specs on what it added to each shard's ``.grad``."""
        if not frame.open:
            return
        for param in self.params.values():  # in module order, not the backward's
            if param not in pending:
                continue
            before = pending[param]
            sharded: Any = param.sharded()  # a DTensor
            grad = _added(None if sharded is None else sharded.grad, before)
            if grad is None:
                continue
            edited = _run_specs(frame, param, sharded, grad)
            if edited is not None:
                sharded.grad = edited if before is None else before[0] + edited


def _added(grad: Any, before: Pending | None) -> Any:
    """What this backward pass added to a shard's ``.grad`` (`before`: what it held, see
    :data:`Pending`); None when it has none, or nothing was added yet (not reduced in this pass,
    without gradient sync)."""
    if grad is None or before is None:
        return grad
    old, copy, version = before
    if grad is copy and grad.to_local()._version == version:
        return None
    return grad - old


def _run_specs(frame: Frame, param: Param, sharded: Any, grad: Any) -> Any:
    """Each spec of `param` on `grad`, editors first (observers see the edited gradient): the
    edited gradient, or None when no editor changed it."""
    edited = None
    for (spec, key), prep in zip(param.specs, param.preps):
        if spec.is_edit:
            new = call_spec(frame, spec, param.path, (sharded, grad))
            new = checked_edit(frame, spec, param.path, "gradient", grad, new)
            if new is not None:
                _check_sharded(frame, spec, param.path, grad, new)
                grad = edited = new
            continue
        value = call_spec(frame, spec, param.path, (sharded, grad if prep is None else prep(grad)))
        frame.buffer.append((key, value, _versions(value)))
    return edited


def _versions(value: object) -> Check:
    """The Record's in-place check of a stored value. A DTensor has two version counters: its
    own moves with DTensor ops (``grad.zero_()``), its local tensor's with ops on that tensor
    (FSDP's accumulation), so both are read."""
    tensors = []
    for t in _torch.tensor_leaves(value):
        tensors.append(t)
        if _torch.is_dtensor(t):
            tensors.append(t.to_local())  # type: ignore[attr-defined]
    return tuple([(t, t._version) for t in tensors]) if tensors else None


def _check_sharded(frame: Frame, spec: Spec, path: str, old: Any, new: Any) -> None:
    """`old` and `new` are DTensors (or `new` is what the editor returned)."""
    if _torch.is_dtensor(new) and new.placements == old.placements and new.device_mesh == old.device_mesh:
        return
    got = f"DTensor with placements {tuple(new.placements)}" if _torch.is_dtensor(new) else type(new).__name__
    raise HookError(
        f"{frame.caller}: an editor of an FSDP-sharded parameter's gradient returns a DTensor placed like the "
        f"gradient ({tuple(old.placements)}), got a {got} from {spec!r} for parameter {path_label(path)}. Compute "
        "the new gradient from `grad` with DTensor ops (e.g. `grad * scale`, `grad.clamp(-c, c)`)."
    )
