"""Recording inside compiled code.

Dynamo traces a function that wraps modules' forwards in their ``__dict__`` with plain
closures, calls the model and restores the ``__dict__``: the compiled graph returns what the
closures stored, with no graph break, and nothing of the wrapping exists when the graph
runs. Two places use it:

- a capture function being compiled (``torch.compile(fh.capture(model, specs))``);
- runs on a model compiled before the run: the ``torch.compile`` wrapper's forward is
  wrapped with :func:`compiled_call`, which calls a *recorder* compiled with the wrapper's
  own settings, once per plan, so Records come back as values at compiled speed.

Inside compiled graphs stored values are copies (graphs keep no version counters), and
backward events are not available (refused when the plan is made).

Cost: per run on a compiled model, one compiled call; the first run of a plan compiles its
recorder (as long as compiling the model took).
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .. import _torch
from .forward import Users, call
from .frame import Frame

__all__ = ["Compiled", "compiled_call", "record"]

_MISSING = object()

Group = tuple[Any, str, tuple[tuple[int, Any], ...]]
"""A module, the attribute its forward is wrapped under, and ``(frame index, hooked)`` pairs."""


def _wrapped(module: nn.Module, inner: Callable[..., Any], users: Users) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        return call(module, inner, users, args, kwargs, checked=False)

    return forward


def record(fn: Callable[..., Any], groups: Sequence[Group], frames: list[Frame], args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with each group's module recording into `frames`; traceable."""
    saved = []
    for module, attr, users in groups:
        d = module.__dict__
        prev = d.get(attr, _MISSING)
        d[attr] = _wrapped(module, getattr(module, attr), tuple([(frames[i], hooked) for i, hooked in users]))
        saved.append((d, attr, prev))
    try:
        return fn(*args, **kwargs)
    finally:
        for d, attr, prev in reversed(saved):
            if prev is _MISSING:
                del d[attr]
            else:
                d[attr] = prev


class Compiled:
    """One plan's hooked modules inside one ``torch.compile`` wrapper: ``(module_ref, attr,
    hooked)`` each (the hooked entries store copies), and the recorders compiled for them."""

    __slots__ = ("caller", "items", "recorders")
    plain = False  # never the observers-only fast path of a wrapped forward

    def __init__(self, items: list[tuple[weakref.ref, str, Any]], caller: str) -> None:
        self.items, self.caller = items, caller
        self.recorders: dict[tuple[int, ...], tuple[Callable[..., Any], list[weakref.ref]]] = {}


def _fresh(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own: dynamo keeps one cache (and one recompile limit)
    per code object, and every plan's recorder must have its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _recorder(wrapper: nn.Module, users: list[Compiled]) -> tuple[Callable[..., Any], list[weakref.ref]]:
    """The compiled recorder for `users`, and the modules it takes (as weak references)."""
    refs: list[weakref.ref] = []
    position: dict[int, int] = {}
    layout: dict[int, tuple[str, list[tuple[int, Any]]]] = {}
    for i, compiled in enumerate(users):
        for ref, attr, hooked in compiled.items:
            module = ref()
            if module is None:
                continue
            if id(module) not in position:
                position[id(module)] = len(refs)
                refs.append(ref)
                layout[position[id(module)]] = (attr, [])
            layout[position[id(module)]][1].append((i, hooked))
    plan = [(index, attr, tuple(pairs)) for index, (attr, pairs) in layout.items()]
    callers = [c.caller for c in users]

    def recorder(inner: nn.Module, modules: tuple[nn.Module, ...], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        frames = [Frame(None, caller, 0) for caller in callers]  # type: ignore[arg-type]
        groups = [(modules[index], attr, pairs) for index, attr, pairs in plan]
        out = record(inner, groups, frames, args, kwargs)
        return out, tuple([f.buffer for f in frames])

    return _torch.dynamo_context(wrapper)(_fresh(recorder)), refs


def compiled_call(wrapper: nn.Module, inner: Callable[..., Any], users: Users, args: tuple, kwargs: dict) -> Any:
    """A call of a ``torch.compile`` wrapper for the runs in `users` (``(frame, Compiled)``):
    the compiled recorder runs the model and returns what the runs' entries stored."""
    key = tuple([id(compiled) for _, compiled in users])
    first: Compiled = users[0][1]
    found = first.recorders.get(key)
    if found is None:
        found = first.recorders[key] = _recorder(wrapper, [compiled for _, compiled in users])
    recorder, refs = found
    modules = tuple([ref() for ref in refs])
    out, buffers = recorder(wrapper._orig_mod, modules, *args, **kwargs)
    if not _torch.in_backward():  # a recomputation (checkpointing) stores nothing again
        for (frame, _), buffer in zip(users, buffers):
            frame.buffer.extend([(key, value, None) for key, value, _ in buffer])
    return out
