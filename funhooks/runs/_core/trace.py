"""Recording inside compiled code.

Dynamo traces a function that wraps modules' forwards in their ``__dict__`` with plain
closures, calls the model and restores the ``__dict__``: the compiled graph returns what the
closures stored, with no graph break, and nothing of the wrapping exists when the graph
runs. Two places use it:

- a capture function being compiled (``torch.compile(fh.capture(model, specs))``);
- runs on a model compiled before the run: the way its compiled code is called (the
  ``torch.compile`` wrapper's forward, or the compiled call ``module.compile()`` put in a
  module's ``__dict__``) is wrapped with :func:`compiled_call`, which calls a *recorder*
  compiled with the same settings, once per plan, so Records come back as values at
  compiled speed.

On torch releases whose dynamo cannot trace this (``_torch.TRACES_RECORDING``), both run
the model eagerly while it records, with the same Records.

Inside compiled graphs stored values are copies (graphs keep no version counters), and
backward events are not available (refused when the plan is made).

Dynamo guards everything a trace reads, and checks those guards on every call of the compiled
code, so what a trace reads is kept to plain data: modules are reached from the model by
their routes (as the model's own forward reaches them, so each is guarded once), and the
modules whose specs only store copies of their inputs or outputs (the common case) are one
str for the whole plan, not tables of closures.

Cost: per run on a compiled model, one compiled call; the first run of a plan compiles its
recorder (as long as compiling the model took). Per call of compiled code, dynamo's guards:
one for all the stores of copies, a few dozen per module with other specs (observers, editors).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterable
from typing import NamedTuple, ParamSpec, TypeVar

from torch import nn

from funhooks import _torch

from .entries import PostEntry
from . import forward
from .frame import Frame
from .hooked import Hooked
from .types import Key, Selected, Stored, UserCall
from .values import COPIES, Copy, copied_inputs, copied_output, copier

__all__ = ["Compiled", "Inside", "Traced", "User", "compiled_call", "layout", "record", "stores_of"]

_MISSING = object()
_P = ParamSpec("_P")
_R = TypeVar("_R")

_Stores = tuple[tuple[str, bool, int], ...]
"""A module's entries when each stores a copy of its inputs or output: ``(name, stores the
inputs, copy)`` each, `copy` an index in ``values.COPIES`` (see :func:`stores_of`)."""
User = tuple[int, Hooked, "_Stores | None"]
"""One frame's table on a module a trace records: ``(frame index, hooked, stores_of(...))``."""
_Group = tuple[str, str, tuple[tuple[int, Hooked], ...]]
"""A module with other entries: its route (its ``_modules`` keys from the root, joined by
dots), the attribute its forward is wrapped under, and ``(frame index, hooked)`` pairs."""
Traced = tuple[str, tuple[_Group, ...]]
"""What a trace reads to record: the stores of copies as one str (see :func:`layout`), and the
modules with other entries."""
_FIELD, _ROW = "\x1f", "\x1e"  # ASCII's unit and record separators


def stores_of(entries: Iterable[Selected]) -> _Stores | None:
    """A module's entries as ``(name, stores the inputs, copy)`` (`copy` an index in
    ``values.COPIES``), when every one of them stores a copy of the inputs or the output; else None."""
    stores = []
    for spec, key, _ in entries:
        copy = copier(spec)
        if copy is None:
            return None
        stores.append((key[1], spec.role == "input", copy))
    return tuple(stores)


def layout(modules: Iterable[tuple[str, str, str, list[User]]]) -> Traced:
    """What a trace reads, from ``(route, attr, path, [(frame index, hooked, stores_of(...))])``
    per module: a module is plain stores only when every frame's entries on it are.

    The stores are one str, a row per store (route, attr, path, name, ``i``/``o`` for the
    inputs or the output, copy, frame index): dynamo guards a str with one comparison, where a
    tuple costs a guard per element, checked on every call. A module whose strings hold a
    separator (never in practice) is recorded through its table instead."""
    rows: list[str] = []
    groups: list[_Group] = []
    for route, attr, path, users in modules:
        found = _rows(route, attr, path, users)
        if found is None:
            groups.append((route, attr, tuple([(i, hooked) for i, hooked, _ in users])))
        else:
            rows += found
    return _ROW.join(rows), tuple(groups)


def _rows(route: str, attr: str, path: str, users: list[User]) -> list[str] | None:
    """A module's rows of :func:`layout`'s str, when every frame's entries on it are stores of
    copies and no string holds a separator; else None (it is recorded through its tables)."""
    stores = [(i, lean) for i, _, lean in users]
    if any(lean is None for _, lean in stores):
        return None
    fields = [route, attr, path, *(name for _, lean in stores for name, _, _ in lean)]  # type: ignore[union-attr]
    if any(_FIELD in f or _ROW in f for f in fields):
        return None
    return [_FIELD.join((route, attr, path, name, "i" if pre else "o", str(copy), str(i)))
            for i, lean in stores for name, pre, copy in lean]  # type: ignore[union-attr]


def _at(root: nn.Module, route: str) -> nn.Module:
    module = root
    if route:
        for key in route.split("."):
            module = _torch.children(module)[key]  # type: ignore[assignment]
    return module


