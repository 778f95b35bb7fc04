"""Record: the immutable tree of what a run stored, keyed by module path.

Each node maps record names to the values of every call, in call order. A Record holds no
reference to the model (paths are strings) and, with ``detach=True``, none to the autograd
graph. It is a registered pytree, so ``torch.func`` transforms return it batched and
``torch.utils._pytree.tree_map`` sees its tensors.

Memory: a Record keeps every stored value alive; ``rec.map(torch.Tensor.cpu)`` or saving
and dropping it are the ways to release device memory.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, KeysView, Mapping
from typing import Any, TypeAlias, TypeVar, overload

import attrs
import torch

from funhooks import _frozen, _html, _torch
from funhooks._frozen import Frozen
from funhooks.errors import RecordKeyError

from . import _compare
from . import _file
from .node import Calls, Notes, RecordData, RecordNode, StoredValue, explained, noted, summarise

__all__ = ["Record", "RecordNode", "merge", "trusted"]

_D = TypeVar("_D")
_SHOWN_CALLS = 16  # a display describes the first calls of a record; a generation may hold hundreds

_NO_NOTES: Mapping[str, Notes] = {}  # never mutated (a plain dict: dynamo traces it)
"""A Record's notes on absences, by path: ``(name or None, sentence)`` pairs."""


