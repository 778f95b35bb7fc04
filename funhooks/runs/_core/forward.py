"""Wrapped forwards: how runs reach the modules they hook, one small class per state.

While a run hooks a module, the module's ``forward`` is a :class:`Forward` set in the
module's own ``__dict__`` (``_call_impl`` for the rare class whose ``forward`` an instance
attribute cannot replace: a property, or a custom ``__getattribute__``). Nothing is
registered with PyTorch: ``Module.__call__`` keeps its hook-free fast path for every
module, hooked or not, where any forward hook (even a global no-op one) sends every module
call down PyTorch's slower hooked path.

A ``Forward``'s class is its state (NOTE [a state per class]), chosen when a run joins or
leaves the module, never per call:

- :class:`_Observing`: its plan's one run alone, with observers only (the common case): the
  module's forward, then the observers;
- :class:`_Reading`: its plan's one run alone, whose only specs on the module record a value
  the module's output may give (the attention pattern of a Hugging Face attention module):
  that value read there, with no op mode, where the call gives it; else as ``_OneRun``;
- :class:`_OneRun`: one run with editors, op specs or backward events, or a run entered
  inside a ``torch.func`` transform, or a compiled module's one run: every call through the
  forward's *runner* (:func:`call`, the full hot loop, or ``trace.compiled_call``);
- :class:`_Shared`: several runs on one module: the runner, for the runs in scope;
- :class:`_Passing`: left behind under someone else's forward after its last run left: the
  module's forward, nothing else.

A plan's forward keeps the class its plan's run uses alone between runs; not installed, it
calls whatever the module holds now (a call that looked it up just before it was removed).

A call is seen only by the runs (*users*) entered in the calling context (see ``scope``);
calls from other threads or tasks run the module as if no run existed. Entries see what
forward hooks would see: the arguments after the module's own forward-pre hooks, the output
before its forward hooks. Nested runs share one ``Forward`` per module and may exit in any
order; when the last one leaves, the ``__dict__`` is restored exactly. A module copied
(``copy.copy``, ``deepcopy``, pickle) inside a block gets a plain forward: the ``Forward``
also sets an instance ``__reduce_ex__`` that leaves itself out of the copy.

Cost: per hooked module call, one Python call around the forward, a context-variable read,
a ``torch.func`` level read and an autograd-state read, and one call per entry; per run, per
hooked module, two dict writes and two attribute writes at entry and as many at exit, and
no allocation in the common case (the plan's one run reaches its frame through the plan's
:class:`Slot`); a change of state (runs sharing a module) one ``__class__`` write.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

import torch
from torch import nn

from funhooks import _torch
from funhooks.errors import TransformError
from funhooks.specs.ops import Reading
from funhooks.specs.selector import path_label

from . import op_mode, scope
from .entries import PostEntry
from .frame import Frame
from .hooked import Hooked
from .types import UserCall

__all__ = ["Forward", "Item", "Slot", "Table", "Users", "attribute", "call", "install", "uninstall"]

_ATTRIBUTE: dict[type, str] = {}
_active = scope.active
_peek = _torch.peek_transform
_graph_task = _torch.graph_task_id
_compiling = _torch.is_compiling
_OPS = Reading.OPS
_LOCK = threading.RLock()
"""Guards wrapping and unwrapping: runs entered in two threads at once share the wrappers."""


class Table(Protocol):
    """What a wrapped forward reads of a user's table: a ``Hooked``, or for a ``torch.compile``
    wrapper the ``trace.Compiled`` of its recorder (never plain)."""

    @property
    def plain(self) -> bool:
        """True for a table of observers only: its plan's one run is then :class:`_Observing`."""

    @property
    def obs(self) -> tuple[PostEntry, ...]:
        """The observers, read when `plain`."""

    @property
    def reading(self) -> bool:
        """True for a table whose op entries only record a value the module's output may give
        (``Hooked.reading``): its plan's one run is then :class:`_Reading`."""


_T = TypeVar("_T", bound=Table, covariant=True)
_J = TypeVar("_J", bound=Table)
Users = tuple[tuple[Frame, _T], ...]
"""The runs that use a wrapped forward: ``(frame, table)``, outermost run first."""
_Runner = Callable[[nn.Module, UserCall, Users[_T], tuple, dict], object]
"""How a wrapped forward runs a call for the users in scope: ``(module, its forward, users,
args, kwargs) -> output``: :func:`call`, or ``trace.compiled_call``."""
Item = tuple["weakref.ref[nn.Module]", "Forward[_T]", _T]
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


