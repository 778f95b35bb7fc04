"""Hooked tables: one plan's entries for one module, grouped by when the hot loop runs them.

Which entry a spec gets is chosen when the plan is made, from :data:`ENTRIES`, keyed by the
spec's ``(hook, role)``; where the hot loop runs it, from :data:`PLACES`, keyed by its
``(hook, is_edit)``. The table is what the wrapped forward (``forward``) reads per call:
forward-pre editors, forward-pre observers; the op entries run *during* the module's own
forward (``around``); editors (interventions among them), gradient watchers, observers;
backward hooks around it. ``plain`` is True only for a table of observers: its plan's one
run then calls them straight after the module's forward (``forward.Observing``).

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

__all__ = ["ENTRIES", "PLACES", "Hooked", "Place"]


class Place(enum.Enum):
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


Make = Callable[[Spec, Key, int, bool], Any]
"""Makes a spec's entry on one module: ``(spec, key, rank, copies) -> entry`` (see ``entries``)."""

ENTRIES: dict[tuple[str, str], Make] = {
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

PLACES: dict[tuple[str, bool], Place] = {
    ("forward_pre", True): Place.PRE_EDIT,
    ("forward_pre", False): Place.PRE_OBSERVE,
    ("around", True): Place.AROUND,
    ("around", False): Place.AROUND,
    ("forward", True): Place.EDIT,
    ("forward", False): Place.OBSERVE,
    ("output_grad", False): Place.GRAD,
    ("backward", True): Place.BACKWARD_EDIT,
    ("backward", False): Place.BACKWARD_OBSERVE,
    ("backward_pre", True): Place.BACKWARD_PRE_EDIT,
    ("backward_pre", False): Place.BACKWARD_PRE_OBSERVE,
}
"""Where the hot loop runs a spec's entry, by its ``(hook, is_edit)``."""


def _placed(specs: Iterable[Selected], copies: bool) -> dict[Place, list[Any]]:
    """Each spec's entry, by where the hot loop runs it, in spec order."""
    placed: dict[Place, list[Any]] = {}
    for spec, key, rank in specs:
        entry = ENTRIES[(spec.hook, spec.role)](spec, key, rank, copies)
        placed.setdefault(PLACES[(spec.hook, spec.is_edit)], []).append(entry)
    return placed


def _by_op(op_entries: list[OpEntry]) -> dict[str, tuple[OpEntry, ...]]:
    """Op entries by the name of each op they read (a derived op, the attention pattern, reads several)."""
    ops: dict[str, list[OpEntry]] = {}
    for entry in op_entries:
        for name in entry.reads:
            ops.setdefault(name, []).append(entry)
    return {name: tuple(found) for name, found in ops.items()}


class Hooked:
    """One plan's entries for one module, sorted by when the hot loop runs them: forward-pre
    editors, then forward-pre observers; op entries during the module's forward; the module;
    editors, then gradient watchers, then observers (so a recording sees the value after
    every editor); backward hooks around it, editors first (so backward observers see the
    edited gradients too)."""

    __slots__ = ("around", "backward", "backward_pre", "edits", "grads", "obs", "ops", "path", "plain", "pre_edits",
                 "pre_obs")

    def __init__(self, path: str, specs: Iterable[Selected], *, copies: bool = False,
                 watch: PreEntry | None = None) -> None:
        """Args: `specs`: the specs selecting the module; `copies`: the specs store copies (inside compiled graphs and
        transforms); `watch`: the entry hooking the FSDP-sharded parameters this module
        manages (``sharded``)."""
        self.path = path
        placed = _placed(specs, copies)
        at = placed.get
        self.pre_edits: tuple[PreEntry, ...] = tuple(at(Place.PRE_EDIT, ()))
        self.pre_obs: tuple[PreEntry, ...] = (*(() if watch is None else (watch,)), *at(Place.PRE_OBSERVE, ()))
        self.ops = _by_op(at(Place.AROUND, []))  # op name -> its entries
        self.around = bool(self.ops)  # whether the module's forward runs inside an op mode
        self.edits: tuple[PostEntry, ...] = tuple(at(Place.EDIT, ()))
        self.grads: tuple[PostEntry, ...] = tuple(at(Place.GRAD, ()))
        self.obs: tuple[PostEntry, ...] = tuple(at(Place.OBSERVE, ()))
        self.backward: tuple[BackwardEntry, ...] = (*at(Place.BACKWARD_EDIT, ()), *at(Place.BACKWARD_OBSERVE, ()))
        self.backward_pre: tuple[BackwardEntry, ...] = (*at(Place.BACKWARD_PRE_EDIT, ()),
                                                        *at(Place.BACKWARD_PRE_OBSERVE, ()))
        self.plain = not (self.pre_edits or self.pre_obs or self.edits or self.grads or self.backward
                          or self.backward_pre or self.ops)
