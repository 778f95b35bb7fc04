"""Frames: one run's private mutable state, and the Record built from it.

A frame holds the buffer its entries append ``(key, value, check)`` to (``types.Stored``;
a ``grads`` entry appends a :class:`GradSlot` that backward fills in), the tensor hooks its
``grads`` entries registered (removed when the frame closes, so nothing stays on a
persistent tensor such as a parameter a module returns), the backward events that arrived
after it closed, the ``torch.func`` level it was opened at (a call at another level
would store values that escape their transform), and for interventions the call's per-call
values (``fh.arg`` placeholders) and how often each intervention has applied.

Building the Record groups the buffer by module path in module order and compares each
stored tensor's version counter with the one read when it was stored: a difference means a
later in-place op changed it, and the Record would be silently wrong. Closing a run checks
that every op spec took an op in some call of its module (what ``op_mode`` noted in
``missed``).

The frame sits below the modules whose entries take it: it reads its plan through
``types.Layout``, so it imports none of them.

Cost: about 0.35 µs per stored value to build; a version read per stored tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from funhooks import _torch
from funhooks.errors import SelectorError, StaleTensorError
from funhooks.records.record import Record, trusted
from funhooks.specs.ops import PROPERTY_READS
from funhooks.specs.selector import path_label
from funhooks.specs.spec import Spec

from .types import Handle, Key, Layout, Miss, Stored, WatchState

__all__ = ["Frame", "GradSlot"]

_SHOWN_OPS = 24
"""How many of the ops a module called a "matched nothing" error lists."""


class Frame:
    """One run's mutable state: what its entries stored, and the hooks they registered."""

    __slots__ = ("buffer", "caller", "calling", "counts", "grad_hooks", "late", "level", "missed", "open", "plan",
                 "shared", "took", "values", "watches")

    def __init__(self, plan: Layout, caller: str, level: int | None = None,
                 values: dict[str, object] | None = None) -> None:
        self.plan = plan
        self.values: dict[str, object] = {} if values is None else values  # `fh.arg` name -> this call's value
        self.counts: dict[object, int] = {}  # intervention entry -> how often it applied in this frame
        self.took: set[object] = set()  # the op entries that took an op in some call
        self.missed: dict[object, Miss] = {}  # op entry -> why it took none in the first call that took none
        self.shared: dict[object, object] = {}  # what a derived op's calls in this run share (``Derived.read``)
        self.caller = caller
        self.buffer: list[Stored] = []
        self.grad_hooks: list[Handle] = []
        self.late: set[Key] = set()
        self.calling = 0  # > 0 while one of its specs' own functions runs: it sees no call then
        if level is None:
            interpreter = _torch.peek_transform()
            level = 0 if interpreter is None else interpreter.level()
        self.level = level
        self.open = True
        self.watches: dict[int, WatchState] | None = None  # FSDP-sharded parameters watched (``sharded``)

    def close(self) -> None:
        """Stop storing and remove the tensor hooks (gradients arriving later are noted)."""
        self.open = False
        for handle in self.grad_hooks:
            handle.remove()
        self.grad_hooks = []
        self.watches = None

    def check(self) -> None:
        """Raise when an op spec took no op in any call of its module (``op_mode``): the
        error says what the first such call called."""
        took = self.took
        for entry, miss in self.missed.items():
            if entry not in took:
                raise _unmatched(self.caller, miss)

    def record(self) -> Record:
        """The Record of everything stored so far (a snapshot)."""
        return _build(self)

    def take(self) -> Record:
        """The Record of everything stored so far; the buffer starts afresh."""
        record = _build(self)
        self.buffer = []
        return record


def _unmatched(caller: str, miss: Miss) -> SelectorError:
    called = [name for name in miss.called if name not in PROPERTY_READS]
    shown = called[:_SHOWN_OPS] + (["..."] if len(called) > _SHOWN_OPS else [])
    n, outside = miss.taken, miss.outside
    if miss.call is not None and n:
        got = f"{n} call{'s' if n != 1 else ''} of `{miss.op}` where the spec takes call {miss.call}"
        fix = f"Pick a `call` index below {n}"
    else:
        got = f"no call of `{miss.op}`"
        fix = f"Pick one of the ops called while it ran, {shown}, or select the module that calls it"
    hint = getattr(getattr(miss.spec.action, "op", None), "HINT", "")
    if hint and not n:
        fix = hint
    if outside:
        fix = (f"{outside} call{'s' if outside != 1 else ''} of it ran inside its submodules: select the submodule, "
               f"or pass `fh.op({miss.op!r}, deep=True)` to count those")
    return SelectorError(
        f"{caller}: an op spec matches an op called by the module it selects, got {got} in module "
        f"{path_label(miss.path)} ({type(miss.module).__name__}) for {miss.spec!r}. {fix}."
    )


def _stale(caller: str, key: Key, spec: Spec | None) -> StaleTensorError:
    path, name = key
    return StaleTensorError(
        f"{caller}: a stored tensor must not change after it is stored, got the {name!r} of module "
        f"{path_label(path)} (spec {spec!r}) changed in place by a later op such as `inplace=True`. "
        "Pass `clone=True` to the spec to store a copy."
    )


def _notes(frame: Frame, data: dict[str, dict[str, Any]], waiting: set[Key]) -> dict[tuple[str, str | None], str]:
    """Why some of the plan's paths and names are absent, where that can be known."""
    notes = dict(frame.plan.notes)
    for path, name in waiting:
        if name not in data.get(path, ()):
            notes[(path, name)] = (
                f"its output needed a gradient but none reached it while the `{frame.caller}` block was open "
                "(the backward ran after the block exited, or not at all): call `backward()` inside the block"
            )
    for path, name in frame.late:
        notes[(path, name)] = (
            f"the backward pass reached it after the `{frame.caller}` block had exited: call `backward()` inside the block"
        )
    return notes