class Record(Frozen):
    """An immutable tree of stored values keyed by module path, in module order.

    Reads like a read-only mapping from path to :class:`RecordNode`: ``rec[path]``,
    ``path in rec``, ``rec.get(path)``, ``rec.keys()``, ``rec.values()``, ``rec.items()``,
    ``len(rec)`` and ``dict(rec)``. A path with no record raises
    :class:`~funhooks.RecordKeyError` (a ``KeyError``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> block = nn.Linear(2, 2)
        >>> model = nn.Sequential(block, nn.ReLU(), block)  # a shared module runs twice
        >>> with fh.with_hooks(model, fh.outputs(nn.Linear)) as run:
        ...     y = model(torch.ones(1, 2))
        >>> rec = run.record
        >>> list(rec), len(rec.calls("0", "output")), "1" in rec
        (['0'], 2, False)
        >>> torch.equal(rec.calls("0", "output")[1], y)
        True
        >>> rec.get("1") is None, list(rec.keys())
        (True, ['0'])
    """

    __slots__ = ("_data", "_notes")
    _data: RecordData
    _notes: Mapping[str, Notes]

    def __init__(self, data: Mapping[str, Mapping[str, Calls | list[StoredValue]]] | None = None) -> None:
        """Build a Record from ``{path: {name: (value_of_call_0, value_of_call_1, ...)}}``.

        The dicts are copied; the values are not.

        Raises:
            TypeError: when `data` is not of that shape, or a path or name is not a str.
        """
        frozen = {path: {name: tuple(calls) for name, calls in names.items()}
                  for path, names in _checked({} if data is None else data)}
        object.__setattr__(self, "_data", frozen)
        object.__setattr__(self, "_notes", _NO_NOTES)

    @classmethod
    def _trusted(cls, data: RecordData,
                 notes: Mapping[tuple[str, str | None], str] | None = None) -> Record:
        """Wrap `data` without copying or checking it: the caller hands over ownership.

        `notes` says why something is absent, one sentence per key: ``(path, name)`` for one
        record name of one module, ``(path, None)`` for the whole module. A lookup that
        misses shows the notes that apply in its error, in place of the generic advice:
        ``rec[path]`` those on `path` (any name); ``rec[path][name]`` and
        ``rec.calls(path, name)`` those on ``(path, name)`` and ``(path, None)``. Notes are
        kept by :meth:`map`, and are not part of :meth:`equal`, pytree flattening, pickling
        or :meth:`save`.

        Raises:
            TypeError: when a key of `notes` is not a ``(str, str | None)`` pair or a note is
                not a str.
        """
        return cls._with_notes(data, _indexed(notes) if notes else _NO_NOTES)

    @classmethod
    def _with_notes(cls, data: RecordData,
                    notes: Mapping[str, Notes]) -> Record:
        rec = object.__new__(cls)
        object.__setattr__(rec, "_data", data)
        object.__setattr__(rec, "_notes", notes)
        return rec

    # -- lookup -----------------------------------------------------------------------
    def __getitem__(self, path: str) -> RecordNode:
        try:
            values = self._data[path]
        except KeyError:
            raise RecordKeyError(explained(
                f"Record: no module path {path!r} in this record, got paths {list(self._data)}.",
                "Check the selector, or that the module ran.", self._notes.get(path, ()), path,
            )) from None
        return self._node(path, values)

    def _node(self, path: str, values: Mapping[str, Calls]) -> RecordNode:
        notes = self._notes.get(path) if self._notes else None
        return RecordNode(path, values) if notes is None else noted(path, values, notes)

    def calls(self, path: str, name: str) -> Calls:
        """Every call's value of `name` at `path`, in call order."""
        return self[path].calls(name)

    def calls_by_path(self, name: str) -> dict[str, Calls]:
        """``{path: every call's value of name}`` for every module that stored `name`, in module
        order (no node objects are built: what a reducer reads on every step).

        Example:
            >>> import torch, funhooks as fh
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            >>> with fh.with_hooks(model, fh.outputs(nn.ReLU)) as run:
            ...     _ = model(torch.ones(1, 2)), model(torch.zeros(1, 2))
            >>> {path: len(calls) for path, calls in run.record.calls_by_path("output").items()}
            {'1': 2}
        """
        return {p: names[name] for p, names in self._data.items() if names.get(name)}

    def stored(self, name: str = "output") -> list[StoredValue]:
        """The single value of `name` for every module that stored it, in module order."""
        return [self[p][name] for p, names in self._data.items() if name in names]

    def __contains__(self, path: object) -> bool:
        return path in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @overload
    def get(self, path: str) -> RecordNode | None: ...
    @overload
    def get(self, path: str, default: _D) -> RecordNode | _D: ...

    def get(self, path: str, default: object = None) -> object:
        """The node at `path`, or `default` when no module at `path` stored anything."""
        values = self._data.get(path)
        return default if values is None else self._node(path, values)

    def keys(self) -> KeysView[str]:
        """The module paths, in module order."""
        return self._data.keys()

    def values(self) -> Iterator[RecordNode]:
        """The nodes, in module order."""
        return (self._node(p, v) for p, v in self._data.items())

    def items(self) -> Iterator[tuple[str, RecordNode]]:
        """``(path, node)`` pairs in module order."""
        return ((p, self._node(p, v)) for p, v in self._data.items())

    # -- transformation -----------------------------------------------------------------
    def map(self, fn: Callable[[torch.Tensor], StoredValue]) -> Record:
        """A new Record with `fn` applied to every stored tensor.

        Example:
            >>> import torch, funhooks as fh
            >>> rec = fh.Record({"fc": {"output": (torch.ones(2),)}})
            >>> rec.map(lambda t: t * 3)["fc"]["output"]
            tensor([3., 3.])
        """
        def leaf(x: StoredValue) -> StoredValue:
            return fn(x) if isinstance(x, torch.Tensor) else x

        return Record._with_notes({p: {n: tuple(_torch.tree_map(leaf, v) for v in vs) for n, vs in names.items()}
                                   for p, names in self._data.items()}, self._notes)

    def tensors(self) -> list[torch.Tensor]:
        """Every stored tensor, in module, name and call order."""
        return [t for t in _torch.tree_leaves(self) if isinstance(t, torch.Tensor)]

    def equal(self, other: Record, *, rtol: float = 0.0, atol: float = 0.0) -> bool:
        """True when both records have the same paths, names, call counts and values.

        Values are compared through their containers: tuples, lists, dicts (same keys) and
        any other registered pytree must match in type and structure (a namedtuple matches
        one with the same name and fields, as :meth:`load` rebuilds it); other values
        compare with ``==`` and must have the same type (``nan`` equals ``nan``). Tensors
        must agree in shape, dtype and layout, then:

        - dense: ``torch.allclose(rtol, atol, equal_nan=True)``, exact by default (float8
          and other dtypes without that kernel are compared in float32);
        - sparse (COO, CSR, CSC, BSR, BSC): same values, whatever the index layout
          (coalesced or not, explicit zeros or not); indices that differ cost a dense copy;
        - quantized: same qscheme, scales, zero points (and axis), and int values;
        - meta: shape and dtype alone, since there are no values.

        Example:
            >>> import torch, funhooks as fh
            >>> a = fh.Record({"fc": {"output": (torch.eye(2).to_sparse(),)}})
            >>> a.equal(fh.Record({"fc": {"output": (torch.eye(2).to_sparse(),)}}))
            True
            >>> a.equal(fh.Record({"fc": {"output": (torch.eye(2),)}}))  # another layout
            False
        """
        if not isinstance(other, Record) or _structure(self) != _structure(other):
            return False
        return all(_compare.same(x, y, rtol, atol) for x, y in zip(_flatten(self)[0], _flatten(other)[0]))

    # -- saving ---------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the record to `path` so that :meth:`load` reads it back without running code.

        What round-trips, in order (paths, names, calls and dict keys):

        - tensors: dense, sparse, quantized, meta and nested (either layout),
          ``nn.Parameter`` too, on their device (or ``load``'s `map_location`), with dtype,
          shape and strides; a view saves its whole storage, as with ``torch.save``;
        - int, float, complex, str, bool, None, ``torch.dtype``, ``torch.device``,
          ``torch.Size``;
        - inside tuples, lists, dicts and ``OrderedDict`` (keys: str, numbers, bool, None,
          dtypes, devices, or tuples of these);
        - namedtuples, rebuilt as a namedtuple class with the same name and fields (not the
          original class: importing its module would run code), and ``torch.return_types``
          values (``torch.max(x, 0)``, ``topk``, ...), rebuilt as the real type.

        Anything else is refused before a byte is written: dataclasses, ``Mapping``
        subclasses such as HuggingFace's ``ModelOutput``, tensor subclasses, arrays, modules.
        The file is written to a temporary file beside `path`, read back with
        ``torch.load(weights_only=True)`` and only then renamed to `path`, so a save that
        fails leaves no file, or the previous one, never a half-written or unreadable one.
        Notes on absences (see ``Record._trusted``) are not saved.

        Raises:
            TypeError: when a stored value is not one of the above (the message says where
                and how to convert it), or pickles to something ``torch.load(weights_only=True)``
                refuses, such as an object set as an attribute of a stored tensor.
            OSError: when the disk refuses the write (full, over a size limit): the disk's
                error (``errno`` kept, e.g. ``ENOSPC``) with `path` as its ``filename``.

        Example:
            >>> import collections, tempfile, os, torch, funhooks as fh
            >>> Pair = collections.namedtuple("Pair", "a b")
            >>> rec = fh.Record({"fc": {"output": (Pair(torch.ones(2), torch.arange(3).max(0)),)}})
            >>> with tempfile.TemporaryDirectory() as d:
            ...     rec.save(os.path.join(d, "rec.pt"))
            ...     back = fh.Record.load(os.path.join(d, "rec.pt"))["fc"]["output"]
            >>> type(back).__name__, back._fields, type(back.b) is torch.return_types.max
            ('Pair', ('a', 'b'), True)
        """
        _file.write(self._data, os.fsdecode(path))

    @classmethod
    def load(cls, path: str | os.PathLike, *, map_location: torch.serialization.MAP_LOCATION = None) -> Record:
        """Read a record written by :meth:`save`, with ``torch.load(weights_only=True)``.

        The file is checked before it is trusted: it must be a complete archive whose every
        part matches its CRC-32 checksum (one extra pass over the file), hold nothing that
        needs code to load, be of a format version this funhooks reads (files of earlier
        versions are read), and hold ``{path: {name: [value, ...]}}`` of the values
        :meth:`save` writes. Errors of `map_location` itself propagate as torch raises them.

        Raises:
            RecordError: naming the file and what is wrong: truncated or corrupt, not a file
                ``save`` wrote, a pickle that needs code, a newer format version, or
                malformed content.

        Example:
            >>> import tempfile, os, torch, funhooks as fh
            >>> rec = fh.Record({"fc": {"output": (torch.arange(3),)}})
            >>> with tempfile.TemporaryDirectory() as d:
            ...     rec.save(os.path.join(d, "rec.pt"))
            ...     back = fh.Record.load(os.path.join(d, "rec.pt"))
            >>> back.equal(rec)
            True
        """
        return cls._trusted(_file.read(os.fsdecode(path), map_location))

    def __repr__(self) -> str:
        lines = [f"  {p!r}: {{" + ", ".join(f"{n!r}: [{', '.join(summarise(v) for v in vs)}]"
                                              for n, vs in names.items()) + "}"
                 for p, names in self._data.items()]
        return "Record({\n" + ",\n".join(lines) + "\n})" if lines else "Record({})"

    def _repr_html_(self) -> str:
        """The tree as an HTML table (what a notebook shows): per module path and record name, the
        number of calls and the shape, dtype and device of the values. Reads no tensor value (a
        CUDA tensor stays where it is); a record whose calls differ in shape lists the shapes."""
        rows = ((path, name, calls) for path, names in self._data.items() for name, calls in names.items())
        total = sum(len(names) for names in self._data.values())
        lines = [_html_row(path, name, calls) for path, name, calls in itertools.islice(rows, _html.MAX_ROWS)]
        return _html.table(("module", "record", "calls", "shape", "dtype", "device"), lines, total=total,
                           caption=f"Record: {len(self._data)} module(s), {total} record(s)")

    def __reduce__(self) -> tuple[type[Record], tuple[RecordData]]:
        return (Record, (self._data,))


def _html_row(path: str, name: str, calls: Calls) -> tuple[_html.Cell, str, str, str, str, str]:
    """One row of a Record's display; the shapes of the first calls, each distinct one once."""
    seen: dict[tuple[str, str, str], None] = {}
    for value in calls[:_SHOWN_CALLS]:
        seen[_html.describe(value)] = None
    shapes, dtypes, devices = (" / ".join(dict.fromkeys(parts)) for parts in zip(*seen)) if seen else ("", "", "")
    more = "" if len(calls) <= _SHOWN_CALLS else " / …"
    return (_html.Cell(path or "(model)", indent=path.count(".") + bool(path)), name, str(len(calls)),
            shapes + more, dtypes, devices)


def trusted(data: RecordData,
            notes: Mapping[tuple[str, str | None], str] | None = None) -> Record:
    """A Record over `data`, neither copied nor checked (the run core's and the file reader's
    way in: they hand over a dict they built); `notes` as :meth:`Record._trusted` says."""
    return Record._trusted(data, notes)


def merge(records: Iterable[Record], *, order: Callable[[str], Any] | None = None) -> Record:
    """One Record holding every value of `records`, none copied.

    A path or name found in several keeps all of their calls, in the order of `records`
    (two records of one module's calls: the first's calls, then the second's). Paths come in
    the order they are first met, or sorted by ``order(path)`` (a stable sort); names within
    a path in the order they are first met. Notes on absences are kept, each path's in the
    order of `records`.

    Args:
        records: Records, e.g. what two runs or two stretches of one run stored.
        order: a key for the paths' order (e.g. their place in the model's module order).

    Returns:
        A new Record (`records` are left as they are).

    Raises:
        TypeError: when an item of `records` is not a Record.

    Example:
        >>> import torch, funhooks as fh
        >>> a = fh.Record({"fc": {"output": (torch.zeros(1),)}})
        >>> b = fh.Record({"act": {"output": (torch.ones(1),)}, "fc": {"output": (torch.ones(1),), "norm": (2.0,)}})
        >>> both = fh.records.merge([a, b])
        >>> list(both), len(both.calls("fc", "output")), list(both["fc"])
        (['fc', 'act'], 2, ['output', 'norm'])
        >>> list(fh.records.merge([a, b], order=["act", "fc"].index))
        ['act', 'fc']
    """
    parts = list(records)
    bad = next((r for r in parts if not isinstance(r, Record)), None)
    if bad is not None:
        raise TypeError(f"merge: `records` are Records, got {type(bad).__name__}. "
                        "Pass e.g. [run.record, other_record].")
    parts = [r for r in parts if r._data or r._notes]
    data: RecordData = {}
    if parts:
        data = {p: dict(names) for p, names in parts[0]._data.items()}
    for part in parts[1:]:
        for path, names in part._data.items():
            node = data.get(path)
            if node is None:
                data[path] = dict(names)
                continue
            for name, calls in names.items():
                have = node.get(name)
                node[name] = calls if have is None else have + calls
    if order is not None:
        keys = [order(p) for p in data]
        if keys != sorted(keys):
            data = {p: data[p] for _, p in sorted(zip(keys, data), key=lambda kp: kp[0])}
    return Record._with_notes(data, _merged_notes([r._notes for r in parts]))


def _merged_notes(each: list[Mapping[str, Notes]]) -> Mapping[str, Notes]:
    """The notes of several records, by path, each path's in the records' order, none twice."""
    present = [n for n in each if n]
    if len(present) <= 1:
        return present[0] if present else _NO_NOTES
    out: dict[str, Notes] = {}
    for notes in present:
        for path, ns in notes.items():
            out[path] = tuple(dict.fromkeys((*out.get(path, ()), *ns)))
    return out


def _with_notes_of(data: RecordData, like: Record) -> Record:
    """A Record over `data` (neither copied nor checked) keeping the notes on absences of `like`."""
    return Record._with_notes(data, like._notes)


def _indexed(notes: Mapping[tuple[str, str | None], str]) -> Mapping[str, Notes]:
    """`notes` by path, each path's notes in their order, the ones on the whole module first."""
    index: dict[str, list[tuple[str | None, str]]] = {}
    for key, note in notes.items():
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)
                and isinstance(key[1], (str, type(None))) and isinstance(note, str)):
            raise TypeError(
                f"Record._trusted: `notes` maps `(path, name)` or `(path, None)` to a str, got {key!r}: {note!r}. "
                "Key each note by a (str, str | None) pair."
            )
        index.setdefault(key[0], []).append((key[1], note))
    return {p: tuple(sorted(ns, key=lambda n: n[0] is not None)) for p, ns in index.items()}


