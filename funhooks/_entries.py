"""Entries: the small function a run calls for one (spec, module), built once per plan.

An entry does one spec's work on the hot path: the plain ``outputs`` entry is a
``detach()`` (skipped when there is no autograd history), a version-counter read and a list
append into the run's frame buffer. Observers get their hook arguments detached / gathered /
moved / cloned as flagged; editors return the replacement; ``grads`` registers tensor hooks
on the outputs. Spec functions that raise are re-raised as ``HookError`` naming the module.

Cost: one Python call per (spec, module call), plus the flagged tensor work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import _torch
from .errors import HookError, TransformError
from .spec import Spec

if TYPE_CHECKING:
    from .run import _Frame

__all__ = [
    "Slot",
    "backward_entry",
    "checks",
    "forward_entry",
    "forward_pre_entry",
    "param_entry",
]

Tensor = torch.Tensor
_SCALARS = (bool, int, float, complex, str)


def _gather(t: Tensor) -> Tensor:
    dist = torch.distributed
    if t.ndim == 0:
        t = t.clone()
        dist.all_reduce(t)
        return t / dist.get_world_size()
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=0)


def _preparer(spec: Spec) -> Callable[[Any], Any] | None:
    """The per-tensor transform a spec's flags ask for (detach, gather, cpu, clone)."""
    steps: list[Callable[[Tensor], Tensor]] = []
    if spec.detach:
        steps.append(Tensor.detach)
    if spec.gather:
        steps.append(lambda t: _gather(t) if _torch.is_distributed() else t)
    if spec.cpu:
        steps.append(Tensor.cpu)
    if spec.clone:
        steps.append(Tensor.clone)
    if not steps:
        return None

    def prep_tensor(t: Tensor) -> Tensor:
        for step in steps:
            t = step(t)
        return t

    def prep_leaf(x: Any) -> Any:
        return prep_tensor(x) if isinstance(x, Tensor) else x

    def prep(value: Any) -> Any:
        if isinstance(value, Tensor):
            return prep_tensor(value)
        if type(value) is tuple and all(isinstance(x, Tensor) for x in value):
            return tuple([prep_tensor(x) for x in value])  # the usual `args`, without pytree
        return _torch.tree_map(prep_leaf, value)

    return prep


def checks(value: Any) -> Any:
    """What the record needs to tell later whether `value` was changed in place."""
    if isinstance(value, Tensor):
        return value._version
    if value is None or isinstance(value, _SCALARS):
        return None
    if type(value) is tuple and all(isinstance(t, Tensor) for t in value):
        return tuple([(t, t._version) for t in value])  # the usual args, without a pytree walk
    return tuple([(t, t._version) for t in _torch.tree_leaves(value) if isinstance(t, Tensor)])


class Slot:
    """A value completed after it is appended: inputs (kwargs come later) and grads."""

    __slots__ = ("value", "parts", "treespec", "role")

    def __init__(self, value: Any = None, parts: list | None = None, treespec: Any = None, role: str = "") -> None:
        self.value, self.parts, self.treespec, self.role = value, parts, treespec, role

    def resolve(self) -> tuple[bool, Any]:
        if self.parts is None:
            return True, self.value
        if all(p is None for p in self.parts):
            return False, None
        if self.role == "grad_output":
            return True, tuple(self.parts)
        return True, _torch.pytree.tree_unflatten(self.parts, self.treespec)


def _hook_error(spec: Spec, path: str, err: Exception) -> HookError:
    where = repr(path) if path else "'' (the root)"
    return HookError(
        f"with_hooks: the function of {spec!r} raised {type(err).__name__} on module {where}: {err}. "
        "Fix the function; the model's hooks were removed."
    )


