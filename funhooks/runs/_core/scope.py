"""Scope: which runs see a module call.

A run sees the module calls made in the context that entered it: its thread and its
``contextvars`` context (so asyncio tasks are separate, and a thread that never entered a
run sees none). The frames a context has entered are held in one ``ContextVar``; a wrapped
forward reads it once per call and skips every frame not in it.

Cost: one ``ContextVar.get`` per call of a hooked module (about 25 ns); entering and leaving
a frame build a new tuple of the context's frames.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

from .frame import Frame

__all__ = ["active", "enter", "isolated", "leave", "reset", "swap"]

_ACTIVE: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar("funhooks.active", default=())

active = _ACTIVE.get
"""The frames entered in the calling context, outermost first."""


def enter(frame: Frame) -> None:
    """Let `frame` see the module calls of the calling context."""
    _ACTIVE.set((*_ACTIVE.get(), frame))


def leave(frame: Frame) -> None:
    """Stop `frame` seeing the calling context's calls; the other frames keep theirs, so runs
    may be left in any order."""
    frames = _ACTIVE.get()
    if frame in frames:
        _ACTIVE.set(tuple([f for f in frames if f is not frame]))


swap = _ACTIVE.set
"""``swap(frames) -> token``: from now on exactly `frames` see the calling context's calls,
until ``reset(token)`` (:func:`_only` without a generator, for the per-call path of ``capture``)."""

reset = _ACTIVE.reset
"""Undo a :func:`swap`, given its token."""


@contextlib.contextmanager
def _only(frames: tuple[Frame, ...]) -> Iterator[None]:
    """Inside this block exactly `frames` see the calling context's calls."""
    token = _ACTIVE.set(frames)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def isolated() -> contextlib.AbstractContextManager[None]:
    """A block whose module calls no run sees: funhooks' own passes (shape discovery,
    summaries)."""
    return _only(())

