"""Entries: the small function a run calls for one (spec, module), built once per plan.

An entry does one spec's work on the hot path. Each function here makes the entry of one
``(hook, role)`` of a spec, from ``(spec, key, rank, copies)``; ``hooked`` chooses it from its
table when the plan is made (`copies`: the entry stores private copies, inside compiled
graphs and transforms, where no version counter can be kept). The plain ``outputs`` entry
is a ``detach()`` (skipped without autograd history), a version-counter read and a list
append into the frame's buffer. Observers get their hook arguments detached / gathered /
moved / cloned as flagged; editors return the replacement, checked against what it
replaces; interventions apply through one counted helper (:func:`intervention`), on a
module or on an op; ``grads`` registers tensor hooks on the outputs (removed when the run
exits); backward events go through PyTorch's per-call ``BackwardHook``, set up only for the
calls the run sees.

While a spec's own function runs, its run sees no module call, so a function that calls the
model again cannot recurse into its own hooks. Its exceptions come
back as one ``HookError`` naming the spec and the module.

Cost: one Python call per (spec, module call), plus the flagged tensor work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn

from funhooks import _torch
from funhooks.errors import (
    ExtraError,
    HookError,
    LoopError,
    RecordError,
    ReducerError,
    SelectorError,
    SpecError,
    StaleTensorError,
    TransformError,
)
from funhooks.specs.selector import path_label
from funhooks.specs.spec import Spec

from .frame import Frame, GradSlot
from .types import Check, Key
from .values import copies_of, preparer, snapshot, unchecked

__all__ = ["BackwardEntry", "PostEntry", "PreEntry", "args_call_entry", "args_intervene_entry", "backward_entry",
           "call_spec", "checked_edit", "grads_entry", "inputs_entry", "intervention", "output_call_entry",
           "output_entry", "output_intervene_entry", "param_hook"]

_V = TypeVar("_V")
_OWN_ERRORS = (ExtraError, LoopError, RecordError, ReducerError, SelectorError, SpecError, StaleTensorError,
               TransformError)
"""funhooks' own errors, raised by its own spec functions: their message already says what to do."""


# -- calling a spec's function ------------------------------------------------------------------


def _hook_error(caller: str, spec: Spec, path: str, err: Exception) -> HookError:
    if isinstance(err, _OWN_ERRORS):  # funhooks' own function: its message says what to do
        return HookError(f"{caller}: {spec!r} stopped at module {path_label(path)}: {err}")
    return HookError(
        f"{caller}: the function of {spec!r} raised {type(err).__name__} on module {path_label(path)}: {err}. "
        "Fix the function; the model's hooks were removed."
    )


def call_spec(frame: Frame, spec: Spec, path: str, args: tuple) -> Any:
    """``spec.fn(*args)``, its errors as one HookError. While it runs, its own frame sees no
    module call (``frame.calling``), so a function calling the model cannot recurse."""
    frame.calling += 1
    try:
        return spec.fn(*args)  # type: ignore[misc]  # called for specs with a function only
    except HookError:
        raise
    except Exception as err:
        raise _hook_error(frame.caller, spec, path, err) from err
    finally:
        frame.calling -= 1


def _describe(value: object) -> str:
    if isinstance(value, Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value)})"
    return f"a {type(value).__name__}"


def _fits(old: object, new: object) -> bool:
    """Whether an editor's `new` value has the structure and tensor shapes of `old`."""
    if isinstance(old, Tensor) or isinstance(new, Tensor):
        return isinstance(old, Tensor) and isinstance(new, Tensor) and old.shape == new.shape
    a, sa = _torch.flatten(old)
    b, sb = _torch.flatten(new)
    if len(a) != len(b) or sa[0] != sb[0]:
        return False
    return all(_fits(x, y) if isinstance(x, Tensor) or isinstance(y, Tensor) else True for x, y in zip(a, b))


def checked_edit(frame: Frame, spec: Spec, path: str, what: str, old: object, new: _V) -> _V:
    """`new`, an editor's value for `old`, when it has the structure and shapes of `old` (or is None)."""
    if new is None or _fits(old, new):
        return new
    raise HookError(
        f"{frame.caller}: an editor returns a value with the structure and shapes of the {what} it replaces "
        f"(or None), got {_describe(new)} from {spec!r} on module {path_label(path)}, where the {what} is "
        f"{_describe(old)}. Return a value shaped like the {what}."
    )


