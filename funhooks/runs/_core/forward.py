"""Wrapped forwards: how runs reach the modules they hook, and the one hot loop.

While a run hooks a module, the module's ``forward`` is a :class:`Forward` set in the
module's own ``__dict__`` (``_call_impl`` for the rare class whose ``forward`` an instance
attribute cannot replace: a property, or a custom ``__getattribute__``). Nothing is
registered with PyTorch: ``Module.__call__`` keeps its hook-free fast path for every
module, hooked or not, where any forward hook (even a global no-op one) sends every module
call down PyTorch's slower hooked path.

A call goes through :func:`call` only for the runs (*users*) entered in the calling
context (see ``scope``); calls from other threads or tasks run the module as if no run
existed. Entries see what forward hooks would see: the arguments after the module's own
forward-pre hooks, the output before its forward hooks. Nested runs share one ``Forward``
per module and may exit in any order; when the last one leaves, the ``__dict__`` is
restored exactly. A module copied (``copy.copy``, ``deepcopy``, pickle) inside a block gets
a plain forward: the ``Forward`` also sets an instance ``__reduce_ex__`` that leaves itself
out of the copy.

Cost: per hooked module call, one Python call around the forward, a context-variable read,
a ``torch.func`` level read and an autograd-state read; per run, a few dict writes per
hooked module at entry and exit.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import TransformError
from funhooks.specs.selector import path_label as where

from . import op_mode as ops
from . import scope
from .entries import PostEntry
from .frame import Frame
from .hooked import Hooked
from .types import UserCall

__all__ = ["Forward", "Item", "Table", "Users", "attribute", "call", "install", "uninstall"]

_ATTRIBUTE: dict[type, str] = {}
_active = scope.active
_peek = _torch.peek_transform
_graph_task = _torch.graph_task_id
_LOCK = threading.RLock()
"""Guards wrapping and unwrapping: runs entered in two threads at once share the wrappers."""



class Table(Protocol):
    """What a wrapped forward reads of a user's table: a ``Hooked``, or for a ``torch.compile``
    wrapper the ``trace.Compiled`` of its recorder (never plain)."""

    @property
    def plain(self) -> bool:
        """True for a table of plain observers only: the calls run inlined, without :func:`call`."""

    @property
    def obs(self) -> tuple[PostEntry, ...]:
        """The observers, read when `plain`."""


T = TypeVar("T", bound=Table, covariant=True)
Users = tuple[tuple[Frame, T], ...]
"""The runs that use a wrapped forward: ``(frame, table)``, outermost run first."""
Route = Callable[[nn.Module, UserCall, Users[T], tuple, dict], object]
"""How a wrapped forward runs a call for the users in scope: ``(module, its forward, users,
args, kwargs) -> output``: :func:`call`, or ``trace.compiled_call``."""
Item = tuple["weakref.ref[nn.Module]", "Forward[T]", T]
"""A plan's module to wrap: ``(module_ref, its Forward, the table a run uses it with)``."""


def attribute(cls: type) -> str:
    """The instance attribute through which a run wraps modules of `cls`: ``forward``, or
    ``_call_impl`` where an instance ``forward`` would not be found (a property, a custom
    ``__getattribute__``)."""
    name = _ATTRIBUTE.get(cls)
    if name is None:
        found = inspect.getattr_static(cls, "forward", None)
        plain = cls.__getattribute__ is nn.Module.__getattribute__ and not hasattr(type(found), "__set__")
        name = _ATTRIBUTE[cls] = "forward" if plain else "_call_impl"
    return name


def _escape(frame: Frame, hooked: Hooked) -> TransformError:
    return TransformError(
        f"{frame.caller}: values stored by side effect cannot leave a torch.func transform, got module "
        f"{where(hooked.path)} called inside `vmap`/`grad` while the `{frame.caller}` block was entered outside it. "
        "Call `fh.capture(model, specs)` inside the transform instead: its Record comes back batched."
    )


