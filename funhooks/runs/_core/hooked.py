"""Hooked tables: one plan's entries for one module, grouped by when the hot loop runs them.

Which entry a spec gets is chosen when the plan is made, from :data:`_ENTRIES`, keyed by the
spec's ``(hook, role)``; where the hot loop runs it, from :data:`_PLACES`, keyed by its
``(hook, is_edit)``. The table is what the wrapped forward (``forward``) reads per call:
forward-pre editors, forward-pre observers; the op entries run *during* the module's own
forward (``around``); editors (interventions among them), gradient watchers, observers;
backward hooks around it. ``plain`` is True only for a table of observers: its plan's one
run then calls them straight after the module's forward (``forward._Observing``);
``reading`` only for a table whose entries record one value the module's output may give
(the attention pattern): its plan's one run then reads it there where it can
(``forward._Reading``).

Cost: built once per plan and module; reading it is attribute loads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Any

from funhooks.specs.spec import Spec

from . import entries
from .entries import BackwardEntry, PostEntry, PreEntry
from .op_mode import OpEntry, op_entry
from .types import Key, Selected

__all__ = ["Hooked"]


class _Place(enum.Enum):
    """Where the hot loop runs an entry (``forward.call``), in its order."""

    PRE_EDIT = enum.auto()
    PRE_OBSERVE = enum.auto()
    AROUND = enum.auto()  # during the module's forward, on the ops it calls
    EDIT = enum.auto()
    GRAD = enum.auto()
    OBSERVE = enum.auto()
    BACKWARD_EDIT = enum.auto()
    BACKWARD_OBSERVE = enum.auto()
    BACKWARD_PRE_EDIT = enum.auto()
    BACKWARD_PRE_OBSERVE = enum.auto()


_Make = Callable[[Spec, Key, int, bool], Any]
"""Makes a spec's entry on one module: ``(spec, key, rank, copies) -> entry`` (see ``entries``)."""

_ENTRIES: dict[tuple[str, str], _Make] = {
    ("forward_pre", "input"): entries.inputs_entry,
    ("forward_pre", "call"): entries.args_call_entry,
    ("forward_pre", "intervene"): entries.args_intervene_entry,
    ("around", "op"): op_entry,
    ("forward", "output"): entries.output_entry,
    ("forward", "call"): entries.output_call_entry,
    ("forward", "intervene"): entries.output_intervene_entry,
    ("output_grad", "grad"): entries.grads_entry,
    ("output_grad", "grad_output"): entries.grads_entry,
    ("backward", "call"): entries.backward_entry,
    ("backward_pre", "call"): entries.backward_entry,
}
"""The entry of a spec, by its ``(hook, role)``. ``param_grad`` specs have none: they hook parameters."""

_PLACES: dict[tuple[str, bool], _Place] = {
    ("forward_pre", True): _Place.PRE_EDIT,
    ("forward_pre", False): _Place.PRE_OBSERVE,
    ("around", True): _Place.AROUND,
    ("around", False): _Place.AROUND,
    ("forward", True): _Place.EDIT,
    ("forward", False): _Place.OBSERVE,
    ("output_grad", False): _Place.GRAD,
    ("backward", True): _Place.BACKWARD_EDIT,
    ("backward", False): _Place.BACKWARD_OBSERVE,
    ("backward_pre", True): _Place.BACKWARD_PRE_EDIT,
    ("backward_pre", False): _Place.BACKWARD_PRE_OBSERVE,
}
"""Where the hot loop runs a spec's entry, by its ``(hook, is_edit)``."""


def _placed(specs: Iterable[Selected], copies: bool) -> dict[_Place, list[Any]]:
    """Each spec's entry, by where the hot loop runs it, in spec order."""
    placed: dict[_Place, list[Any]] = {}
    for spec, key, rank in specs:
        entry = _ENTRIES[(spec.hook, spec.role)](spec, key, rank, copies)
        placed.setdefault(_PLACES[(spec.hook, spec.is_edit)], []).append(entry)
    return placed


def _by_op(op_entries: list[OpEntry]) -> dict[str, tuple[OpEntry, ...]]:
    """Op entries by the name of each op they read (a derived op, the attention pattern, reads several)."""
    ops: dict[str, list[OpEntry]] = {}
    for entry in op_entries:
        for name in entry.reads:
            ops.setdefault(name, []).append(entry)
    return {name: tuple(found) for name, found in ops.items()}


def _reads_output(op_entries: list[OpEntry], cls: type) -> bool:
    """Whether the entries only record one derived value that the output of a module of class
    `cls` may give (``Derived.in_output``: the attention pattern of a Hugging Face attention
    module), each at its first call or every call: a call then needs no op mode where the value
    can be read there (``op_mode.call``, ``forward._Reading``)."""
    return bool(op_entries) and all(
        entry.derived is not None and entry.derived.in_output(cls) and entry.name == op_entries[0].name
        and entry.store_out is not None and entry.store_in is None and entry.edit is None and not entry.call
        for entry in op_entries)


class Hooked:
    """One plan's entries for one module, sorted by when the hot loop runs them: forward-pre
    editors, then forward-pre observers; op entries during the module's forward; the module;
    editors, then gradient watchers, then observers (so a recording sees the value after
    every editor); backward hooks around it, editors first (so backward observers see the
    edited gradients too)."""

    __slots__ = ("around", "backward", "backward_pre", "edits", "grads", "obs", "op_entries", "ops", "path", "plain",
                 "pre_edits", "pre_obs", "reading", "reads_output")

    def __init__(self, path: str, cls: type, specs: Iterable[Selected], *, copies: bool = False,
                 watch: PreEntry | None = None) -> None:
        """Args: `cls`: the module's class; `specs`: the specs selecting the module; `copies`:
        the specs store copies (inside compiled graphs and transforms); `watch`: the entry
        hooking the FSDP-sharded parameters this module manages (``sharded``)."""
        self.path = path
        placed = _placed(specs, copies)
        at = placed.get
        self.pre_edits: tuple[PreEntry, ...] = tuple(at(_Place.PRE_EDIT, ()))
        self.pre_obs: tuple[PreEntry, ...] = (*(() if watch is None else (watch,)), *at(_Place.PRE_OBSERVE, ()))
        op_entries: list[OpEntry] = at(_Place.AROUND, [])
        self.op_entries = tuple(op_entries)
        self.ops = _by_op(op_entries)  # op name -> its entries
        self.around = bool(self.ops)  # whether the module's forward runs inside an op mode
        self.reads_output = _reads_output(op_entries, cls)  # whether it may read its op value off the output instead
        self.edits: tuple[PostEntry, ...] = tuple(at(_Place.EDIT, ()))
        self.grads: tuple[PostEntry, ...] = tuple(at(_Place.GRAD, ()))
        self.obs: tuple[PostEntry, ...] = tuple(at(_Place.OBSERVE, ()))
        self.backward: tuple[BackwardEntry, ...] = (*at(_Place.BACKWARD_EDIT, ()), *at(_Place.BACKWARD_OBSERVE, ()))
        self.backward_pre: tuple[BackwardEntry, ...] = (*at(_Place.BACKWARD_PRE_EDIT, ()),
                                                        *at(_Place.BACKWARD_PRE_OBSERVE, ()))
        others = bool(self.pre_edits or self.pre_obs or self.edits or self.grads or self.backward or self.backward_pre)
        self.plain = not (others or self.ops)
        self.reading = self.reads_output and not (others or self.obs)