# -- the entries -------------------------------------------------------------------------------

PreEntry = Callable[[Frame, nn.Module, tuple, dict], "tuple | None"]
"""A forward-pre entry: ``(frame, module, args, kwargs)``; an editor returns the new args, or None."""
PostEntry = Callable[[Frame, nn.Module, tuple, dict, object], object]
"""A forward entry: ``(frame, module, args, kwargs, output)``; an editor returns the new output,
or None (the output: whatever the module returned)."""
BackwardEntry = Callable[[Frame], Callable[..., object]]
"""A backward entry: given a frame, the hook PyTorch's ``BackwardHook`` calls."""
_Intervene = Callable[[Frame, Any], Any]
"""An intervention applied to one value: ``(frame, value) -> the new value``."""


def _storer(copies: bool) -> Callable[[object], tuple[object, Check]]:
    """How an entry stores a value: with its in-place check, or (`copies`) as a private copy."""
    return unchecked if copies else snapshot


def intervention(value: Any, spec: Spec, key: Key, rank: int) -> _Intervene:
    """`spec`'s intervention `value` (``specs.interventions``) on the module at ``key[0]``, the
    `rank`-th its selector matched, applied to one value with the frame's per-call values; it
    counts the calls it applied to in the frame (a Record source holding several calls gives
    call k to the k-th). The one helper of every intervention entry, on a module or an op."""
    apply, path = value.apply, key[0]

    def intervene(frame: Frame, edited: object) -> object:
        count = frame.counts.get(intervene, 0)
        frame.counts[intervene] = count + 1
        return apply(edited, spec, path, rank, count, frame.values, frame.caller)

    return intervene


# forward-pre: ``(hook, role)`` = ("forward_pre", "input" | "call" | "intervene")