def call(module: nn.Module, inner: UserCall, users: Users[Hooked], args: tuple, kwargs: dict,
         checked: bool = True) -> object:
    """One call of a hooked module for the runs in `users` (``(frame, hooked)`` pairs).

    Forward-pre editors, then forward-pre observers; the module (inside the op mode of
    ``ops`` when a user's table has op entries); editors, then gradient watchers, then
    observers: a recording sees the values after every editor of the call.
    A call made while autograd runs a backward pass is a recomputation (activation
    checkpointing): editors and gradient watchers run, nothing is stored again.
    `checked` is False inside a dynamo trace, which runs neither check.
    """
    replay = False
    if checked:
        level = _torch.transform_level()
        for frame, hooked in users:
            if frame.level != level:
                raise _escape(frame, hooked)
        replay = _graph_task() != -1
    if len(users) == 1 and users[0][1].plain:  # the common case: observers only
        frame, hooked = users[0]
        output = inner(*args, **kwargs)
        if not replay:
            for entry in hooked.obs:
                entry(frame, module, args, kwargs, output)
        return output
    for frame, hooked in users:
        for pre in hooked.pre_edits:
            new = pre(frame, module, args, kwargs)
            if new is not None:
                args = new
    if not replay:
        for frame, hooked in users:
            for pre in hooked.pre_obs:
                pre(frame, module, args, kwargs)
    backward = None
    if checked and torch.is_grad_enabled():
        full = [make(frame) for frame, hooked in users for make in hooked.backward]
        pre_hooks = [make(frame) for frame, hooked in users for make in hooked.backward_pre]
        if full or pre_hooks:
            backward = _torch.backward_hook(module, full, pre_hooks)
            args = backward.setup_input_hook(args)
    around = (users if users[0][1].around else ()) if len(users) == 1 else tuple([u for u in users if u[1].around])
    if around:
        output = ops.call(module, inner, around, around[0][1].path, args, kwargs, replay)
    else:
        output = inner(*args, **kwargs)
    for frame, hooked in users:
        for post in hooked.edits:
            edited = post(frame, module, args, kwargs, output)
            if edited is not None:
                output = edited
    for frame, hooked in users:
        for post in hooked.grads:
            post(frame, module, args, kwargs, output)
    if not replay:
        for frame, hooked in users:
            for post in hooked.obs:
                post(frame, module, args, kwargs, output)
    if backward is not None:
        output = backward.setup_output_hook(output)
    return output


class Forward(Generic[T]):
    """A module's ``forward`` (or ``_call_impl``) while at least one run hooks it.

    ``users`` is a tuple of ``(frame, hooked)``, outermost run first, replaced (never
    mutated) so a call in progress keeps the users it started with. ``route`` runs a call for
    the users in scope: :func:`call`, or for a ``torch.compile`` wrapper the compiled recorder
    of ``trace``. A plan keeps one ``Forward`` per hooked module and reuses it run after run;
    between runs it holds the module only weakly.
    """

    __slots__ = ("__weakref__", "attr", "inner", "module", "obs", "reducer", "ref", "route", "saved", "solo", "users")

    def __init__(self, module: nn.Module, attr: str, route: Route[T]) -> None:
        self.ref = weakref.ref(module)
        self.attr = attr
        self.route = route
        self.module: Any = None  # the module while installed, else None
        self.inner: UserCall | None = None  # what `module.<attr>` was, while installed
        self.saved: object = None  # the instance attribute it replaced, if any
        self.reducer = self.reduce_ex  # made once: the module's `__reduce_ex__` while installed, if it had none
        self.users: Users[T] = ()
        # the common case, read by one load: the frame of the one user, when it only observes and
        # was entered outside transforms (its table's observers then in `obs`); else None
        self.solo: Frame | None = None
        self.obs: tuple[PostEntry, ...] = ()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        module, inner = self.module, self.inner
        if inner is None:  # unwrapped since the caller looked it up: call what is there now
            return getattr(self.ref(), self.attr)(*args, **kwargs)
        active = _active()
        if not active:
            return inner(*args, **kwargs)
        frame = self.solo
        if frame is not None and frame in active and not frame.calling and _peek() is None:
            # the common case, inlined from `call`: one run, observers only, no transform
            output = inner(*args, **kwargs)
            if _graph_task() == -1:  # not a recomputation during backward
                for entry in self.obs:
                    entry(frame, module, args, kwargs, output)
            return output
        mine = tuple([u for u in self.users if u[0] in active and not u[0].calling])
        return self.route(module, inner, mine, args, kwargs) if mine else inner(*args, **kwargs)

    # -- looking like the forward it wraps ------------------------------------------------

    @property
    def __wrapped__(self) -> UserCall | None:  # inspect.signature(module.forward) sees the real one
        return self.inner

    @property
    def __self__(self) -> object:
        return getattr(self.inner, "__self__", None)

    @property
    def __func__(self) -> object:
        return getattr(self.inner, "__func__", self.inner)

    @property
    def __name__(self) -> str:
        return getattr(self.inner, "__name__", self.attr)

    def __repr__(self) -> str:
        return f"<funhooks-wrapped {self.inner!r}>"

    # -- copies made inside a block are plain ----------------------------------------------

    def reduce_ex(self, protocol: int) -> str | tuple[object, ...]:
        """The module's own reduction, without the run's instance attributes (``copy.copy``,
        ``copy.deepcopy`` and pickle all ask an object's ``__reduce_ex__``)."""
        module = self.ref()
        reduced: Any = type(module).__reduce_ex__(module, protocol)  # type: ignore[arg-type, call-arg]
        if len(reduced) < 3 or not isinstance(reduced[2], dict):
            return reduced
        state = {}
        for k, v in reduced[2].items():
            if v is self:  # what it replaced, if anything (a state that leaves the attribute out stays so)
                if self.saved is not None:
                    state[k] = self.saved
            elif v is not self.reducer:
                state[k] = v
        return (reduced[0], reduced[1], state, *reduced[3:])


