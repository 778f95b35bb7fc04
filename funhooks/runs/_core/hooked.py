"""Hooked tables: one plan's entries for one module, grouped by when the hot loop runs them.

The table is what :func:`funhooks.runs._core.forward.call` reads per call: forward-pre editors,
forward-pre observers; the op entries run *during* the module's own forward (``around``);
editors (interventions among them), gradient watchers, observers; backward hooks around it.
``plain`` is True only for a table of plain observers: the one case the wrapped forward
runs inlined, without :func:`call`; ``stores`` is the key of a table whose one entry stores
the output as is (``fh.outputs``), which the wrapped forward then stores itself.

Cost: built once per plan and module; reading it is attribute loads.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from torch import nn

from funhooks.specs.editing import Intervention
from funhooks.specs.spec import Spec

from .entries import BackwardEntry, PostEntry, PreEntry, backward_hook, post_entry, pre_entry, stores_as_is
from .frame import Frame
from .op_mode import OpEntry, op_entry
from .types import Key, Selected

__all__ = ["Hooked", "intervene_entry", "intervene_pre_entry"]


def intervene_entry(spec: Spec, key: Key, rank: int) -> PostEntry:
    """The entry of an intervention on a module's output (``spec.action`` an intervention value):
    it applies with the frame's per-call values, counting the calls it applied to in the frame
    (a Record source holding several calls gives call k to the module's k-th call)."""
    apply, path = cast(Intervention, spec.action).apply, key[0]

    def intervene(frame: Frame, module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        count = frame.counts.get(intervene, 0)
        frame.counts[intervene] = count + 1
        return apply(output, spec, path, rank, count, frame.values, frame.caller)

    return intervene


def intervene_pre_entry(spec: Spec, key: Key, rank: int) -> PreEntry:
    """The entry of an intervention on a module's positional arguments (a standard point that
    is a module's input): as :func:`intervene_entry`, on the args tuple."""
    apply, path = cast(Intervention, spec.action).apply, key[0]

    def intervene_args(frame: Frame, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        count = frame.counts.get(intervene_args, 0)
        frame.counts[intervene_args] = count + 1
        return apply(args, spec, path, rank, count, frame.values, frame.caller)

    return intervene_args


class Hooked:
    """One plan's entries for one module, sorted by when the hot loop runs them: forward-pre
    editors, then forward-pre observers; op entries during the module's forward; the module;
    editors, then gradient watchers, then observers (so a recording sees the value after
    every editor); backward hooks around it."""

    __slots__ = ("around", "backward", "backward_pre", "edits", "grads", "obs", "ops", "path", "plain", "pre_edits",
                 "pre_obs", "stores")

    def __init__(self, path: str, specs: Iterable[Selected], *, copies: bool = False,
                 watch: PreEntry | None = None) -> None:
        """Args: `specs`: the specs selecting the module; `copies`: the specs store copies (inside compiled graphs and
        transforms); `watch`: the entry hooking the FSDP-sharded parameters this module
        manages (``sharded``)."""
        self.path = path
        pre_edits: list[PreEntry] = []
        pre_obs: list[PreEntry] = [] if watch is None else [watch]
        edits: list[PostEntry] = []
        grads: list[PostEntry] = []
        obs: list[PostEntry] = []
        last: Spec | None = None  # the last forward spec, and its key
        last_key: Key | None = None
        backward: list[tuple[bool, BackwardEntry]] = []
        backward_pre: list[tuple[bool, BackwardEntry]] = []
        ops: dict[str, list[OpEntry]] = {}
        for spec, key, rank in specs:  # `param_grad` specs never reach here: they hook parameters
            if spec.hook == "forward_pre" and spec.role == "intervene":
                pre_edits.append(intervene_pre_entry(spec, key, rank))
            elif spec.hook == "forward_pre":
                (pre_edits if spec.is_edit else pre_obs).append(pre_entry(spec, key, copies))
            elif spec.hook == "around":
                entry = op_entry(spec, key, rank, copies)
                for name in entry.reads:  # a derived op (the attention pattern) reads several
                    ops.setdefault(name, []).append(entry)
            elif spec.hook == "output_grad":
                grads.append(post_entry(spec, key, copies))
            elif spec.hook == "forward" and spec.role == "intervene":
                edits.append(intervene_entry(spec, key, rank))
            elif spec.hook == "forward":
                (edits if spec.is_edit else obs).append(post_entry(spec, key, copies))
                last, last_key = spec, key
            elif spec.hook == "backward":
                backward.append((spec.is_edit, backward_hook(spec, key)))
            else:
                backward_pre.append((spec.is_edit, backward_hook(spec, key)))
        self.pre_edits, self.pre_obs = tuple(pre_edits), tuple(pre_obs)
        self.edits, self.grads, self.obs = tuple(edits), tuple(grads), tuple(obs)
        self.ops = {name: tuple(entries) for name, entries in ops.items()}  # op name -> its entries
        self.around = bool(ops)  # whether the module's forward runs inside an op mode
        # editors first, so backward observers see the edited gradients too
        self.backward = tuple(f for _, f in sorted(backward, key=lambda e: not e[0]))
        self.backward_pre = tuple(f for _, f in sorted(backward_pre, key=lambda e: not e[0]))
        self.plain = not (pre_edits or pre_obs or edits or grads or backward or backward_pre or ops)
        self.stores: Key | None = None  # the key, when the one entry stores the output as is
        if self.plain and len(obs) == 1 and stores_as_is(last, copies):  # type: ignore[arg-type]  # plain: an observer
            self.stores = last_key
