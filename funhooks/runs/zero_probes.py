"""Functional activation gradients: zero probes added to outputs, differentiated by torch.func.

``activation_grads(model, where, loss_fn)`` returns ``f(*args, **kwargs) -> (loss, Record)``
whose Record holds, per selected module and call, its ``"output"`` and ``"grad"`` (d loss /
d output). A zero tensor (the *probe*) is added to each selected output, and
``torch.func.grad`` differentiates the loss with respect to the probes, which is the
gradient with respect to the outputs. No backward hook is involved, so ``f`` works under
``vmap`` (per-example activation gradients) and when in-place ops follow the module.

Cost: two forward passes and one backward pass per call. The first forward, without
gradients, finds the outputs' shapes for the probes; it runs on copies of the buffers and
with the random state restored afterwards, so batch-norm statistics are updated once and
dropout draws what a plain call would draw. Each pass gets copies of the tensor arguments,
so ``f`` never changes them in place. Build ``f`` once and call it many times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import TransformError
from funhooks.records.record import Record
from funhooks.specs.selector import Where, resolve
from funhooks.specs.spec import Located, edit

from .pure import CaptureFunction
from .run import check_model

__all__ = ["Probes", "activation_grads"]

_V = TypeVar("_V")
_CALLER = "activation_grads"
_NO_TIES = {"strict": False, "tie_weights": False}


class _Pass:
    """One forward pass's probe state: discovered outputs, or the probes to add."""

    def __init__(self, probes: list[torch.Tensor] | None, layout: dict[str, list[list[int | None]]] | None,
                 caller: str, element: int | str | None = None) -> None:
        self.probes, self.layout, self.caller, self.element = probes, layout, caller, element
        self.outputs: dict[str, list[object]] = {}
        self.slots: dict[str, list[list[int | None]]] = {}  # discovery: probe index per leaf

    def visit(self, path: str, output: object) -> object:
        calls = self.outputs.setdefault(path, [])
        calls.append(output)
        leaves, treespec = _torch.pytree.tree_flatten(output)
        if self.probes is None:
            probed = _probed(output, self.element)
            self.slots.setdefault(path, []).append(
                [0 if isinstance(t, torch.Tensor) and t.is_floating_point() and id(t) in probed else None
                 for t in leaves]
            )
            return output
        layout = self.layout.get(path, []) if self.layout is not None else []
        if len(calls) > len(layout) or len(layout[len(calls) - 1]) != len(leaves):
            raise TransformError(
                f"{self.caller}: every selected module runs the same way in both forward passes, got module "
                f"{path!r} called {len(calls)} time(s) with {len(leaves)} output(s) where the first pass "
                f"saw {[len(c) for c in layout]}. Make the model's control flow deterministic."
            )
        slots = layout[len(calls) - 1]
        for t, i in zip(leaves, slots):
            if i is not None and t.shape != self.probes[i].shape:
                raise TransformError(
                    f"{self.caller}: every selected module runs the same way in both forward passes, got module "
                    f"{path!r} giving a value of shape {tuple(t.shape)} where the first pass saw "
                    f"{tuple(self.probes[i].shape)}. Pass inputs of the same shape to both passes."
                )
        new = [t if i is None else t + self.probes[i] for t, i in zip(leaves, slots)]
        return _torch.pytree.tree_unflatten(new, treespec)


class _Prober:
    """The edit spec's function: routes each selected module's output (or, as a ``forward_pre``
    editor, its positional arguments) to the current pass."""

    def __init__(self, paths: dict[int, str], caller: str) -> None:
        self.paths, self.caller = paths, caller
        self.passes: list[_Pass] = []

    def __call__(self, module: nn.Module, args: tuple, *output: object) -> object:
        value = output[0] if output else args
        if not self.passes:
            return value
        return self.passes[-1].visit(self.paths[id(module)], value)


def _probed(output: object, element: int | str | None) -> set[int]:
    """The ids of the leaves of `output` to probe: all of them, or those of its item `element`
    (none when it has no such item: the caller says so when it reads the point)."""
    item = output
    if element is not None and not isinstance(output, torch.Tensor):
        try:
            item = output[element]  # type: ignore[index]
        except (TypeError, KeyError, IndexError):
            return set()
    return {id(t) for t in _torch.tree_leaves(item)}


def _tensors(outputs: dict[str, list[object]]) -> dict[str, list[list[torch.Tensor]]]:
    """The tensor leaves of each call's value: what may leave a ``torch.func`` transform (a
    ``None`` item or a cache object may not)."""
    return {path: [[t for t in _torch.tree_leaves(out) if isinstance(t, torch.Tensor)] for out in calls]
            for path, calls in outputs.items()}