def _add(data: dict[str, dict[str, Any]], key: Key, value: object) -> bool:
    """Add one call's value; True when the (path, name) now holds a list of several."""
    node = data.setdefault(key[0], {})
    calls = node.get(key[1])
    if calls is None:
        node[key[1]] = (value,)
        return False
    if type(calls) is tuple:
        node[key[1]] = [*calls, value]
    else:
        calls.append(value)
    return True


def _build(frame: Frame) -> Record:
    """Group the buffer into a Record, checking that no stored tensor changed since."""
    buffer, plan = frame.buffer, frame.plan
    if len(buffer) == len(plan.paths) and not (frame.late or plan.notes):  # maybe one value per path
        data = _one_each(frame)
        if data is not None:
            return trusted(data)
    return _grouped(frame)


def _one_each(frame: Frame) -> dict[str, dict[str, Any]] | None:
    """The Record's data when the buffer holds one tensor per path, in module order, each
    with its version (the common case: one call of every hooked module, each storing one
    value), else None."""
    buffer = frame.buffer
    data: dict[str, dict[str, Any]] = {}
    for key, value, check in buffer:
        if type(check) is not int:  # a copy, a gradient slot, a pytree: the general way
            return None
        if value._version != check:
            raise _stale(frame.caller, key, frame.plan.spec_of.get(key))
        data[key[0]] = {key[1]: (value,)}
    if len(data) != len(buffer) or list(data) != frame.plan.paths:
        return None
    return data


def _grouped(frame: Frame) -> Record:
    """The Record's data grouped by module path and call, from any buffer."""
    _check_versions(frame)
    data, several, waiting = _collect(frame.buffer)
    if several:
        for node in data.values():
            for name, calls in node.items():
                if type(calls) is list:
                    node[name] = tuple(calls)
    data = _in_order(data, frame.plan)
    if waiting or frame.late or frame.plan.notes:
        return trusted(data, _notes(frame, data, waiting))
    return trusted(data)


def _check_versions(frame: Frame) -> None:
    """Raise when a stored tensor was changed in place since it was stored."""
    for key, value, check in frame.buffer:
        if check is None:
            continue
        if type(check) is int:
            if value._version != check:
                raise _stale(frame.caller, key, frame.plan.spec_of.get(key))
        elif any(t._version != v for t, v in check):  # type: ignore[union-attr]  # not an int: pairs
            raise _stale(frame.caller, key, frame.plan.spec_of.get(key))


def _collect(buffer: list[Stored]) -> tuple[dict[str, dict[str, Any]], bool, set[Key]]:
    """The buffer's values by path and name, in call order: ``(data, several, waiting)``, where a
    (path, name) with more than one call holds a list (`several` then True), and `waiting` has
    the gradient slots no backward pass filled."""
    data: dict[str, dict[str, Any]] = {}
    several = False
    waiting: set[Key] = set()
    for key, value, _ in buffer:
        if type(value) is GradSlot:  # one value per backward pass, maybe none
            values = value.values()
            if not values:
                waiting.add(key)
            for value in values:
                several |= _add(data, key, value)
            continue
        path, name = key  # `_add`, inlined: this loop runs once per stored value
        node = data.get(path)
        if node is None:
            data[path] = {name: (value,)}
            continue
        calls = node.get(name)
        if calls is None:
            node[name] = (value,)
        elif type(calls) is tuple:
            node[name], several = [*calls, value], True
        else:
            calls.append(value)
    return data, several, waiting


def _in_order(data: dict[str, dict[str, Any]], plan: Layout) -> dict[str, dict[str, Any]]:
    """`data` with names in spec order and paths in module order, whatever order the entries ran in."""
    rank = plan.name_rank
    if len(rank) > 1:
        for path, node in data.items():
            if len(node) > 1 and any(rank[a] > rank[b] for a, b in zip(node, list(node)[1:])):
                data[path] = {name: node[name] for name in sorted(node, key=rank.__getitem__)}
    paths = list(data)
    if paths != plan.paths:  # not every module, or not in module order: sort if needed
        order = plan.order
        if any(order[a] > order[b] for a, b in zip(paths, paths[1:])):
            data = {p: data[p] for p in sorted(data, key=order.__getitem__)}
    return data


class GradSlot:
    """A ``grads`` value completed by tensor hooks during backward: one value per backward
    pass through the call (``retain_graph=True``, gradient penalties), in pass order."""

    __slots__ = ("as_tuple", "n", "passes", "structure")

    def __init__(self, n: int, structure: _torch.Structure, as_tuple: bool) -> None:
        self.n, self.structure, self.as_tuple = n, structure, as_tuple
        self.passes: dict[int, list[torch.Tensor | None]] = {}

    def hook(self, frame: Frame, i: int,
             prep: Callable[[torch.Tensor], torch.Tensor] | None) -> Callable[[torch.Tensor], None]:
        def on_grad(grad: torch.Tensor) -> None:
            if frame.open:
                parts = self.passes.get(pass_id := _torch.backward_pass())
                if parts is None:
                    parts = self.passes[pass_id] = [None] * self.n
                parts[i] = grad if prep is None else prep(grad)

        return on_grad

    def values(self) -> list[object]:
        if self.as_tuple:
            return [tuple(parts) for parts in self.passes.values()]
        return [_torch.unflatten(parts, self.structure) for parts in self.passes.values()]
