"""RecordNode: what one module stored in a Record, and how a lookup that misses explains itself.

A node maps record names to the values of every call; ``node[name]`` is the single value of
a module that ran once. A missing path or name raises ``RecordKeyError`` (a ``KeyError``),
with the notes the run core left on why it is absent (a gradient that came after the block,
a container that never runs).

Cost: a node is a view over the Record's own dict: nothing is copied.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, TypeAlias

import torch

from funhooks._frozen import Frozen
from funhooks.errors import RecordError, RecordKeyError

__all__ = ["Calls", "Notes", "RecordData", "RecordNode", "StoredValue", "explained", "noted", "summarise"]

StoredValue: TypeAlias = Any
"""One call's stored value: a tensor, a tuple, list or dict of them, or, in an eager run,
whatever a user's hook function returned. It is user data: no narrower type holds."""
Calls: TypeAlias = tuple[StoredValue, ...]
"""Every call's value of one record name at one module, in call order."""
RecordData: TypeAlias = dict[str, dict[str, Calls]]
"""A Record's data: ``{path: {name: calls}}``."""
Notes: TypeAlias = tuple[tuple[str | None, str], ...]
"""Notes on the absences at one path: ``(name, or None for the whole module; sentence)`` pairs."""

def explained(message: str, fix: str, notes: Notes, path: str, name: str | None = None) -> str:
    """`message` followed by the notes on `path` (and `name`), or by the generic `fix` if none applies."""
    lines = [f"Note on `rec[{path!r}]" + ("" if n is None else f"[{n!r}]") + f"`: {_sentence(note)}"
             for n, note in notes if name is None or n is None or n == name]
    return f"{message} {' '.join(lines) if lines else fix}"


def _sentence(note: str) -> str:
    return note if note.endswith((".", "!", "?")) else note + "."


def summarise(value: StoredValue) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(summarise(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(summarise(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {summarise(v)}" for k, v in value.items()) + "}"
    return repr(value)


class RecordNode(Frozen, Mapping):
    """What one module stored: a read-only ``Mapping`` from record name to value.

    ``node[name]`` is the single value of a module that ran once; ``node.calls(name)`` the
    tuple of every call's value. ``name in node``, ``node.keys()``, ``len(node)`` and
    iteration answer for every name the module stored, however many times it ran. A name it
    did not store raises :class:`~funhooks.RecordKeyError` (a ``KeyError``), so
    ``node.get(name)`` returns the default. A name stored by several calls has no single
    value: ``node[name]``, ``node.get(name)``, ``dict(node)``, ``node.items()`` and
    ``node.values()`` raise the "ran N times" :class:`~funhooks.RecordError`, which is not
    a ``KeyError``, so ``get`` never hides it behind the default; read such a node with
    ``{name: node.calls(name) for name in node}``.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> with fh.with_hooks(model, [fh.outputs("0"), fh.inputs("0")]) as run:
        ...     y = model(torch.ones(1, 2))
        >>> node = run.record["0"]
        >>> sorted(node), node["output"].shape, len(node.calls("input"))
        (['input', 'output'], torch.Size([1, 2]), 1)
        >>> "grad" in node, node.get("grad")
        (False, None)
    """

    __slots__ = ("_notes", "_path", "_values")
    _notes: Notes
    _path: str
    _values: Mapping[str, Calls]

    def __init__(self, path: str, values: Mapping[str, Calls]) -> None:
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_notes", ())

    @classmethod
    def _noted(cls, path: str, values: Mapping[str, Calls], notes: Notes) -> RecordNode:
        node = cls(path, values)
        object.__setattr__(node, "_notes", notes)
        return node

    def __getitem__(self, name: str) -> StoredValue:
        calls = self.calls(name)
        if len(calls) != 1:
            raise RecordError(
                f"Record: `rec[{self._path!r}][{name!r}]` needs a module that ran exactly once, "
                f"got {len(calls)} calls. Use `rec.calls({self._path!r}, {name!r})` for all of them."
            )
        return calls[0]

    def calls(self, name: str) -> Calls:
        """Every call's value for `name`, in call order.

        Raises:
            RecordKeyError: when the module stored no `name`.
        """
        try:
            return self._values[name]
        except KeyError:
            raise RecordKeyError(explained(
                f"Record: module {self._path!r} stored no {name!r}, got names {list(self._values)}.",
                "Use one of those, or add a spec that stores it.", self._notes, self._path, name,
            )) from None

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        body = ", ".join(f"{k!r}: [{', '.join(summarise(v) for v in vs)}]" for k, vs in self._values.items())
        return f"RecordNode({self._path!r}, {{{body}}})"


def noted(path: str, values: Mapping[str, Calls], notes: Notes) -> RecordNode:
    """A node whose failed lookups explain themselves with `notes` (see ``Record``)."""
    return RecordNode._noted(path, values, notes)