def _checked(data: object) -> Iterator[tuple[str, Mapping[str, Calls | list[StoredValue]]]]:
    """The ``(path, names)`` pairs of `data`, once each is known to be ``{str: {str: tuple | list}}``."""
    if not isinstance(data, Mapping):
        raise TypeError(
            f"Record: `data` maps module paths to `{{name: calls}}` dicts, got {type(data).__name__}. "
            "Pass e.g. `{'fc': {'output': (value,)}}`."
        )
    for path, names in data.items():
        if not isinstance(path, str):
            raise TypeError(
                f"Record: module paths are str, got {path!r} ({type(path).__name__}). "
                "Use the path `model.named_modules()` gives, e.g. 'features.0'."
            )
        if not isinstance(names, Mapping):
            raise TypeError(
                f"Record: each module path maps to a dict `{{name: calls}}`, got {type(names).__name__} for {path!r}. "
                f"Write e.g. `{{{path!r}: {{'output': (value,)}}}}`."
            )
        for name, calls in names.items():
            if not isinstance(name, str):
                raise TypeError(
                    f"Record: record names are str, got {name!r} ({type(name).__name__}) at {path!r}. "
                    "Name each stored value with a str, e.g. 'output'."
                )
            if not isinstance(calls, (tuple, list)):
                raise TypeError(
                    f"Record: each name maps to a tuple of per-call values, got {type(calls).__name__} "
                    f"for {path!r}/{name!r}. Wrap a single call's value as `(value,)`."
                )
        yield path, names


