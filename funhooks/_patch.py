"""Wrapped forwards: how eager runs reach the modules they hook.

While a run hooks a module, the module's ``forward`` is a :class:`Forward` set in the
module's own ``__dict__``: it runs the runs' forward-pre entries, the module's forward and
their forward entries. Nothing is registered with PyTorch, so ``Module.__call__`` keeps its
hook-free fast path for every module, hooked or not; a forward hook of any kind (even a
global no-op one) sends *every* module call down PyTorch's slower hooked path.

Entries see what forward hooks would see, in the same order: the arguments after the
module's own forward-pre hooks, the output before its forward hooks. Nested runs share
one ``Forward`` per module (each run is a *user* of it), so runs can exit in any order.
When the last user leaves, the module's ``__dict__`` is restored exactly.

A model copied (``copy.deepcopy``) or pickled inside a block gets a plain ``forward``
bound to the copy: it computes as the original and records nothing.

Cost: per hooked module call, one Python call around the forward and a loop over the
users; per run, one small object per hooked module at entry and a dict write at exit.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from typing import Any

from torch import nn

__all__ = ["Forward", "install", "patchable", "uninstall"]

_PATCHABLE: dict[type, bool] = {}


def patchable(cls: type) -> bool:
    """Whether an instance attribute ``forward`` of `cls` is what ``module.forward`` finds
    (not when the class makes ``forward`` a property or overrides attribute lookup)."""
    ok = _PATCHABLE.get(cls)
    if ok is None:
        found = inspect.getattr_static(cls, "forward", None)
        ok = _PATCHABLE[cls] = cls.__getattribute__ is nn.Module.__getattribute__ and not hasattr(
            type(found), "__set__"
        )
    return ok


class Forward:
    """A module's ``forward`` while at least one run hooks it.

    ``users`` is a tuple of ``(frame, pre_entries, entries)``, outermost run first; the hot
    path reads ``before`` and ``after``, the same users without the ones that have no entries
    of that kind. All three are replaced, never mutated, so a call in progress keeps the
    users it started with. A plan keeps one ``Forward`` per hooked module and reuses it run
    after run; between runs it holds the module only weakly.
    """

    __slots__ = ("after", "before", "inner", "module", "ref", "saved", "users")

    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)
        self.module: Any = None  # the module, while installed
        self.inner: Any = None  # what the module's forward was, while installed
        self.saved: Any = None  # the instance attribute `forward` it replaced, if any
        self.users: tuple = ()
        self.before: tuple = ()  # (frame, pre_entries) of the users that have some
        self.after: tuple = ()  # (frame, entries) of the users that have some

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.before:
            args = self._before(args, kwargs)
        output = self.inner(*args, **kwargs)
        for frame, entries in self.after:
            if frame.active:
                for entry in entries:
                    new = entry(frame, self.module, args, kwargs, output)
                    if new is not None:
                        output = new
        return output

    def _before(self, args: tuple, kwargs: dict) -> tuple:
        for frame, entries in self.before:
            if frame.active:
                for entry in entries:
                    new = entry(frame, self.module, args, kwargs)
                    if new is not None:
                        args = new if isinstance(new, tuple) else (new,)
        return args

    def _set_users(self, users: tuple) -> None:
        self.users = users
        self.before = tuple([(frame, pre) for frame, pre, _ in users if pre])
        self.after = tuple([(frame, post) for frame, _, post in users if post])

    # -- looking like the forward it wraps ------------------------------------------------

    @property
    def __wrapped__(self) -> Any:  # inspect.signature(module.forward) sees the real one
        return self.inner

    @property
    def __self__(self) -> Any:
        return getattr(self.inner, "__self__", None)

    @property
    def __func__(self) -> Any:
        return getattr(self.inner, "__func__", self.inner)

    @property
    def __name__(self) -> str:
        return getattr(self.inner, "__name__", "forward")

    def __repr__(self) -> str:
        return f"<funhooks-wrapped {self.inner!r}>"

    # -- copies of a model made inside a block get the plain forward ------------------------

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        if self.saved is not None:
            return copy.deepcopy(self.saved, memo)
        module = self.ref()
        twin = memo.get(id(module), module)
        return type(twin).forward.__get__(twin, type(twin))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # builtins only, so the pickle loads where funhooks is not installed
        if self.saved is not None:
            return copy.copy, (self.saved,)
        return getattr, (self.ref(), "forward")


def install(frame: Any, items: list[tuple[weakref.ref, Forward, tuple, tuple]]) -> list[Forward]:
    """Make `frame` a user of the wrapped forward of each module in `items`
    (``(module_ref, forward, pre_entries, entries)``, from the plan), wrapping the forwards
    not wrapped yet; returns the ``Forward`` objects `frame` uses."""
    installed: list[Forward] = []
    try:
        for ref, fwd, pre, post in items:
            module = ref()
            if module is None:
                continue
            d = module.__dict__
            current = d.get("forward")
            if type(current) is Forward and current.module is module:  # wrapped by a run already
                current._set_users((*current.users, (frame, pre, post)))
                installed.append(current)
                continue
            if fwd.inner is not None:  # still in use under someone else's forward: never reuse
                fwd = Forward(module)
            fwd.inner = module.forward if current is None else current
            fwd.module, fwd.saved, fwd.users = module, current, ((frame, pre, post),)
            fwd.before = ((frame, pre),) if pre else ()
            fwd.after = ((frame, post),) if post else ()
            d["forward"] = fwd
            installed.append(fwd)
    except BaseException:  # interrupted half-way: leave no module wrapped
        uninstall(frame, installed)
        raise
    return installed


def uninstall(frame: Any, installed: list[Forward]) -> None:
    """Remove `frame` from each wrapped forward; restore the forwards it was the last user of.

    A forward someone else replaced since (wrapping ours) stays in place, with no users.
    """
    for fwd in reversed(installed):
        users = fwd.users
        if len(users) == 1 and users[0][0] is frame:
            fwd.users = fwd.before = fwd.after = ()
        else:
            fwd._set_users(tuple([u for u in users if u[0] is not frame]))
            if fwd.users:
                continue
        d = fwd.module.__dict__
        if d.get("forward") is fwd:
            if fwd.saved is None:
                del d["forward"]
            else:
                d["forward"] = fwd.saved
            fwd.module = fwd.inner = fwd.saved = None