def inputs_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PreEntry:
    """Store the inputs, args and kwargs (`copies`: a private copy, no version to check)."""
    if copies and not spec.gather:
        return copies_of(spec, key, pre=True)
    prep, store = preparer(spec), _storer(copies)

    def store_input(frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> None:
        value = args if prep is None else prep(args)
        named = (kwargs if prep is None else prep(kwargs)) if kwargs else {}
        frame.buffer.append((key, *store((value, named))))

    return store_input


def args_call_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PreEntry:
    """``fn(module, args)``: an editor's result replaces the args, an observer's is stored."""
    prep, path, store = preparer(spec), key[0], _storer(copies)
    if spec.is_edit:

        def edit_args(frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            new = call_spec(frame, spec, path, (module, args))
            if new is not None and not isinstance(new, tuple):
                new = (new,)
            return checked_edit(frame, spec, path, "args", args, new)

        return edit_args

    def observe_args(frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> None:
        value = call_spec(frame, spec, path, (module, args if prep is None else prep(args)))
        frame.buffer.append((key, *store(value)))

    return observe_args


def args_intervene_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PreEntry:
    """An intervention on the positional arguments (a standard point that is a module's input)."""
    apply = intervention(spec.action, spec, key, rank)

    def intervene_args(frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        return apply(frame, args)

    return intervene_args


# forward: ``(hook, role)`` = ("forward", "output" | "call" | "intervene"), ("output_grad", "grad" | "grad_output")


def output_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PostEntry:
    """Store the output (`copies`: a private copy, no version to check). The plain
    ``fh.outputs`` store, the common case, is :func:`values._detach_only` and a snapshot."""
    if copies and not spec.gather:
        return copies_of(spec, key, pre=False)
    prep, store = preparer(spec), _storer(copies)
    if prep is None:

        def store_as_is(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            frame.buffer.append((key, *store(output)))

        return store_as_is

    def store_output(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        frame.buffer.append((key, *store(prep(output))))

    return store_output


def output_call_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PostEntry:
    """``fn(module, args, output)``: an editor's result replaces the output, an observer's is stored."""
    path = key[0]
    if spec.is_edit:

        def edit_output(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
            new = call_spec(frame, spec, path, (module, args, output))
            return checked_edit(frame, spec, path, "output", output, new)

        return edit_output
    return _observer(spec, key, _storer(copies))


def _observer(spec: Spec, key: Key, store: Callable[[object], tuple[object, Check]]) -> PostEntry:
    fn, prep, path = cast(Callable[..., Any], spec.fn), preparer(spec), key[0]  # an observer: a spec with a function

    def observe_output(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if prep is not None:
            args, output = prep(args), prep(output)
        frame.calling += 1  # `call_spec`, inlined: this entry runs on every call of every observed module
        try:
            value = fn(module, args, output)
        except HookError:
            raise
        except Exception as err:
            raise _hook_error(frame.caller, spec, path, err) from err
        finally:
            frame.calling -= 1
        if store is snapshot and isinstance(value, Tensor):
            try:
                frame.buffer.append((key, value, value._version))
                return
            except RuntimeError:  # an inference tensor
                pass
        frame.buffer.append((key, *store(value)))

    return observe_output


def output_intervene_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PostEntry:
    """An intervention on the module's output."""
    apply = intervention(spec.action, spec, key, rank)

    def intervene_output(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        return apply(frame, output)

    return intervene_output


def grads_entry(spec: Spec, key: Key, rank: int, copies: bool) -> PostEntry:
    """Watch the gradient of the output (``grads``; fastai's ``grad_output`` keeps the tensors
    as a tuple): tensor hooks fill a ``GradSlot`` stored now."""
    prep, path, as_tuple = preparer(spec), key[0], spec.role == "grad_output"

    def watch_grad(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        if not torch.is_grad_enabled():
            return
        leaves, structure = _torch.flatten(output)
        if as_tuple:  # fastai's grad_output: the tensors, as a tuple
            leaves = [t for t in leaves if isinstance(t, Tensor)]
        wanted = [i for i, t in enumerate(leaves) if isinstance(t, Tensor) and t.requires_grad]
        if not wanted:
            return
        if frame.level:
            raise _no_backward(frame, spec, path)
        slot = GradSlot(len(leaves), structure, as_tuple)
        for i in wanted:
            frame.grad_hooks.append(leaves[i].register_hook(slot.hook(frame, i, prep)))
        frame.buffer.append((key, slot, None))

    return watch_grad


def _no_backward(frame: Frame, spec: Spec, path: str) -> TransformError:
    return TransformError(
        f"{frame.caller}: {spec!r} needs autograd's backward, got it inside a torch.func transform "
        f"at module {path_label(path)}. Use `fh.activation_grads(model, where, loss_fn)` for gradients "
        "of activations under `grad`/`vmap`."
    )


# backward: ``(hook, role)`` = ("backward" | "backward_pre", "call")


def backward_entry(spec: Spec, key: Key, rank: int, copies: bool) -> BackwardEntry:
    """For a ``backward`` / ``backward_pre`` spec: given a frame, the hook PyTorch's
    ``BackwardHook`` calls with ``(module, grad_input, grad_output)`` or ``(module, grad_output)``."""
    prep, path = preparer(spec), key[0]
    what = "grad_input" if spec.event == "backward" else "grad_output"

    def for_frame(frame: Frame) -> Callable[..., object]:
        def on_backward(module: nn.Module, *grads: Tensor | None) -> object:
            if not frame.open:
                frame.late.add(key)
                return None
            if spec.is_edit:
                new = call_spec(frame, spec, path, (module, *grads))
                return checked_edit(frame, spec, path, what, grads[0], new)
            if prep is not None:
                grads = tuple([prep(g) for g in grads])
            frame.buffer.append((key, *snapshot(call_spec(frame, spec, path, (module, *grads)))))
            return None

        return on_backward

    return for_frame


def param_hook(spec: Spec, key: Key, param: Tensor, frame: Frame) -> Callable[[Tensor], Tensor | None]:
    """A gradient hook on `param` for `frame`: ``fn(param, grad)``."""
    prep, path = preparer(spec), key[0]

    def on_grad(grad: Tensor) -> Tensor | None:
        if not frame.open:
            return None
        if spec.is_edit:
            return checked_edit(frame, spec, path, "gradient", grad, call_spec(frame, spec, path, (param, grad)))
        value = call_spec(frame, spec, path, (param, grad if prep is None else prep(grad)))
        frame.buffer.append((key, *snapshot(value)))
        return None

    return on_grad