# -- the hot loop ---------------------------------------------------------------------------------


def _escape(frame: Frame, hooked: Hooked) -> TransformError:
    return TransformError(
        f"{frame.caller}: values stored by side effect cannot leave a torch.func transform, got module "
        f"{path_label(hooked.path)} called inside `vmap`/`grad` while the `{frame.caller}` block was entered "
        "outside it. Call `fh.capture(model, specs)` inside the transform instead: its Record comes back batched."
    )


def _check_level(users: Users[Hooked]) -> None:
    """Refuse a call made inside a ``torch.func`` transform that a user's block was entered outside
    of (or the other way round): what it stored would escape the transform."""
    level = _torch.transform_level()
    for frame, hooked in users:
        if frame.level != level:
            raise _escape(frame, hooked)


def _before(module: nn.Module, users: Users[Hooked], args: tuple, kwargs: dict, replay: bool) -> tuple:
    """Forward-pre editors, then forward-pre observers (not on a recomputation): the args."""
    for frame, hooked in users:
        for pre in hooked.pre_edits:
            new = pre(frame, module, args, kwargs)
            if new is not None:
                args = new
    if not replay:
        for frame, hooked in users:
            for pre in hooked.pre_obs:
                pre(frame, module, args, kwargs)
    return args


def _backward_hook(module: nn.Module, users: Users[Hooked]) -> Any:
    """PyTorch's per-call ``BackwardHook`` (``_torch.backward_hook``) for the users' ``backward`` /
    ``backward_pre`` specs; None without any."""
    full = [make(frame) for frame, hooked in users for make in hooked.backward]
    pre = [make(frame) for frame, hooked in users for make in hooked.backward_pre]
    return _torch.backward_hook(module, full, pre) if full or pre else None


def _after(module: nn.Module, users: Users[Hooked], args: tuple, kwargs: dict, output: object,
           replay: bool) -> object:
    """Editors, then gradient watchers, then observers (not on a recomputation): the output."""
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
    return output


def call(module: nn.Module, inner: UserCall, users: Users[Hooked], args: tuple, kwargs: dict,
         checked: bool = True) -> object:
    """One call of a hooked module for the runs in `users` (``(frame, hooked)`` pairs): the
    full hot loop.

    Forward-pre editors, then forward-pre observers; the module (inside the op mode of
    ``op_mode`` when a user's table has op entries, inside PyTorch's ``BackwardHook`` when one
    has backward specs); editors, then gradient watchers, then observers: a recording sees
    the values after every editor of the call. A call made while autograd runs a backward
    pass is a recomputation (activation checkpointing): editors and gradient watchers run,
    nothing is stored again. `checked` is False inside a dynamo trace, which runs neither
    check (nor backward specs, refused there when the plan is made).
    """
    replay = False
    if checked:
        _check_level(users)
        replay = _graph_task() != -1
    args = _before(module, users, args, kwargs, replay)
    backward = _backward_hook(module, users) if checked and torch.is_grad_enabled() else None
    if backward is not None:
        args = backward.setup_input_hook(args)
    around = tuple([user for user in users if user[1].around])
    if around:
        output = op_mode.call(module, inner, around, around[0][1].path, args, kwargs, replay)
    else:
        output = inner(*args, **kwargs)
    output = _after(module, users, args, kwargs, output, replay)
    if backward is not None:
        output = backward.setup_output_hook(output)
    return output


# -- the states ------------------------------------------------------------------------------------


class Slot:
    """The frame of a plan's run in the common case: the one run that wrapped the plan's
    modules with the plan's own ``Forward`` objects (taken outside transforms, when free).

    Its ``_Observing`` forwards read their frame here, so entering and leaving that run write
    one attribute for all of them, not one per module; a second run of the same plan at
    once, or a run inside a ``torch.func`` transform, gets forwards of its own instead.
    """

    __slots__ = ("frame",)

    def __init__(self) -> None:
        self.frame: Frame | None = None


