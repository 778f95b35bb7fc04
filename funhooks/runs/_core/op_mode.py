"""Ops inside a forward: specs on the torch functions a hooked module calls.

A spec whose ``hook`` is ``around`` (``fh.op_outputs``, ``fh.op_inputs``, ``fh.op_edit``,
interventions with ``op=``) runs *during* the module's own forward call: :func:`call` enters
a ``TorchFunctionMode`` for that call only, for the runs that see it, and leaves it when the
forward returns. Every torch function called meanwhile (ops, tensor methods, operators such
as ``a + b``) reaches the mode; one named by an op spec is run with the spec's entries
around it, in the order of the module-level hot loop: input stores, the op, editors (every
run's, in run order), output stores; a recording sees the value after every editor.

An op is named by its function or its name, and every spelling of it matches:
``torch.add``, ``Tensor.add`` and ``a + b`` are all ``add`` (``a += b`` is ``add_``).
By default only the module's own code counts: an op called inside one of its submodules'
calls is not the module's (``fh.op(name, deep=True)`` counts them too); telling them apart
walks up the Python frames of a matched op to the first module call. A call that skips an op
records nothing for it; an op spec that matched nothing in every call of its module in a run
raises :class:`SelectorError` when the run ends, listing the ops the first such call made.

Cost: nothing for modules without op specs, and nothing for any module outside the calls of
a selected one. During a selected module's forward, one Python ``__torch_function__`` per
torch function call (about 1.5 µs here, pass-through included), and for a matched op a
walk of a few frames and its entries. Inside a ``torch.compile`` trace frames cannot be
walked: only ``deep=True`` op specs work there.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from typing import Protocol, cast

from torch import nn
from torch.overrides import TorchFunctionMode

from funhooks import _torch
from funhooks.errors import TransformError
from funhooks.specs.ops import OP_NAMES, At, Derived, Op, OpAction, Reading, op_name
from funhooks.specs.selector import path_label
from funhooks.specs.spec import Spec

from .entries import call_spec, checked_edit, intervention
from .frame import Frame
from .types import Key, Miss, UserCall
from .values import preparer, snapshot, unchecked

__all__ = ["OpEntry", "call", "op_entry", "output_reading", "read"]

_named = OP_NAMES.get
"""A torch function's op name once seen (one builtin call per op in the hot loop), else None."""


class OpEntry:
    """One op spec on one module: which op it takes (name, ``call`` index, ``deep``) and
    what it does there: store the inputs or the output, or edit the output."""

    __slots__ = ("call", "deep", "derived", "edit", "name", "reads", "spec", "store_in", "store_out")

    def __init__(self, spec: Spec, op: Op) -> None:
        self.spec, self.name, self.call, self.deep = spec, op.name, op.call, op.deep
        self.reads = op.reads  # the torch ops whose calls it takes
        self.derived = op if isinstance(op, Derived) else None  # a value read off those calls
        self.store_in: Callable[[Frame, tuple], None] | None = None
        self.store_out: Callable[[Frame, object], None] | None = None
        self.edit: Callable[[Frame, nn.Module, tuple, dict, object], object] | None = None


class _OpTable(Protocol):
    """What the op mode reads of a user's table (a ``Hooked``): its op entries by op name."""

    @property
    def ops(self) -> dict[str, tuple[OpEntry, ...]]: ...

    @property
    def op_entries(self) -> tuple[OpEntry, ...]: ...

    @property
    def reads_output(self) -> bool:
        """Whether its entries only record a derived value the module's output may give."""


_OpUsers = Sequence[tuple[Frame, _OpTable]]
"""The runs a hooked call's op mode serves: ``(frame, table)``, outermost run first."""


def _store(spec: Spec, key: Key, copies: bool) -> Callable[[Frame, object], None]:
    prep, keep = preparer(spec), unchecked if copies else snapshot

    def store(frame: Frame, value: object) -> None:
        frame.buffer.append((key, *keep(value if prep is None else prep(value))))

    return store