def _storing(inner: Callable[_P, _R], before: list[tuple[list[Stored], Key, Copy]],
             after: list[tuple[list[Stored], Key, Copy]]) -> Callable[_P, _R]:
    """A forward storing copies (``(buffer, key, copy)`` each) of its inputs and its output."""
    def forward(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        for buffer, key, copy in before:
            buffer.append((key, copied_inputs(copy, args, kwargs), None))
        output = inner(*args, **kwargs)
        for buffer, key, copy in after:
            buffer.append((key, copied_output(copy, output), None))
        return output

    return forward


def _calling(module: nn.Module, inner: UserCall, users: forward.Users[Hooked]) -> UserCall:
    def calling(*args: object, **kwargs: object) -> object:
        return forward.call(module, inner, users, args, kwargs, checked=False)

    return calling


def record(fn: Callable[..., _R], root: nn.Module, traced: Traced, frames: list[Frame], args: tuple,
           kwargs: dict) -> _R:
    """``fn(*args, **kwargs)`` with the modules of `traced` (reached from `root`) recording
    into `frames`; traceable."""
    stores, groups = traced
    lean: dict[str, tuple[str, list[tuple[list[Stored], Key, Copy]], list[tuple[list[Stored], Key, Copy]]]] = {}
    for row in stores.split(_ROW) if stores else ():
        route, attr, path, name, pre, copy, i = row.split(_FIELD)
        found = lean.get(route)
        if found is None:
            found = lean[route] = (attr, [], [])
        (found[1] if pre == "i" else found[2]).append((frames[int(i)].buffer, (path, name), COPIES[int(copy)]))
    saved: list[tuple[dict[str, object], str, object]] = []
    for route, (attr, before, after) in lean.items():
        module = _at(root, route)
        saved.append((module.__dict__, attr, module.__dict__.get(attr, _MISSING)))
        module.__dict__[attr] = _storing(getattr(module, attr), before, after)
    for route, attr, users in groups:
        module = _at(root, route)
        saved.append((module.__dict__, attr, module.__dict__.get(attr, _MISSING)))
        module.__dict__[attr] = _calling(module, getattr(module, attr), tuple([(frames[i], h) for i, h in users]))
    try:
        return fn(*args, **kwargs)
    finally:
        for d, attr, prev in reversed(saved):
            if prev is _MISSING:
                del d[attr]
            else:
                d[attr] = prev


class Inside(NamedTuple):
    """A hooked module inside a ``torch.compile`` wrapper, as its recorder reaches it."""

    ref: weakref.ref[nn.Module]
    route: str
    """Its ``_modules`` keys from the wrapper's inner model, joined by dots."""
    attr: str
    """The attribute its forward is wrapped under."""
    hooked: Hooked
    """Its entries, storing copies."""
    stores: _Stores | None
    """``stores_of`` its entries."""


_Buffers = tuple[list[Stored], ...]
"""What a recorder's runs stored, a buffer per run."""
_Recorder = Callable[..., tuple[object, _Buffers]]
"""A compiled recorder: ``(inner model, *args, **kwargs) -> (output, buffers)``."""


class Compiled:
    """One plan's hooked modules inside one ``torch.compile`` wrapper, and the recorders
    compiled for them; the table a run uses the wrapper's ``Forward`` with."""

    __slots__ = ("caller", "items", "recorders")
    plain = False  # never the observers-only fast path of a wrapped forward
    reading = False  # nor the output-reading one
    obs: tuple[PostEntry, ...] = ()  # so never read

    def __init__(self, items: list[Inside], caller: str) -> None:
        self.items, self.caller = items, caller
        self.recorders: dict[tuple[int, ...], _Recorder] = {}


def _fresh(fn: _Recorder) -> _Recorder:
    """`fn` with a code object of its own: dynamo keeps one cache (and one recompile limit)
    per code object, and every plan's recorder must have its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _recorder(wrapper: nn.Module, compiled_fn: object, users: list[Compiled]) -> _Recorder:
    """The recorder for `users`, compiled with the settings of `wrapper` (a ``torch.compile``
    wrapper, or a module compiled in place whose compiled call is `compiled_fn`)."""
    modules: dict[int, tuple[str, str, str, list[User]]] = {}
    for i, compiled in enumerate(users):
        for ref, route, attr, hooked, lean in compiled.items:
            module = ref()
            if module is not None:
                modules.setdefault(id(module), (route, attr, hooked.path, []))[3].append((i, hooked, lean))
    traced = layout(modules.values())
    callers = tuple([c.caller for c in users])
    in_place = not _torch.is_compile_wrapper(wrapper)  # its plain call: `Module.__call__` would call `compiled_fn`

    def recorder(inner: nn.Module, *args: object, **kwargs: object) -> tuple[object, _Buffers]:
        frames = [Frame(None, caller, 0) for caller in callers]  # type: ignore[arg-type]
        out = record(_torch.call_impl(inner) if in_place else inner, inner, traced, frames, args, kwargs)
        for frame in frames:  # these frames last one compiled call: their op specs are checked now
            frame.check()
        return out, tuple([f.buffer for f in frames])

    context = _torch.dynamo_context(wrapper, compiled_fn)
    if not _torch.TRACES_RECORDING or context is None:  # the model runs eagerly while it records
        return recorder
    return context(_fresh(recorder))


def compiled_call(wrapper: nn.Module, inner: UserCall, users: forward.Users[Compiled], args: tuple,
                  kwargs: dict) -> object:
    """A call of a compiled module (a ``torch.compile`` wrapper, or a module compiled in place,
    whose compiled call is `inner`) for the runs in `users` (``(frame, Compiled)``): the
    compiled recorder runs the model and returns what the runs' entries stored."""
    key = tuple([id(compiled) for _, compiled in users])
    first = users[0][1]
    recorder = first.recorders.get(key)
    if recorder is None:
        recorder = first.recorders[key] = _recorder(wrapper, inner, [compiled for _, compiled in users])
    out, buffers = recorder(_torch.compiled_model(wrapper), *args, **kwargs)
    if not _torch.in_backward():  # a recomputation (checkpointing) stores nothing again
        for (frame, _), buffer in zip(users, buffers):
            frame.buffer.extend(buffer)  # every traced entry stores `(key, copy, None)`
    return out