class Forward(Generic[_T]):
    """A module's ``forward`` (or ``_call_impl``) while runs hook it; a plan keeps one per
    hooked module and reuses it run after run, holding the module only weakly between runs.

    Its class is its state (NOTE [a state per class]). ``Forward(...)`` makes the one its
    plan's run uses alone: :class:`_Observing` for a plan's table of observers,
    :class:`_Reading` for one that only records a value the output may give, else
    :class:`_OneRun`. While installed: ``module``, ``inner`` (what ``module.<attr>`` was) and
    ``saved`` (the instance attribute it replaced, if any); between runs ``inner`` is None,
    and a call that looked it up just before it was removed calls whatever the module holds now.

    NOTE [a state per class]: each state of a wrapped forward is a small class whose
    ``__call__`` serves that state and nothing else. A run that is alone on a module (the
    common case) finds its plan's forward already in the right class, so entering and
    leaving it only set and clear the forward's fields, as cheap as a plain wrapper; the
    rare changes (a second run joining, runs leaving in another order, a library wrapping
    ours inside the block) swap ``__class__`` on the same object rather than putting a new
    object in the ``__dict__``, since references to it held elsewhere (that library's
    wrapper, a call in progress, the module's ``__reduce_ex__``, the runs' own lists) must
    see the new state. Every state has the same fields; each reads only its own.
    """

    __slots__ = ("__weakref__", "alone", "attr", "bound_reduce_ex", "inner", "module", "observe", "own", "ref",
                 "runner", "saved", "slot", "users")

    def __new__(cls, module: nn.Module, attr: str, runner: _Runner[_T], own: _T | None = None,
                slot: Slot | None = None) -> Forward[_T]:
        return object.__new__(_alone(own, slot))

    def __init__(self, module: nn.Module, attr: str, runner: _Runner[_T], own: _T | None = None,
                 slot: Slot | None = None) -> None:
        """Args: `runner`: see :data:`_Runner`; `own`, `slot`: the plan's table for the module
        and the plan's slot, for a ``Forward`` its plan's one run uses alone (see :class:`Slot`)."""
        self.ref = weakref.ref(module)
        self.attr = attr
        self.runner = runner
        self.own, self.slot = own, slot
        self.alone: type[Forward[Any]] = type(self)  # its state while its plan's one run uses it alone
        self.observe: PostEntry = _in_turn(own.obs if own is not None else ())  # an `_Observing` one's observers
        self.module: Any = None
        self.inner: UserCall | None = None
        self.saved: object = None
        self.users: Users[_T] = ()  # the runs it serves, outermost first (an `_Observing` one reads its slot's frame)
        self.bound_reduce_ex = self.reduce_ex  # made once: set as the module's `__reduce_ex__` while installed

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return self._outside(self.users, args, kwargs)

    def current_users(self) -> Users[_T]:
        """The runs using this forward, ``(frame, table)`` each, outermost first."""
        return self.users

    def _outside(self, users: Users[_T], args: tuple, kwargs: dict) -> Any:
        """A call for the `users` in scope, through the runner; the module's own forward when
        none is; what the module holds now when this forward is no longer installed."""
        inner = self.inner
        if inner is None:
            return getattr(self.ref(), self.attr)(*args, **kwargs)
        active = _active()
        mine = tuple([u for u in users if u[0] in active and not u[0].calling]) if active else ()
        if mine:
            return self.runner(self.module, inner, mine, args, kwargs)
        return inner(*args, **kwargs)

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
            elif v is not self.bound_reduce_ex:
                state[k] = v
        return (reduced[0], reduced[1], state, *reduced[3:])

    # -- the rare changes of state (under the lock) -------------------------------------------

    def _serve(self, users: Users[_T]) -> None:
        """Serve `users` (at least one) from now on, in the state that fits them.

        A call in another thread may see the new users with the old class, or the other way
        round: ``_OneRun`` then takes the path of ``_Shared`` (each call's users filtered by
        scope), and ``_Observing`` serves its slot's frame alone, a user before and after. A
        call that took ``_Shared``'s path before the swap reads ``users`` after it, so an
        ``_Observing`` one keeps its one user, the slot's frame, until that run leaves
        (``_uninstall``), never ``()`` while installed."""
        if len(users) > 1:
            kind: type[Forward[Any]] = _Shared
        elif self.slot is not None and users[0][0] is self.slot.frame and users[0][1] is self.own:
            kind = self.alone
        else:
            kind = _OneRun
        self.users = users
        if type(self) is not kind:
            self.__class__ = kind


def _alone(own: Table | None, slot: Slot | None) -> type[Forward[Any]]:
    """The state of a forward its plan's one run uses alone: observing when the plan's table
    has observers only, reading when it only records a value the output may give (and the
    run is the slot's)."""
    if slot is None or own is None:
        return _OneRun
    return _Observing if own.plain else _Reading if own.reading else _OneRun