def _rebuilt(output: object, tensors: list[torch.Tensor]) -> object:
    """`output`'s structure with its tensor leaves taken from `tensors` in order, and its other
    leaves (``None``, a cache object) None."""
    leaves, treespec = _torch.pytree.tree_flatten(output)
    given = iter(tensors)
    return _torch.pytree.tree_unflatten([next(given) if isinstance(t, torch.Tensor) else None for t in leaves],
                                        treespec)


def _copies(tree: _V) -> _V:
    """Tensor arguments copied, so an in-place first layer changes neither the caller's
    tensors nor the second pass's inputs (and ``torch.func.grad`` allows it)."""
    return _torch.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


class _State:
    """A model's parameters and buffers by name, read once per call of the function built
    (one walk of the modules, not one per pass); one name per slot: ``functional_call`` would
    swap a shared module's slot twice."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = dict(model.named_buffers())
        self.params = dict(model.named_parameters())

    def buffer_copies(self) -> dict[str, torch.Tensor]:
        return {n: b.clone() for n, b in self.buffers.items()}

    def keep(self, buffers: dict[str, torch.Tensor]) -> None:
        """Write a pass's buffers (batch-norm statistics it updated) back into the model's."""
        with torch.no_grad():
            for name, buffer in self.buffers.items():
                if buffers[name] is not buffer:
                    buffer.copy_(buffers[name])


class Probes:
    """Zero probes on the outputs (or, with ``event="forward_pre"``, the positional inputs) of
    the modules `where` selects, or on a standard point's value (`where` a
    :class:`~funhooks.specs.spec.Located`: the values are named by the point's Record paths).

    ``discover`` runs a forward without gradients and finds what to probe (the values it saw
    are kept); ``differentiate`` runs a forward with probes of those shapes added and
    differentiates ``loss_fn`` of the model's output with respect to them. ``activation_grads``
    runs both on the same arguments; attribution patching runs the first on the clean input
    and the second on the corrupted one. With `element`, only the item `element` of a tuple,
    list or dict value is probed (the other items get no probe and no gradient).

    With `detached`, outside ``torch.func`` transforms the gradient is taken by plain
    autograd (``torch.autograd.grad`` with respect to the probes, the parameters detached for
    the pass) and everything returned is detached: the same values, without the transform's
    per-op cost; inside a transform, and without `detached`, by ``torch.func.grad``, whose
    results stay connected to any outer graph.
    """

    def __init__(self, model: nn.Module, where: Where | Located, loss_fn: Callable[[Any], torch.Tensor], caller: str,
                 *, event: str = "forward", element: int | str | None = None, detached: bool = False) -> None:
        model = check_model(model, caller)
        self.inner = _torch.unwrap(model)
        self.prober = _Prober({}, caller)
        spec = edit(where, self.prober, event=event, name="probe")
        labels = dict(spec.labels)
        paths = {id(m): labels.get(p, p) for p, m in resolve(spec.where, self.inner, caller=caller)}
        self.prober.paths.update(paths)
        self.recorder = CaptureFunction(model, (spec,), caller)
        self.order = list(dict.fromkeys(paths.values()))
        self.loss_fn = loss_fn
        self.element = element
        self.detached = detached
        self.name = "input" if event == "forward_pre" else "output"

    def state(self) -> _State:
        """The model's parameters and buffers now, for one call's passes."""
        return _State(self.inner)

    def discover(self, args: tuple, kwargs: dict, state: _State) -> tuple[object, _Pass]:
        """The model's output and the values to probe, from a forward without gradients on
        copies of the buffers, with the random state restored afterwards."""
        devices = sorted({t.device.index or 0 for t in _torch.tree_leaves((args, kwargs))
                          if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
        found = _Pass(None, None, self.prober.caller, self.element)
        self.prober.passes.append(found)
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices):
                copies = state.buffer_copies()
                out, _ = self.recorder(torch.func.functional_call, (self.inner, copies, *_copies((args, kwargs))),
                                       _NO_TIES)
        finally:
            self.prober.passes.pop()
        return out, found

    def differentiate(self, found: _Pass, args: tuple, kwargs: dict, state: _State) -> tuple[torch.Tensor, Record]:
        """``(loss, Record)`` of a forward on `args` with zero probes shaped like `found`'s values
        added; the Record holds the probed values (``"output"``, or ``"input"``: the positional
        arguments; items that are not tensors are None) and their gradients (``"grad"``)."""
        inner, recorder, prober, loss_fn = self.inner, self.recorder, self.prober, self.loss_fn
        probes: list[torch.Tensor] = []
        layout: dict[str, list[list[int | None]]] = {}
        for path, calls in found.outputs.items():
            for output, slots in zip(calls, found.slots[path]):
                leaves = _torch.tree_leaves(output)
                row: list[int | None] = []
                for leaf, slot in zip(leaves, slots):
                    if slot is None:
                        row.append(None)
                    else:
                        row.append(len(probes))
                        probes.append(torch.zeros_like(leaf))
                layout.setdefault(path, []).append(row)
        shapes: dict[str, list[object]] = {}  # the values' structures, which leave the transform as they are

        def probed(flat: list[torch.Tensor]) -> tuple[torch.Tensor, tuple[torch.Tensor, dict, dict]]:
            current = _Pass(flat, layout, prober.caller)
            prober.passes.append(current)
            # buffers updated in place (batch norm) must be made inside the transform
            buffers = state.buffer_copies()
            try:
                out, _ = recorder(torch.func.functional_call, (inner, buffers, *_copies((args, kwargs))), _NO_TIES)
            finally:
                prober.passes.pop()
            loss = loss_fn(out)
            shapes.update(current.outputs)
            return loss, (loss, _tensors(current.outputs), buffers)

        if self.detached and not _torch.is_functorch_active():
            grads, (loss, outputs, buffers) = self._autograd(probes, layout, args, kwargs, shapes, state)
        else:
            grads, (loss, outputs, buffers) = torch.func.grad(probed, has_aux=True)(probes)
        if buffers and not _torch.is_functorch_active():
            state.keep(buffers)
        data: dict[str, dict[str, tuple[object, ...]]] = {}
        for path in self.order:
            if path not in outputs:
                continue
            outs, grad_calls = [], []
            for shape, tensors, row in zip(shapes[path], outputs[path], layout[path]):
                leaves, treespec = _torch.pytree.tree_flatten(shape)
                outs.append(_rebuilt(shape, tensors))
                grad_calls.append(_torch.pytree.tree_unflatten([None if i is None else grads[i] for i in row], treespec))
            data[path] = {self.name: tuple(outs), "grad": tuple(grad_calls)}
        return loss, Record(data)

    def _autograd(self, probes: list[torch.Tensor], layout: dict[str, list[list[int | None]]], args: tuple,
                  kwargs: dict, shapes: dict[str, list[object]],
                  state: _State) -> tuple[list[torch.Tensor], tuple[torch.Tensor, dict, dict]]:
        """``differentiate``'s pass by plain autograd: the probes require grad, the parameters
        are detached copies for the pass (no graph is built for them), and what comes back is
        detached."""
        inner, prober = self.inner, self.prober
        with torch.enable_grad():
            flat = [p.requires_grad_() for p in probes]
            current = _Pass(flat, layout, prober.caller)
            prober.passes.append(current)
            detached = {n: p.detach() for n, p in state.params.items()}
            buffers = state.buffer_copies()
            try:
                out, _ = self.recorder(torch.func.functional_call, (inner, {**detached, **buffers},
                                                                    *_copies((args, kwargs))), _NO_TIES)
            finally:
                prober.passes.pop()
            loss = self.loss_fn(out)
            found = torch.autograd.grad(loss, flat, allow_unused=True) if flat else ()
        grads = [torch.zeros_like(p) if g is None else g for p, g in zip(flat, found)]
        shapes.update(current.outputs)
        outputs = {path: [[t.detach() for t in call] for call in calls]
                   for path, calls in _tensors(current.outputs).items()}
        return grads, (loss.detach(), outputs, buffers)


def activation_grads(
    model: nn.Module, where: Where, loss_fn: Callable[[Any], torch.Tensor]
) -> Callable[..., tuple[torch.Tensor, Record]]:
    """Gradients of a loss with respect to module outputs, as a pure function.

    Args:
        model: the model (wrappers are looked through for paths).
        where: a selector for the modules whose outputs to differentiate.
        loss_fn: ``loss_fn(model_output) -> scalar tensor``; close over targets, or build
            ``f`` inside a function that receives them.

    Returns:
        ``f(*args, **kwargs) -> (loss, Record)`` calling ``model(*args, **kwargs)``; the
        Record holds ``"output"`` and ``"grad"`` (same structure as the output, ``None``
        for non-floating leaves) for every call of every selected module that ran.

    Raises:
        SelectorError: when `where` matches no module.
        TransformError: for a TorchScript model, or (when called) when a selected module
            runs differently in the two forward passes.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> f = fh.activation_grads(model, "0", lambda out: out.sum())
        >>> loss, rec = torch.func.vmap(f)(torch.randn(8, 3))  # per-example gradients
        >>> loss.shape, rec["0"]["grad"].shape
        (torch.Size([8]), torch.Size([8, 4]))
    """
    probes = Probes(model, where, loss_fn, _CALLER)

    def differentiated(*args: object, **kwargs: object) -> tuple[torch.Tensor, Record]:
        state = probes.state()
        _, found = probes.discover(args, kwargs, state)
        return probes.differentiate(found, args, kwargs, state)

    return differentiated
