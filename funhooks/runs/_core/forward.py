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
a ``torch.func`` level read and an autograd-state read (``fh.outputs`` then stores inline,
without calling its entry); per run, per hooked module, two dict writes and two attribute
writes at entry and as many at exit, and no allocation but the bound ``forward`` (a plan's
one run reaches its frame through the plan's :class:`Slot`).
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
from .types import Key, UserCall

__all__ = ["Forward", "Item", "Slot", "Table", "Users", "attribute", "call", "install", "uninstall"]

_ATTRIBUTE: dict[type, str] = {}
_active = scope.active
_peek = _torch.peek_transform
_graph_task = _torch.graph_task_id
_tracing = _torch.jit_tracing
Tensor = torch.Tensor
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
J = TypeVar("J", bound=Table)
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


class Slot:
    """A plan's run in the common case: the one frame that wrapped the plan's modules itself.

    Each ``Forward`` it installed then knows its user through this one object (its ``users``
    None), so entering and leaving a run make no tuple per module: at a few hundred modules,
    those allocations and their release after the forward cost more than the wrapping itself.
    Taken and released under the wrapping lock; a frame inside a ``torch.func`` transform,
    or a second run of the same plan at once, lists its users per module instead.
    """

    __slots__ = ("frame",)

    def __init__(self) -> None:
        self.frame: Frame | None = None


class Forward(Generic[T]):
    """A module's ``forward`` (or ``_call_impl``) while at least one run hooks it.

    Its users: ``users``, a tuple of ``(frame, table)``, outermost run first, replaced (never
    mutated) so a call in progress keeps the users it started with; or, when ``users`` is
    None, the one frame holding the plan's ``slot``, with the ``Forward``'s own table
    (:meth:`current_users` says which). ``route`` runs a call for the users in scope:
    :func:`call`, or for a ``torch.compile`` wrapper the compiled recorder of ``trace``. A plan
    keeps one ``Forward`` per hooked module and reuses it run after run; between runs it holds
    the module only weakly.
    """

    __slots__ = ("__weakref__", "attr", "eligible", "fast", "inner", "key", "module", "obs", "own", "reducer", "ref",
                 "route", "saved", "slot", "users")

    def __init__(self, module: nn.Module, attr: str, route: Route[T], own: T | None = None,
                 slot: Slot | None = None) -> None:
        """Args: `own`, `slot`: the plan's table for the module and the plan's slot, for a
        ``Forward`` whose users may be the slot's frame alone (see :class:`Slot`)."""
        self.ref = weakref.ref(module)
        self.attr = attr
        self.route = route
        self.module: Any = None  # the module while installed, else None
        self.inner: UserCall | None = None  # what `module.<attr>` was, while installed
        self.saved: object = None  # the instance attribute it replaced, if any
        self.reducer = self.reduce_ex  # made once: the module's `__reduce_ex__` while installed, if it had none
        self.own, self.slot = own, slot
        self.users: Users[T] | None = ()
        # the common case, read by one load while the slot's frame is the only user and its table
        # only observes: the slot; else None. The table's observers are `obs`, and `key` is set
        # when they only store the output as is
        self.fast: Slot | None = None
        if slot is not None and own is not None and own.plain:
            self.eligible: Slot | None = slot
            self.obs: tuple[PostEntry, ...] = own.obs
            self.key: Key | None = own.stores  # type: ignore[attr-defined]
        else:
            self.eligible, self.obs, self.key = None, (), None

    def current_users(self) -> Users[T]:
        """The runs using this forward, ``(frame, table)`` each, outermost first."""
        if self.users is not None:
            return self.users
        frame = self.slot.frame  # type: ignore[union-attr]  # users None: a slot's
        return () if frame is None else ((frame, self.own),)  # type: ignore[return-value]

    def __call__(self, *args: object, **kwargs: object) -> Any:
        slot = self.fast
        if slot is not None and (frame := slot.frame) in _active() and not frame.calling and _peek() is None:
            # the common case, inlined from `call`: one run, observers only, no transform
            # (`fast` is set after `inner` and cleared before it)
            output = self.inner(*args, **kwargs)  # type: ignore[misc]
            if _graph_task() == -1:  # not a recomputation during backward
                key = self.key
                if key is not None and type(output) is Tensor:  # `fh.outputs`: the entry's work, inlined
                    stored = output.detach() if output.requires_grad and not _tracing() else output
                    try:
                        frame.buffer.append((key, stored, stored._version))
                        return output
                    except RuntimeError:  # an inference tensor, no version counter: the entry copies it
                        pass
                for entry in self.obs:
                    entry(frame, self.module, args, kwargs, output)
            return output
        module, inner = self.module, self.inner
        if inner is None:  # unwrapped since the caller looked it up: call what is there now
            return getattr(self.ref(), self.attr)(*args, **kwargs)
        active = _active()
        if not active:
            return inner(*args, **kwargs)
        users = self.users
        if users is None:  # the slot's frame alone, with this forward's own table
            frame = self.slot.frame  # type: ignore[union-attr]
            if frame is None or frame not in active or frame.calling:
                return inner(*args, **kwargs)
            return self.route(module, inner, ((frame, self.own),), args, kwargs)  # type: ignore[arg-type]
        mine = tuple([u for u in users if u[0] in active and not u[0].calling])
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


def install(frame: Frame, items: Sequence[Item[T]], slot: Slot | None = None) -> list[Forward[T]]:
    """Make `frame` a user of the wrapped forward of each module in `items`
    (``(module_ref, forward, hooked)``, from the plan), wrapping the modules not wrapped
    yet; returns the ``Forward`` objects `frame` uses. `slot`: the plan's, which `frame`
    takes when free and outside transforms (release it with :func:`uninstall`)."""
    installed: list[Forward[T]] = []
    add = installed.append
    with _LOCK:
        mine = slot is not None and slot.frame is None and not frame.level
        if mine:
            slot.frame = frame  # type: ignore[union-attr]
        try:
            for ref, fwd, hooked in items:
                module = ref()
                if module is None:
                    continue
                d = module.__dict__
                attr = fwd.attr
                if not mine or attr in d or fwd.inner is not None:  # wrapped already, or in someone's way
                    add(_join(frame, module, d, fwd, hooked))
                    continue
                # the common case, each step once: a free Forward of the plan (`saved` None) on an
                # unwrapped module, its one user the slot's frame
                fwd.module = module
                fwd.inner = getattr(module, attr)
                fwd.users = None
                fwd.fast = fwd.eligible  # after `inner`
                d[attr] = fwd
                if "__reduce_ex__" not in d:  # a module's own `__reduce_ex__` stays
                    d["__reduce_ex__"] = fwd.reducer
                add(fwd)
        except BaseException:  # interrupted half-way: leave no module wrapped
            _uninstall(frame, installed, slot)
            raise
    return installed


def _join(frame: Frame, module: nn.Module, d: dict[str, Any], fwd: Forward[J], hooked: J) -> Forward[J]:
    """:func:`install` with `frame` listed among the users: for a module already wrapped by
    a run (`frame` joins its users), or with a forward of its own in its ``__dict__`` (wrapped
    around it), or whose ``Forward`` is still in use under someone else's forward (a new one
    wraps it), or for a frame without the plan's slot."""
    attr = fwd.attr
    current = d.get(attr)
    if current is not None and type(current) is Forward and current.module is module:  # wrapped already
        current.fast = None
        current.users = (*current.current_users(), (frame, hooked))
        return current
    if fwd.inner is not None:  # still in use under someone else's forward: never reuse
        fwd = Forward(module, attr, fwd.route)
    fwd.saved, fwd.module = current, module
    fwd.inner = getattr(module, attr)
    fwd.users = ((frame, hooked),)
    d[attr] = fwd
    d.setdefault("__reduce_ex__", fwd.reducer)
    return fwd


def uninstall(frame: Frame, installed: Sequence[Forward[Table]], slot: Slot | None = None) -> None:
    """Remove `frame` from each wrapped forward; restore the modules it was the last user of;
    release `slot` if `frame` holds it.

    A forward someone else replaced since (wrapping ours) stays in place, with no users.
    """
    with _LOCK:
        _uninstall(frame, installed, slot)


def _uninstall(frame: Frame, installed: Sequence[Forward[Table]], slot: Slot | None) -> None:
    for fwd in reversed(installed):
        users = fwd.users
        if users is not None:  # listed: `frame` leaves the list
            users = tuple([u for u in users if u[0] is not frame])
            if users:
                if len(users) == 1 and fwd.slot is not None and users[0] == (fwd.slot.frame, fwd.own):
                    fwd.users, fwd.fast = None, fwd.eligible  # the slot's frame alone again: the common case
                else:
                    fwd.users = users
                continue
        fwd.fast = None
        d = fwd.module.__dict__
        reducer = d.pop("__reduce_ex__", None)
        if reducer is not fwd.reducer and reducer is not None:  # the module's own: it stays
            d["__reduce_ex__"] = reducer
        attr = fwd.attr
        current = d.pop(attr, None)
        if current is not fwd:  # someone wrapped ours since: theirs stays, ours passes through
            if current is not None:
                d[attr] = current
            fwd.users = ()
            continue
        saved = fwd.saved
        if saved is not None:
            d[attr] = saved
            fwd.saved = None
        fwd.inner = None  # before `module`: a racing call reads `module` first, then `inner`
        fwd.module = None
    if slot is not None and slot.frame is frame:
        slot.frame = None