def op_entry(spec: Spec, key: Key, rank: int, copies: bool = False) -> OpEntry:
    """The entry of an ``around`` spec on the module at ``key[0]``, the `rank`-th module its
    selector matched. `copies`: store copies (inside compiled graphs and transforms)."""
    action, path = cast(OpAction, spec.action), key[0]
    op = action.op
    entry = OpEntry(spec, op)
    kind = action.kind
    if kind == "output":
        entry.store_out = _store(spec, key, copies)
    elif kind == "input":
        entry.store_in = _store(spec, key, copies)
    elif kind == "edit":

        def edit_op(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
            new = call_spec(frame, spec, path, (module, args, kwargs, output))
            return checked_edit(frame, spec, path, f"output of `{op.name}`", output, new)

        entry.edit = edit_op
    else:  # an intervention
        apply = intervention(action.intervention, spec, key, rank)

        def intervene_op(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
            return apply(frame, output)

        entry.edit = intervene_op
    return entry


def _own(start: types.FrameType | None, mark: types.FrameType | None) -> bool:
    """Whether the op whose caller's frame is `start` was called by the module whose
    forward `mark`'s frame called, and not inside one of its submodules' calls."""
    codes = _torch.MODULE_CALL_CODES
    f = start
    while f is not None and f is not mark:
        if f.f_code in codes and f.f_back is not mark:  # another module's call, below ours
            return False
        f = f.f_back
    return f is mark


class _Mode(TorchFunctionMode):
    """The mode of one hooked module call: the op entries of every run that sees it."""

    def __init__(self, module: nn.Module, users: _OpUsers, mark: types.FrameType | None, replay: bool) -> None:
        super().__init__()
        self.module, self.users, self.mark, self.replay = module, users, mark, replay
        self.counts: dict[OpEntry, int] = {}  # matches per entry in this call
        self.outside: dict[OpEntry, int] = {}  # matches inside submodules, not counted
        self.seen: set[str] = set()  # the ops called, for the error when a spec matched none
        # the op names some user takes: one dict lookup decides for each torch function called
        self.taken = users[0][1].ops if len(users) == 1 else {name for _, hooked in users for name in hooked.ops}

    def __torch_function__(self, func: Callable[..., object], types: object, args: tuple = (),
                           kwargs: dict | None = None) -> object:
        name = _named(func) or op_name(func)
        self.seen.add(name)
        if name not in self.taken:
            return func(*args, **kwargs) if kwargs else func(*args)
        found = [(frame, entry) for frame, hooked in self.users for entry in hooked.ops.get(name, ())]
        return self._run(func, found, args, kwargs or {})

    def _run(self, func: Callable[..., object], found: list[tuple[Frame, OpEntry]], args: tuple,
             kwargs: dict) -> object:
        """A matched op with its entries around it: input stores, the op, editors, output stores."""
        taken = self._taken(found)
        derived = [(frame, entry) for frame, entry in taken if entry.derived is not None]
        if derived:
            taken = [(frame, entry) for frame, entry in taken if entry.derived is None]
        if not self.replay:
            _store_inputs(taken, args)
        if derived:
            reader: Derived = derived[0][1].derived  # type: ignore[assignment]
            output = reader.run(op_name(func), func, args, kwargs, self._at(derived, args, kwargs))
        else:
            output = func(*args, **kwargs)
        output = self._edited(taken, args, kwargs, output)
        if not self.replay:
            _store_output(taken, output)
        return output

    def _edited(self, taken: list[tuple[Frame, OpEntry]], args: tuple, kwargs: dict, output: object) -> object:
        """The op's output after every editor among `taken`, in run order."""
        for frame, entry in taken:
            if entry.edit is not None:
                new = entry.edit(frame, self.module, args, kwargs, output)
                if new is not None:
                    output = new
        return output

    def _taken(self, found: list[tuple[Frame, OpEntry]]) -> list[tuple[Frame, OpEntry]]:
        """The entries that take this call of the op: the module's own call (or ``deep``), and
        the entry's ``call`` index; counted either way."""
        own = None
        taken = []
        for frame, entry in found:
            if not entry.deep:
                if own is None:  # 0: here, 1: `_run`, 2: `__torch_function__`, 3: what called the op
                    own = _own(sys._getframe(3), self.mark)
                if not own:
                    self.outside[entry] = self.outside.get(entry, 0) + 1
                    continue
            count = self.counts.get(entry, 0)
            self.counts[entry] = count + 1
            if entry.call is None or entry.call == count:
                taken.append((frame, entry))
        return taken

    def _at(self, derived: list[tuple[Frame, OpEntry]], args: tuple, kwargs: dict) -> At:
        """How a derived op hands its points to the `derived` entries: editors, then stores."""
        module, replay = self.module, self.replay

        def at(point: str, value: object) -> object:
            for frame, entry in derived:
                if entry.name == point and entry.edit is not None:
                    new = entry.edit(frame, module, args, kwargs, value)
                    if new is not None:
                        value = new
            if not replay:
                for frame, entry in derived:
                    if entry.name == point and entry.store_out is not None:
                        entry.store_out(frame, value)
            return value

        return at

    def note(self, module: nn.Module, path: str) -> None:
        """Note in each frame which op specs took an op in this call, and for one that took
        none (or fewer calls than its ``call`` index) what this call called, for the error
        ``Frame.check`` raises if no call of the run takes one."""
        for frame, hooked in self.users:
            missed, took = frame.missed, frame.took
            for entry in hooked.op_entries:
                n = self.counts.get(entry, 0)
                if n > (entry.call or 0):
                    took.add(entry)
                elif entry not in missed:
                    missed[entry] = Miss(entry.spec, entry.name, entry.call, module, path, n,
                                         self.outside.get(entry, 0), sorted(self.seen))


def _store_inputs(taken: list[tuple[Frame, OpEntry]], args: tuple) -> None:
    for frame, entry in taken:
        if entry.store_in is not None:
            entry.store_in(frame, args)


def _store_output(taken: list[tuple[Frame, OpEntry]], output: object) -> None:
    for frame, entry in taken:
        if entry.store_out is not None:
            entry.store_out(frame, output)


def call(module: nn.Module, inner: UserCall, users: _OpUsers, path: str, args: tuple, kwargs: dict,
         replay: bool) -> object:
    """``inner(*args, **kwargs)`` inside the mode of `users` (``(frame, hooked)`` pairs whose
    tables have op entries); then note which op specs matched (``Frame.check``). Where every
    user only records a value the call's output gives (``Hooked.reads_output``: the attention
    pattern, read off a Hugging Face attention module run eagerly), no mode: :func:`read`, where
    :func:`output_reading` says the call gives it."""
    compiling = _torch.is_compiling()
    if compiling:
        for frame, hooked in users:
            for entry in hooked.op_entries:
                if not entry.deep:
                    raise TransformError(
                        f"{frame.caller}: inside `torch.compile`d code an op spec also takes its module's "
                        f"submodules' ops, as frames cannot be walked there, got {entry.spec!r} on module "
                        f"{path_label(path)}. Pass `fh.op({entry.name!r}, deep=True)`, or run it eagerly."
                    )
    else:
        reading = output_reading(module, inner, users, args, kwargs)
        if reading is not Reading.OPS:
            return read(reading, module, inner, users, args, kwargs, replay)
    mode = _Mode(module, users, None if compiling else sys._getframe(), replay)
    with mode:
        output = inner(*args, **kwargs)
    mode.note(module, path)
    return output


def _derived(hooked: _OpTable) -> Derived:
    """The derived value a table that only records one (``reads_output``) records."""
    return cast(Derived, hooked.op_entries[0].derived)


def output_reading(module: nn.Module, inner: UserCall, users: _OpUsers, args: tuple, kwargs: dict) -> Reading:
    """How this call gives the one derived value every user only records, off its output
    (``Derived.reading``); ``Reading.OPS`` where a user does more, or records another value,
    or the call cannot give it."""
    first = users[0][1].op_entries[0].name
    if all(hooked.reads_output and hooked.op_entries[0].name == first for _, hooked in users):
        return _derived(users[0][1]).reading(module, inner, args, kwargs)
    return Reading.OPS


def read(reading: Reading, module: nn.Module, inner: UserCall, users: _OpUsers, args: tuple, kwargs: dict,
         replay: bool) -> object:
    """A call whose users only record one derived value, read off the call's output the way
    `reading` (from :func:`output_reading`) says, with no op mode (``Derived.read``: the
    attention pattern of a Hugging Face attention module, run as eager attention); each entry
    took its one value."""
    output, value = _derived(users[0][1]).read(reading, module, inner, args, kwargs, users[0][0].shared)
    for frame, hooked in users:
        for entry in hooked.op_entries:
            if not replay:
                cast(Callable[[Frame, object], None], entry.store_out)(frame, value)
            frame.took.add(entry)
    return output