def _set_solo(fwd: Forward[T], users: Users[T]) -> None:
    """Set ``fwd.solo`` (and the observers beside it) for `users`."""
    fwd.solo = None
    if len(users) == 1:
        frame, hooked = users[0]
        if hooked.plain and not frame.level:
            fwd.obs, fwd.solo = hooked.obs, frame


def install(frame: Frame, items: Sequence[Item[T]]) -> list[Forward[T]]:
    """Make `frame` a user of the wrapped forward of each module in `items`
    (``(module_ref, forward, hooked)``, from the plan), wrapping the modules not wrapped
    yet; returns the ``Forward`` objects `frame` uses."""
    installed: list[Forward[T]] = []
    add, solo = installed.append, not frame.level
    with _LOCK:
        try:
            for ref, fwd, hooked in items:
                module = ref()
                if module is None:
                    continue
                d = module.__dict__
                attr = fwd.attr
                current = d.get(attr)
                if current is not None and type(current) is Forward and current.module is module:  # wrapped already
                    current.solo = None
                    current.users = (*current.users, (frame, hooked))
                    add(current)
                    continue
                if fwd.inner is not None:  # still in use under someone else's forward: never reuse
                    fwd = Forward(module, attr, fwd.route)
                fwd.saved, fwd.module, fwd.users = current, module, ((frame, hooked),)
                if solo and hooked.plain:  # (an unused Forward's `solo` is None)
                    fwd.obs, fwd.solo = hooked.obs, frame
                fwd.inner = getattr(module, attr)
                d[attr] = fwd
                d.setdefault("__reduce_ex__", fwd.reducer)  # a module's own `__reduce_ex__` stays
                add(fwd)
        except BaseException:  # interrupted half-way: leave no module wrapped
            _uninstall(frame, installed)
            raise
    return installed


def uninstall(frame: Frame, installed: Sequence[Forward[Table]]) -> None:
    """Remove `frame` from each wrapped forward; restore the modules it was the last user of.

    A forward someone else replaced since (wrapping ours) stays in place, with no users.
    """
    with _LOCK:
        _uninstall(frame, installed)


def _uninstall(frame: Frame, installed: Sequence[Forward[Table]]) -> None:
    for fwd in reversed(installed):
        users = fwd.users
        fwd.solo = None
        if len(users) == 1 and users[0][0] is frame:
            fwd.users = ()
        else:
            fwd.users = users = tuple([u for u in users if u[0] is not frame])
            if users:
                _set_solo(fwd, users)
                continue
        d = fwd.module.__dict__
        if d.get("__reduce_ex__") is fwd.reducer:
            del d["__reduce_ex__"]
        if d.get(fwd.attr) is not fwd:  # someone wrapped ours since: theirs stays, ours passes through
            continue
        saved = fwd.saved
        if saved is None:
            del d[fwd.attr]
        else:
            d[fwd.attr] = saved
            fwd.saved = None
        fwd.inner = None  # before `module`: a racing call reads `module` first, then `inner`
        fwd.module = None