def _in_turn(observers: Sequence[PostEntry]) -> PostEntry:
    """The observers as one entry: the one itself, or one calling each in turn."""
    if len(observers) == 1:
        return observers[0]

    def observe(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        for entry in observers:
            entry(frame, module, args, kwargs, output)

    return observe


class _Slotted(Forward[_T]):
    """A state serving its plan's one run alone, whose frame it reads in the plan's slot."""

    __slots__ = ()

    def current_users(self) -> Users[_T]:
        return ((self.slot.frame, self.own),)  # type: ignore[union-attr, return-value]


class _Observing(_Slotted[_T]):
    """Its plan's one run alone, the slot's frame, with observers only: the module's forward,
    then the observers (``fh.outputs``: ``entries.output_entry``'s store). A call inside a
    transform, or while the run's own spec function runs, takes the checked path of
    :func:`call`."""

    __slots__ = ()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        frame = self.slot.frame  # type: ignore[union-attr]
        inner = self.inner
        if frame in _active() and not frame.calling and inner is not None and _peek() is None:
            output = inner(*args, **kwargs)
            if _graph_task() == -1:  # not a recomputation during backward
                self.observe(frame, self.module, args, kwargs, output)
            return output
        return self._outside(self.current_users(), args, kwargs)


class _Reading(_Slotted[_T]):
    """Its plan's one run alone, the slot's frame, whose entries on the module only record a
    value its output may give (``Hooked.reading``: the attention pattern): where the call
    gives it (``op_mode.output_reading``), the call and the value with no op mode
    (``op_mode.read``); any other call takes the checked path of :func:`call`."""

    __slots__ = ()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        frame = self.slot.frame  # type: ignore[union-attr]
        inner, module = self.inner, self.module
        if frame in _active() and not frame.calling and inner is not None and _peek() is None \
                and not _compiling():
            users = ((frame, cast(Hooked, self.own)),)
            reading = op_mode.output_reading(module, inner, users, args, kwargs)
            if reading is not _OPS:
                return op_mode.read(reading, module, inner, users, args, kwargs, _graph_task() != -1)
        return self._outside(self.current_users(), args, kwargs)


class _OneRun(Forward[_T]):
    """One run: every call it sees through the runner (the full hot loop, or a compiled
    module's recorder); a run entered inside a ``torch.func`` transform is always one."""

    __slots__ = ()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        users, inner = self.users, self.inner
        if inner is not None and len(users) == 1:  # else: changing state in another thread (see `_serve`)
            frame = users[0][0]
            if frame in _active() and not frame.calling:
                return self.runner(self.module, inner, users, args, kwargs)
        return self._outside(users, args, kwargs)


class _Shared(Forward[_T]):
    """Several runs on one module: each call through the runner, for the runs in scope."""

    __slots__ = ()


class _Passing(Forward[_T]):
    """No run left, but someone else's forward wraps this one (so it stays in use): the
    module's own forward, nothing else. Its plan never reuses it."""

    __slots__ = ()

    def __call__(self, *args: object, **kwargs: object) -> Any:
        return self.inner(*args, **kwargs)  # type: ignore[misc]


# -- runs joining and leaving ------------------------------------------------------------------------


def install(frame: Frame, items: Sequence[Item[_T]], slot: Slot | None = None) -> list[Forward[_T]]:
    """Make `frame` a user of the wrapped forward of each module in `items`
    (``(module_ref, forward, hooked)``, from the plan), wrapping the modules not wrapped
    yet; returns the ``Forward`` objects `frame` uses. `slot`: the plan's, which `frame`
    takes when free and outside transforms (release it with :func:`uninstall`)."""
    installed: list[Forward[_T]] = []
    with _LOCK:
        try:
            if _take(slot, frame):
                _install_own(frame, items, installed)
            else:
                _install_joining(frame, items, installed)
        except BaseException:  # interrupted half-way: leave no module wrapped
            _uninstall(frame, installed, slot)
            raise
    return installed


def _take(slot: Slot | None, frame: Frame) -> bool:
    """Whether `frame` takes the plan's `slot`: free, and `frame` outside transforms."""
    if slot is None or slot.frame is not None or frame.level:
        return False
    slot.frame = frame
    return True


def _install_own(frame: Frame, items: Sequence[Item[_T]], installed: list[Forward[_T]]) -> None:
    """:func:`install` for the frame holding the plan's slot: the common case, each step
    once, where the plan's free ``Forward`` is already in its state for the slot's frame
    alone and the module is not wrapped; :func:`_join` for the others."""
    add = installed.append
    for ref, fwd, hooked in items:
        module = ref()
        if module is None:
            continue
        d = module.__dict__
        attr = fwd.attr
        if attr in d or fwd.inner is not None:  # wrapped already, or in someone's way
            add(_join(frame, module, d, fwd, hooked))
            continue
        fwd.module = module
        if fwd.alone is _OneRun:
            fwd.users = ((frame, hooked),)
        fwd.inner = getattr(module, attr)
        d[attr] = fwd
        if "__reduce_ex__" not in d:  # a module's own `__reduce_ex__` stays
            d["__reduce_ex__"] = fwd.bound_reduce_ex
        add(fwd)


def _install_joining(frame: Frame, items: Sequence[Item[_T]], installed: list[Forward[_T]]) -> None:
    """:func:`install` for a frame without the plan's slot: :func:`_join` for every module."""
    for ref, fwd, hooked in items:
        module = ref()
        if module is not None:
            installed.append(_join(frame, module, module.__dict__, fwd, hooked))


def _join(frame: Frame, module: nn.Module, d: dict[str, Any], fwd: Forward[_J], hooked: _J) -> Forward[_J]:
    """:func:`install` for a module already wrapped by a run (`frame` joins its users), or with
    a forward of its own in its ``__dict__`` (wrapped around it), or whose plan's ``Forward``
    is in use (a new one wraps it), or for a frame without the plan's slot."""
    attr = fwd.attr
    current = d.get(attr)
    if isinstance(current, Forward) and current.module is module:  # wrapped already
        current._serve((*current.current_users(), (frame, hooked)))
        return current
    if fwd.inner is not None:  # in use (maybe under someone else's forward): never reuse
        fwd = Forward(module, attr, fwd.runner)
    fwd.saved, fwd.module = current, module
    fwd.inner = getattr(module, attr)
    fwd._serve(((frame, hooked),))
    d[attr] = fwd
    d.setdefault("__reduce_ex__", fwd.bound_reduce_ex)
    return fwd


def uninstall(frame: Frame, installed: Sequence[Forward[Table]], slot: Slot | None = None) -> None:
    """Remove `frame` from each wrapped forward; restore the modules it was the last user of;
    release `slot` if `frame` holds it.

    A forward someone else replaced since (wrapping ours) stays in place, passing calls through.
    """
    with _LOCK:
        _uninstall(frame, installed, slot)


def _uninstall(frame: Frame, installed: Sequence[Forward[Table]], slot: Slot | None) -> None:
    for fwd in reversed(installed):
        if isinstance(fwd, _Slotted):  # the common case: its one run is the slot's frame, `frame`
            _unwrap(fwd)
            if fwd.users:  # left by `_serve` for a call racing the swap: the frame is not kept alive
                fwd.users = ()
        else:
            _leave(fwd, frame)
    if slot is not None and slot.frame is frame:
        slot.frame = None


def _leave(fwd: Forward[Table], frame: Frame) -> None:
    """`frame` leaves `fwd`, not a ``_Slotted`` one (those have their slot's frame alone)."""
    kind = type(fwd)
    if kind is _OneRun and fwd.users and fwd.users[0][0] is frame:
        _unwrap(fwd)
        fwd.users = ()
        if fwd.inner is None and fwd.alone is not _OneRun:  # unwrapped, its plan's: back to its state
            fwd.__class__ = fwd.alone
    elif kind is _Shared:
        fwd._serve(tuple([u for u in fwd.users if u[0] is not frame]))


def _unwrap(fwd: Forward[Table]) -> None:
    """Give the module back what it had; or, when someone wrapped `fwd` since (theirs stays in the ``__dict__``), let it pass calls
    through to the module's forward (:class:`_Passing`)."""
    d = fwd.module.__dict__
    if d.get("__reduce_ex__") is fwd.bound_reduce_ex:  # ours (a module's own `__reduce_ex__` stays)
        del d["__reduce_ex__"]
    attr = fwd.attr
    if d.get(attr) is not fwd:  # someone wrapped ours since: theirs stays, ours passes through
        fwd.__class__ = _Passing
        return
    saved = fwd.saved
    if saved is None:
        del d[attr]
    else:
        d[attr] = saved
        fwd.saved = None
    fwd.inner = None  # before `module`: a racing call reads `module` first, then `inner`
    fwd.module = None