def forward_entry(spec: Spec, key: tuple[str, str | None]) -> Callable[..., Any]:
    prep, path = _preparer(spec), key[0]
    if spec.role == "output":
        if prep is not None and spec.detach and not (spec.cpu or spec.gather or spec.clone):

            def store_output(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
                if isinstance(output, Tensor):
                    # without autograd history, detach() would only make an alias
                    value = output.detach() if output.requires_grad else output
                    frame.buffer.append((key, value, value._version))
                else:
                    value = prep(output)
                    frame.buffer.append((key, value, checks(value)))

            return store_output

        def store_any(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            value = output if prep is None else prep(output)
            frame.buffer.append((key, value, checks(value)))

        return store_any

    if spec.role == "input":

        def finish_input(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            slot = frame.pending.pop()
            if slot is not None and kwargs:
                value = kwargs if prep is None else prep(kwargs)
                slot.value = (slot.value[0], value)
                frame.extra_checks.append((key, checks(value)))

        return finish_input

    if spec.role in ("grad", "grad_output"):

        def watch_grad(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if not torch.is_grad_enabled():
                return
            leaves, treespec = _torch.pytree.tree_flatten(output)
            wanted = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
            if not wanted:
                return
            if _torch.is_functorch_active():
                raise TransformError(
                    f"with_hooks: {spec!r} needs autograd's backward, got it inside a torch.func transform "
                    f"at module {path!r}. Use `fh.activation_grads(model, where, loss_fn)` for gradients "
                    "of activations under `grad`/`vmap`."
                )
            if spec.role == "grad_output":
                leaves = [t for t in leaves if isinstance(t, Tensor)]
                wanted = [i for i, t in enumerate(leaves) if t.requires_grad]
            slot = Slot(parts=[None] * len(leaves), treespec=treespec, role=spec.role)
            for i in wanted:
                leaves[i].register_hook(_grad_hook(frame, slot, i, prep))
            frame.buffer.append((key, slot, None))

        return watch_grad

    fn = spec.fn
    assert fn is not None
    if spec.is_edit:

        def edit_output(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            try:
                return fn(module, args, output)
            except Exception as err:
                raise _hook_error(spec, path, err) from err

        return edit_output

    def observe_output(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if prep is not None:
            args, output = prep(args), prep(output)
        try:
            value = fn(module, args, output)
        except Exception as err:
            raise _hook_error(spec, path, err) from err
        frame.buffer.append((key, value, checks(value)))

    return observe_output


def _grad_hook(frame: _Frame, slot: Slot, i: int, prep: Callable[[Any], Any] | None) -> Callable[[Tensor], None]:
    def on_grad(grad: Tensor) -> None:
        if frame.open and frame.active:
            slot.parts[i] = grad if prep is None else prep(grad)  # type: ignore[index]

    return on_grad


def forward_pre_entry(spec: Spec, key: tuple[str, str | None]) -> Callable[..., Any]:
    """Called with the module's `kwargs` by a wrapped forward, with None by the global
    forward-pre hook (which gets none: keyword inputs are then completed after the call)."""
    prep = _preparer(spec)
    if spec.role == "input":

        def store_input(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict | None) -> None:
            value = args if prep is None else prep(args)
            if kwargs is None:
                slot = Slot((value, {}))
                frame.pending.append(slot)
                frame.buffer.append((key, slot, checks(value)))
                return
            frame.pending.append(None)  # complete already: nothing for `finish_input` to do
            if kwargs:
                kwargs = kwargs if prep is None else prep(kwargs)
                frame.buffer.append((key, (value, kwargs), checks((value, kwargs))))
            else:
                frame.buffer.append((key, (value, {}), checks(value)))

        return store_input

    def call_pre(frame: _Frame, module: nn.Module, args: tuple, kwargs: dict | None) -> Any:
        return _call(spec, key, prep, frame, module, (args,))

    return call_pre


def _call(spec: Spec, key: tuple[str, str | None], prep: Callable[[Any], Any] | None, frame: _Frame,
          first: Any, hook_args: tuple) -> Any:
    """Call ``spec.fn(first, *hook_args)``: return an editor's result, store an observer's."""
    if not (spec.is_edit or prep is None):
        hook_args = tuple([prep(a) for a in hook_args])
    try:
        value = spec.fn(first, *hook_args)  # type: ignore[misc]
    except Exception as err:
        raise _hook_error(spec, key[0], err) from err
    if spec.is_edit:
        return value
    frame.buffer.append((key, value, checks(value)))
    return None


def backward_entry(spec: Spec, key: tuple[str, str | None], frame: _Frame) -> Callable[..., Any]:
    """A full backward (pre) hook for `frame`: PyTorch's semantics, registered per module."""
    prep = _preparer(spec)

    def call_backward(module: nn.Module, *grads: Any) -> Any:
        return _call(spec, key, prep, frame, module, grads) if frame.open and frame.active else None

    return call_backward


def param_entry(spec: Spec, key: tuple[str, str | None], param: nn.Parameter, frame: _Frame) -> Callable[..., Any]:
    """A gradient hook on `param` for `frame`: ``fn(param, grad)``."""
    prep = _preparer(spec)

    def call_param(grad: Tensor) -> Any:
        return _call(spec, key, prep, frame, param, (grad,)) if frame.open and frame.active else None

    return call_param
