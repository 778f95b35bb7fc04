"""The run core's shared types: what a frame's buffer holds, and what a frame reads of its plan.

Every module of the core may import this one, and it imports none of them: with it, no module
of the core names another's types under ``TYPE_CHECKING``. A frame reaches its plan through
:class:`Layout`, a protocol ``Plan`` satisfies, so ``frame`` sits below every module whose
entries take a frame.

Cost: nothing at run time: names for annotations, and small classes made once per plan or per
missed op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, TypeAlias

import torch
from torch import nn

from funhooks.specs.spec import Spec

__all__ = ["Check", "Handle", "Key", "Layout", "Miss", "Pending", "Selected", "Stored", "UserCall", "WatchState"]

Key: TypeAlias = tuple[str, str]
"""Where a value is stored in the Record: ``(module path, record name)``."""

Check: TypeAlias = int | tuple[tuple[torch.Tensor, int], ...] | None
"""A stored value's in-place check: the version counter of the value, when it is one tensor;
``(tensor, version)`` for each tensor in it; None when there is nothing to check (no tensor,
or a private copy)."""

Stored: TypeAlias = tuple[Key, Any, Check]
"""One entry of a frame's buffer: ``(key, value, check)``, read by unpacking.

A plain tuple on purpose: entries make one per stored value of every hooked call (the hot
path), where a NamedTuple would cost a Python call each. The value is what the spec stored,
the user's data (a tensor, a pytree, whatever the spec's function returned), or a
``frame.GradSlot`` that backward fills in."""

UserCall: TypeAlias = Callable[..., Any]
"""The user's code a run calls through: a module's own forward, or a function calling the
model; it takes and returns the user's values, whatever they are."""


class Selected(NamedTuple):
    """One spec on one module it selects: what a plan builds that module's entries from."""

    spec: Spec
    key: Key
    rank: int
    """The module's index among the modules the spec's selector matched (``nth``)."""


class Miss(NamedTuple):
    """One call of a module in which an op entry took no op (or fewer calls of it than its
    ``call`` index): what the run's "matched nothing" error says if no call takes one."""

    spec: Spec
    op: str
    """The op name the entry takes."""
    call: int | None
    """The entry's ``call`` index, None for every call."""
    module: nn.Module
    path: str
    taken: int
    """How many calls of the op the module's own code made."""
    outside: int
    """How many calls of it ran inside its submodules' calls (not counted unless ``deep``)."""
    called: list[str]
    """Every op the call called, sorted."""


Pending: TypeAlias = tuple[torch.Tensor, Any, int]
"""A sharded parameter's ``.grad`` before a backward pass: ``(old, the copy FSDP adds to (a
``DTensor``), the version of the copy's local tensor)``."""


class WatchState:
    """One frame's watch of one FSDP module (``sharded``): the unsharded tensors hooked, the
    backward pass in progress and, per sharded parameter that got a gradient in it, its
    ``.grad`` before (:data:`Pending`), or None where it held none."""

    __slots__ = ("hooked", "pass_id", "pending")

    def __init__(self) -> None:
        self.hooked: dict[int, torch.Tensor] = {}
        self.pass_id: int | None = None
        self.pending: dict[object, Pending | None] = {}


class Handle(Protocol):
    """A hook registered with PyTorch (a tensor's ``register_hook``), removed when its run ends."""

    def remove(self) -> None: ...


class Layout(Protocol):
    """What a frame reads of its plan to build a Record."""

    @property
    def notes(self) -> dict[tuple[str, str | None], str]:
        """Why some paths (and names) are absent, known when the plan was made."""

    @property
    def spec_of(self) -> dict[Key, Spec]:
        """The spec storing at each key."""

    @property
    def name_rank(self) -> dict[str, int]:
        """Each record name's rank in spec order."""

    @property
    def paths(self) -> list[str]:
        """Every path, in module order."""

    @property
    def order(self) -> dict[str, tuple[int, int]]:
        """Each path's place in module order."""