_Structure: TypeAlias = "tuple[tuple[str, tuple[tuple[str, int], ...]], ...]"
"""A Record's pytree context: its paths, each with its names and their numbers of calls."""


def _structure(rec: Record) -> _Structure:
    return tuple((p, tuple((n, len(vs)) for n, vs in names.items())) for p, names in rec._data.items())


def _flatten(rec: Record) -> tuple[list[StoredValue], _Structure]:
    values = [v for names in rec._data.values() for vs in names.values() for v in vs]
    return values, _structure(rec)


def _unflatten(values: Iterable[StoredValue], context: _Structure) -> Record:
    it = iter(values)
    return Record._trusted({p: {n: tuple(next(it) for _ in range(k)) for n, k in names} for p, names in context})


@_frozen.frozen
@attrs.frozen
class _CallKey:
    """The key-path entry of one call's value in a Record: ``.calls(path, name)[call]``.

    ``torch.utils._pytree.keystr`` of a leaf's key path is then a Python expression that
    reads the leaf from the record: ``rec.calls('fc', 'output')[0][1]``.

    Example:
        >>> import torch, funhooks as fh
        >>> import torch.utils._pytree as pytree
        >>> rec = fh.Record({"fc": {"output": ((torch.ones(1), torch.zeros(1)),)}})
        >>> [pytree.keystr(kp) for kp, _ in pytree.tree_flatten_with_path(rec)[0]]
        [".calls('fc', 'output')[0][0]", ".calls('fc', 'output')[0][1]"]
    """

    path: str
    name: str
    call: int

    def __str__(self) -> str:
        return f".calls({self.path!r}, {self.name!r})[{self.call}]"

    def get(self, rec: Record) -> StoredValue:
        return rec.calls(self.path, self.name)[self.call]


def _flatten_with_keys(rec: Record) -> tuple[list[tuple[_CallKey, StoredValue]], _Structure]:
    keyed = [(_CallKey(p, n, i), v) for p, names in rec._data.items() for n, vs in names.items() for i, v in enumerate(vs)]
    return keyed, _structure(rec)


_torch.register_pytree(Record, _flatten, _unflatten, "funhooks.Record", flatten_with_keys=_flatten_with_keys)
