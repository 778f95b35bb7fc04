"""Record: the immutable tree of what a run stored, keyed by module path.

Each node maps record names to the values of every call, in call order. A Record holds no
reference to the model (paths are strings) and, with ``detach=True``, none to the autograd
graph. It is a registered pytree, so ``torch.func`` transforms return it batched and
``torch.utils._pytree.tree_map`` sees its tensors.

Memory: a Record keeps every stored value alive; ``rec.map(torch.Tensor.cpu)`` or saving
and dropping it are the ways to release device memory.
"""

from __future__ import annotations

import cmath
import collections
import contextlib
import dataclasses
import functools
import os
import pickle
import secrets
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, KeysView, Mapping
from typing import Any

import attrs
import torch

from . import _torch
from .errors import FrozenError, RecordError, RecordKeyError

__all__ = ["CallKey", "Record", "RecordNode"]

_PLAIN = frozenset({int, float, complex, str, bool, type(None), torch.dtype, torch.device, torch.Size})
"""Leaf types, besides tensors, that ``torch.load(weights_only=True)`` reads back without running code."""
_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
"""Tensor types it reads back; other subclasses need their class imported (nested tensors excepted)."""
_DICTS = frozenset({dict, collections.OrderedDict})
_NO_NOTES: Mapping[str, tuple[tuple[str | None, str], ...]] = {}  # never mutated (a plain dict: dynamo traces it)
"""A Record's notes on absences, by path: ``(name or None, sentence)`` pairs."""
_FORMAT = "funhooks.Record"
_FORMAT_VERSION = 2
"""1: ``{format, version, data}``; 2 adds ``types``, the namedtuples and ``torch.return_types``
to rebuild (as ``(path, name, call, position, kind, type name, fields)``)."""
_NAMEDTUPLE, _RETURN_TYPE = "namedtuple", "torch.return_types"
_ZIP_MAGIC = b"PK\x03\x04"


def _explained(message: str, fix: str, notes: tuple[tuple[str | None, str], ...], path: str,
               name: str | None = None) -> str:
    """`message` followed by the notes on `path` (and `name`), or by the generic `fix` if none applies."""
    lines = [f"Note on `rec[{path!r}]" + ("" if n is None else f"[{n!r}]") + f"`: {_sentence(note)}"
             for n, note in notes if name is None or n is None or n == name]
    return f"{message} {' '.join(lines) if lines else fix}"


def _sentence(note: str) -> str:
    return note if note.endswith((".", "!", "?")) else note + "."


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple) and hasattr(cls, "_make")


def _summarise(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, tuple):
        return "(" + ", ".join(_summarise(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_summarise(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_summarise(v)}" for k, v in value.items()) + "}"
    return repr(value)


class _Frozen:
    __slots__ = ()

    def __setattr__(self, key: str, value: Any) -> None:
        raise FrozenError(f"{type(self).__name__}: a frozen value cannot be assigned to, got `.{key} = ...`. Build a new one.")

    def __delattr__(self, key: str) -> None:
        raise FrozenError(f"{type(self).__name__}: a frozen value cannot be changed, got `del .{key}`. Build a new one.")

    def __setitem__(self, key: Any, value: Any) -> None:
        raise FrozenError(f"{type(self).__name__}: a frozen value cannot be assigned to, got `[{key!r}] = ...`. Build a new one.")

    def __delitem__(self, key: Any) -> None:
        raise FrozenError(f"{type(self).__name__}: a frozen value cannot be changed, got `del [{key!r}]`. Build a new one.")


class RecordNode(_Frozen, Mapping):
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

    def __init__(self, path: str, values: Mapping[str, tuple[Any, ...]]) -> None:
        object.__setattr__(self, "_path", path)
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "_notes", ())

    @classmethod
    def _noted(cls, path: str, values: Mapping[str, tuple[Any, ...]],
               notes: tuple[tuple[str | None, str], ...]) -> RecordNode:
        node = cls(path, values)
        object.__setattr__(node, "_notes", notes)
        return node

    def __getitem__(self, name: str) -> Any:
        calls = self.calls(name)
        if len(calls) != 1:
            raise RecordError(
                f"Record: `rec[{self._path!r}][{name!r}]` needs a module that ran exactly once, "
                f"got {len(calls)} calls. Use `rec.calls({self._path!r}, {name!r})` for all of them."
            )
        return calls[0]

    def calls(self, name: str) -> tuple[Any, ...]:
        """Every call's value for `name`, in call order.

        Raises:
            RecordKeyError: when the module stored no `name`.
        """
        try:
            return self._values[name]
        except KeyError:
            raise RecordKeyError(_explained(
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
        body = ", ".join(f"{k!r}: [{', '.join(_summarise(v) for v in vs)}]" for k, vs in self._values.items())
        return f"RecordNode({self._path!r}, {{{body}}})"


class Record(_Frozen):
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

    def __init__(self, data: Mapping[str, Mapping[str, tuple[Any, ...]]] | None = None) -> None:
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
    def _trusted(cls, data: dict[str, dict[str, tuple[Any, ...]]],
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
    def _with_notes(cls, data: dict[str, dict[str, tuple[Any, ...]]],
                    notes: Mapping[str, tuple[tuple[str | None, str], ...]]) -> Record:
        rec = object.__new__(cls)
        object.__setattr__(rec, "_data", data)
        object.__setattr__(rec, "_notes", notes)
        return rec

    # -- lookup -----------------------------------------------------------------------
    def __getitem__(self, path: str) -> RecordNode:
        try:
            values = self._data[path]
        except KeyError:
            raise RecordKeyError(_explained(
                f"Record: no module path {path!r} in this record, got paths {list(self._data)}.",
                "Check the selector, or that the module ran.", self._notes.get(path, ()), path,
            )) from None
        return self._node(path, values)

    def _node(self, path: str, values: Mapping[str, tuple[Any, ...]]) -> RecordNode:
        notes = self._notes.get(path) if self._notes else None
        return RecordNode(path, values) if notes is None else RecordNode._noted(path, values, notes)

    def calls(self, path: str, name: str) -> tuple[Any, ...]:
        """Every call's value of `name` at `path`, in call order."""
        return self[path].calls(name)

    def stored(self, name: str = "output") -> list[Any]:
        """The single value of `name` for every module that stored it, in module order."""
        return [self[p][name] for p, names in self._data.items() if name in names]

    def __contains__(self, path: object) -> bool:
        return path in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def get(self, path: str, default: Any = None) -> RecordNode | Any:
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
    def map(self, fn: Callable[[torch.Tensor], Any]) -> Record:
        """A new Record with `fn` applied to every stored tensor.

        Example:
            >>> import torch, funhooks as fh
            >>> rec = fh.Record({"fc": {"output": (torch.ones(2),)}})
            >>> rec.map(lambda t: t * 3)["fc"]["output"]
            tensor([3., 3.])
        """
        def leaf(x: Any) -> Any:
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
        return all(_same(x, y, rtol, atol) for x, y in zip(_flatten(self)[0], _flatten(other)[0]))

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
        file = os.fsdecode(path)
        types_: list[tuple[Any, ...]] = []
        data = {p: {n: [_plain(v, _Where(p, n, i, len(vs)), (), types_, file) for i, v in enumerate(vs)]
                    for n, vs in names.items()}
                for p, names in self._data.items()}
        _write_atomically({"format": _FORMAT, "version": _FORMAT_VERSION, "data": data, "types": types_}, file)

    @classmethod
    def load(cls, path: str | os.PathLike, *, map_location: Any = None) -> Record:
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
        file = os.fsdecode(path)
        _check_archive(file)
        try:
            blob = torch.load(file, map_location=map_location, weights_only=True)
        except (pickle.UnpicklingError, EOFError, struct.error, UnicodeDecodeError) as error:  # the pickle stream
            raise RecordError(
                "Record.load: a Record file holds only plain data and is read with `torch.load(weights_only=True)`, "
                f"got {file!r}, whose pickle it refuses (it needs code to load, or is damaged). Load only files "
                "written by `Record.save`; use `torch.load(..., weights_only=False)` only on a file from a source "
                "you trust."
            ) from error
        except RuntimeError as error:
            if "PytorchStreamReader" not in str(error):  # not the archive: e.g. a `map_location` torch cannot use
                raise
            raise RecordError(_truncated(file, "a tensor its pickle refers to is missing")) from error
        return cls._trusted(_decoded(blob, file))

    def __repr__(self) -> str:
        lines = [f"  {p!r}: {{" + ", ".join(f"{n!r}: [{', '.join(_summarise(v) for v in vs)}]"
                                              for n, vs in names.items()) + "}"
                 for p, names in self._data.items()]
        return "Record({\n" + ",\n".join(lines) + "\n})" if lines else "Record({})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (Record, (self._data,))


def _indexed(notes: Mapping[tuple[str, str | None], str]) -> Mapping[str, tuple[tuple[str | None, str], ...]]:
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


def _checked(data: Any) -> Iterator[tuple[str, Mapping[str, Any]]]:
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


def _same(x: Any, y: Any, rtol: float, atol: float) -> bool:
    """`x` and `y` are equal values in the sense of :meth:`Record.equal`."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and _same_tensor(x, y, rtol, atol)
    if isinstance(x, tuple) and isinstance(y, tuple):
        return (_same_tuple_type(type(x), type(y)) and len(x) == len(y)
                and all(_same(a, b, rtol, atol) for a, b in zip(x, y)))
    if type(x) is not type(y):
        return False
    if type(x) is list:
        return len(x) == len(y) and all(_same(a, b, rtol, atol) for a, b in zip(x, y))
    if type(x) in (dict, collections.OrderedDict):
        return x.keys() == y.keys() and all(_same(x[k], y[k], rtol, atol) for k in x)
    x_leaves, x_spec = _torch.pytree.tree_flatten(x)
    if len(x_leaves) == 1 and x_leaves[0] is x:  # not a container
        return _same_plain(x, y)
    y_leaves, y_spec = _torch.pytree.tree_flatten(y)
    return x_spec == y_spec and all(_same(a, b, rtol, atol) for a, b in zip(x_leaves, y_leaves))


def _same_tuple_type(a: type, b: type) -> bool:
    """Same tuple type; namedtuples match by name and fields, as :meth:`Record.load` rebuilds them."""
    return a is b or (_is_namedtuple(a) and _is_namedtuple(b) and a.__name__ == b.__name__ and a._fields == b._fields)


def _same_plain(x: Any, y: Any) -> bool:
    if x is y:
        return True
    if isinstance(x, (float, complex)) and cmath.isnan(x) and cmath.isnan(y):
        return True
    if getattr(x, "shape", None) != getattr(y, "shape", None):  # arrays: `==` would broadcast
        return False
    same = x == y
    if isinstance(same, bool):
        return same
    reduce = getattr(same, "all", None)
    return bool(reduce() if callable(reduce) else same)


_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}
"""Sparse compressed layouts and the methods giving their two index tensors."""


def _same_tensor(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    if x.is_nested or y.is_nested:
        if not (x.is_nested and y.is_nested and x.layout == y.layout and x.dtype == y.dtype):
            return False
        xs, ys = x.unbind(), y.unbind()
        return len(xs) == len(ys) and all(_same_tensor(a, b, rtol, atol) for a, b in zip(xs, ys))
    if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout or x.is_meta != y.is_meta:
        return False
    if x.is_meta:
        return True
    y = y.to(x.device)
    if x.is_quantized:
        return _same_quantized(x, y, rtol, atol)
    if x.layout == torch.sparse_coo:
        x, y = x.coalesce(), y.coalesce()
        if torch.equal(x.indices(), y.indices()):
            return _same_dense(x.values(), y.values(), rtol, atol)
        return _same_dense(x.to_dense(), y.to_dense(), rtol, atol)
    if x.layout in _COMPRESSED:
        compressed, plain = _COMPRESSED[x.layout]
        if (x.values().shape == y.values().shape and torch.equal(getattr(x, compressed)(), getattr(y, compressed)())
                and torch.equal(getattr(x, plain)(), getattr(y, plain)())):
            return _same_dense(x.values(), y.values(), rtol, atol)
        return _same_dense(x.to_dense(), y.to_dense(), rtol, atol)
    return _same_dense(x, y, rtol, atol)


def _same_quantized(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    scheme = x.qscheme()
    if scheme != y.qscheme():
        return False
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        scales = torch.tensor([x.q_scale()]), torch.tensor([y.q_scale()])
        zero_points = torch.tensor([x.q_zero_point()]), torch.tensor([y.q_zero_point()])
    else:
        if x.q_per_channel_axis() != y.q_per_channel_axis():
            return False
        scales = x.q_per_channel_scales(), y.q_per_channel_scales()
        zero_points = x.q_per_channel_zero_points(), y.q_per_channel_zero_points()
    return (_same_dense(*scales, rtol, atol) and torch.equal(*zero_points)
            and _same_dense(x.int_repr(), y.int_repr(), rtol, atol))


def _same_dense(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    try:
        return torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    except NotImplementedError:  # float8 and bit-packed dtypes lack kernels for `isclose`
        pass
    wide = torch.complex64 if x.is_complex() else torch.float32
    try:
        return torch.allclose(x.to(wide), y.to(wide), rtol=rtol, atol=atol, equal_nan=True)
    except NotImplementedError:  # no conversion either: compare the bits
        return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def _structure(rec: Record) -> tuple[Any, ...]:
    return tuple((p, tuple((n, len(vs)) for n, vs in names.items())) for p, names in rec._data.items())


def _flatten(rec: Record) -> tuple[list[Any], Any]:
    values = [v for names in rec._data.values() for vs in names.values() for v in vs]
    return values, _structure(rec)


def _unflatten(values: Any, context: Any) -> Record:
    it = iter(values)
    return Record._trusted({p: {n: tuple(next(it) for _ in range(k)) for n, k in names} for p, names in context})


@attrs.frozen
class CallKey:
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

    def get(self, rec: Record) -> Any:
        return rec.calls(self.path, self.name)[self.call]


def _flatten_with_keys(rec: Record) -> tuple[list[tuple[CallKey, Any]], Any]:
    keyed = [(CallKey(p, n, i), v) for p, names in rec._data.items() for n, vs in names.items() for i, v in enumerate(vs)]
    return keyed, _structure(rec)


_torch.register_pytree(Record, _flatten, _unflatten, "funhooks.Record", flatten_with_keys=_flatten_with_keys)


# -- the file format -------------------------------------------------------------------------


@attrs.frozen
class _Where:
    """One call's value in a Record, for messages: ``rec['fc']['output']`` or ``rec.calls('fc', 'output')[1]``."""

    path: str
    name: str
    call: int
    calls: int

    def at(self, position: tuple[Any, ...]) -> str:
        head = (f"rec[{self.path!r}][{self.name!r}]" if self.calls == 1
                else f"rec.calls({self.path!r}, {self.name!r})[{self.call}]")
        return head + "".join(f"[{k!r}]" for k in position)


def _plain(value: Any, where: _Where, position: tuple[Any, ...], types_: list[tuple[Any, ...]], file: str) -> Any:
    """`value` as plain data ``torch.load(weights_only=True)`` reads, its namedtuples noted in `types_`."""
    kind = type(value)
    if kind in _PLAIN or _is_saveable_tensor(value):
        return value
    if kind is tuple or kind is list:
        return kind(_plain(v, where, (*position, i), types_, file) for i, v in enumerate(value))
    if kind in _DICTS:
        for key in value:
            if not _is_plain_key(key):
                raise TypeError(
                    "Record.save: dict keys in stored values are str, numbers, bool, None, dtypes, devices or tuples "
                    f"of them, got a {type(key).__name__} key at `{where.at(position)}`, so nothing was written to "
                    f"{file!r}. Use such keys, e.g. `str(key)`."
                )
        return kind((k, _plain(v, where, (*position, k), types_, file)) for k, v in value.items())
    rebuilt = _tuple_type(kind)
    if rebuilt is not None:
        types_.append((where.path, where.name, where.call, position, *rebuilt))
        return tuple(_plain(v, where, (*position, i), types_, file) for i, v in enumerate(value))
    raise TypeError(
        "Record.save: stored values are tensors, numbers, str, bool, None, dtypes, devices and sizes in tuples, "
        f"lists, dicts and namedtuples, got {kind.__name__} at `{where.at(position)}`, so nothing was written to "
        f"{file!r}. {_conversion(value)}"
    )


def _is_saveable_tensor(value: Any) -> bool:
    return type(value) in _TENSORS or (isinstance(value, torch.Tensor) and value.is_nested)


def _is_plain_key(key: Any) -> bool:
    kind = type(key)
    return (kind in _PLAIN and kind is not torch.Size) or (kind is tuple and all(map(_is_plain_key, key)))


def _tuple_type(kind: type) -> tuple[str, str, tuple[str, ...]] | None:
    """``(kind, type name, fields)`` for a tuple type :meth:`Record.load` can rebuild, else None."""
    if not issubclass(kind, tuple):
        return None
    if kind.__module__ == "torch.return_types" and _return_type(kind.__name__) is kind:
        return _RETURN_TYPE, kind.__name__, ()
    if _is_namedtuple(kind):
        try:
            _namedtuple(kind.__name__, tuple(kind._fields))
        except (TypeError, ValueError):  # e.g. fields renamed to `_1` by `rename=True`
            return None
        return _NAMEDTUPLE, kind.__name__, tuple(kind._fields)
    return None


def _conversion(value: Any) -> str:
    if _torch.is_dtensor(value):  # a shard (FSDP2): its data is in its local tensor
        return "Store `value.full_tensor()` (the whole, a collective) or `value.to_local()` (this rank's part) instead."
    if isinstance(value, torch.Tensor):
        return "Store `value.as_subclass(torch.Tensor)` instead."
    if _is_namedtuple(type(value)):
        return "Store `value._asdict()` instead."
    if isinstance(value, Mapping):
        return "Store `dict(value)` instead."
    if dataclasses.is_dataclass(value):
        return "Store `dataclasses.asdict(value)` instead."
    return "Store plain data instead, such as the tensors it holds."


@functools.lru_cache(maxsize=256)
def _namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """The namedtuple class :meth:`Record.load` rebuilds: one per name and fields, so equal ones are one type."""
    return collections.namedtuple(name, fields)


def _return_type(name: str) -> type | None:
    """``torch.return_types.<name>`` when that is a return type, else None."""
    if not name.isidentifier() or name.startswith("_"):
        return None
    kind = getattr(torch.return_types, name, None)
    return kind if isinstance(kind, type) and issubclass(kind, tuple) and hasattr(kind, "n_sequence_fields") else None


def _write_atomically(blob: dict[str, Any], file: str) -> None:
    """``torch.save`` to a temporary file beside `file`, check that it reads back, then rename it."""
    target = os.path.realpath(file)
    directory, base = os.path.split(target)
    while True:
        temporary = os.path.join(directory, f".{base}.{secrets.token_hex(6)}.tmp")
        try:  # mode 0o666 less the umask, as a file torch.save creates would have
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            break
        except FileExistsError:
            continue
        except OSError as error:  # name the file asked for, not the temporary one
            raise type(error)(error.errno, error.strerror, file) from None
    try:
        with os.fdopen(descriptor, "wb") as f:  # a file object: the archive's folder is `archive`, not the temporary name
            torch.save(blob, f)
            f.flush()
            os.fsync(f.fileno())
        try:  # mmap: parses the pickle without reading the tensors' bytes
            torch.load(temporary, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError as error:
            raise TypeError(
                "Record.save: a saved Record must load with `torch.load(weights_only=True)`, got values that pickle "
                "to something it refuses (such as an object set as an attribute of a stored tensor), so nothing was "
                f"written to {file!r}. Store plain data only; the error's cause names what was refused."
            ) from error
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def _truncated(file: str, detail: str) -> str:
    return (
        "Record.load: a Record file is a complete archive as `Record.save` writes it, got a truncated or corrupt "
        f"file {file!r} ({detail}). Write it again with `Record.save`."
    )


def _foreign(file: str, what: str) -> RecordError:
    return RecordError(
        f"Record.load: expected a file written by `Record.save`, got {what} from {file!r}. Pass the path of a saved Record."
    )


def _check_archive(file: str) -> None:
    """Raise unless `file` is a complete zip archive as ``torch.save`` writes, every part matching its CRC-32."""
    with open(file, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        raise RecordError(_truncated(file, "it is empty"))
    if head != _ZIP_MAGIC and not (len(head) < len(_ZIP_MAGIC) and _ZIP_MAGIC.startswith(head)):
        raise _foreign(file, "a file that is not a zip archive")
    try:
        with zipfile.ZipFile(file) as archive:
            pickles = [n for n in archive.namelist() if n.count("/") == 1 and n.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise _foreign(file, "a zip archive that `torch.save` did not write")
            damaged = archive.testzip()
    except (zipfile.BadZipFile, EOFError, zlib.error, ValueError, NotImplementedError) as error:
        raise RecordError(_truncated(file, "its zip directory is missing or damaged")) from error
    if damaged is not None:
        raise RecordError(_truncated(file, f"its part {damaged!r} fails its CRC-32 check"))


class _Malformed(Exception):
    """Internal: what is wrong with a loaded blob, turned into a RecordError naming the file."""


def _decoded(blob: Any, file: str) -> dict[str, dict[str, tuple[Any, ...]]]:
    """The Record data in a loaded `blob`, once its whole structure is checked."""
    if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
        raise RecordError(
            f"Record.load: expected a file written by `Record.save`, got {type(blob).__name__} "
            f"from {file!r}. Load it with `torch.load` instead."
        )
    version = blob.get("version")
    if type(version) is int and version > _FORMAT_VERSION:
        raise RecordError(
            f"Record.load: this funhooks reads Record files of format version 1 to {_FORMAT_VERSION}, got version "
            f"{version} in {file!r}. Upgrade funhooks to read it."
        )
    try:
        return _checked_blob(blob, version)
    except _Malformed as problem:
        raise RecordError(
            "Record.load: a Record file holds `{path: {name: [value, ...]}}` of plain data, got "
            f"{problem} in {file!r}. The file was altered or not written by `Record.save`; write it again."
        ) from None


def _checked_blob(blob: dict[str, Any], version: Any) -> dict[str, dict[str, tuple[Any, ...]]]:
    if type(version) is not int or version < 1:
        raise _Malformed(f"version {version!r}")
    keys = ["format", "version", "data"] + (["types"] if version >= 2 else [])
    if sorted(map(str, blob)) != sorted(keys):
        raise _Malformed(f"the keys {list(blob)}")
    data = blob["data"]
    if type(data) is not dict:
        raise _Malformed(f"{type(data).__name__} for `data`")
    for path, names in data.items():
        if type(path) is not str:
            raise _Malformed(f"the path {path!r}")
        if type(names) is not dict:
            raise _Malformed(f"{type(names).__name__} for the path {path!r}")
        for name, calls in names.items():
            if type(name) is not str:
                raise _Malformed(f"the name {name!r} at {path!r}")
            if type(calls) is not list:
                raise _Malformed(f"{type(calls).__name__} for the calls of {path!r}/{name!r}")
            for i, value in enumerate(calls):
                _check_plain(value, _Where(path, name, i, len(calls)), ())
    rebuilt = _rebuild_types(data, blob.get("types", []))
    return {p: {n: tuple(calls) for n, calls in names.items()} for p, names in rebuilt.items()}


def _check_plain(value: Any, where: _Where, position: tuple[Any, ...]) -> None:
    kind = type(value)
    if kind in _PLAIN or _is_saveable_tensor(value):
        return
    if kind is tuple or kind is list:
        for i, v in enumerate(value):
            _check_plain(v, where, (*position, i))
    elif kind in _DICTS and all(map(_is_plain_key, value)):
        for k, v in value.items():
            _check_plain(v, where, (*position, k))
    else:
        raise _Malformed(f"a {kind.__name__} at `{where.at(position)}`")


def _rebuild_types(data: dict[str, dict[str, list[Any]]], entries: Any) -> dict[str, dict[str, list[Any]]]:
    """`data` with the namedtuples and return types its `types` entries name rebuilt, in place."""
    if type(entries) is not list:
        raise _Malformed(f"{type(entries).__name__} for `types`")
    wanted: dict[tuple[str, str, int], dict[tuple[Any, ...], type]] = {}
    for entry in entries:
        kind = _entry_type(entry, data)
        if kind is None:
            raise _Malformed(f"the type entry {_clipped(entry)}")
        positions = wanted.setdefault(tuple(entry[:3]), {})
        if entry[3] in positions:
            raise _Malformed(f"the type entry {_clipped(entry)}")
        positions[entry[3]] = kind
    for (path, name, call), positions in wanted.items():
        calls = data[path][name]
        calls[call] = _rebuilt(calls[call], (), positions, _Where(path, name, call, len(calls)))
        if positions:  # a position that holds no container at all
            raise _Malformed(f"a type entry for `{_Where(path, name, call, len(calls)).at(next(iter(positions)))}`, "
                             "which holds no tuple of its length")
    return data


def _entry_type(entry: Any, data: dict[str, dict[str, list[Any]]]) -> type | None:
    """The class a well-formed `types` entry names, or None."""
    if type(entry) is not tuple or len(entry) != 7:
        return None
    path, name, call, position, kind, type_name, fields = entry
    if not (type(path) is str and type(name) is str and type(call) is int and type(position) is tuple
            and type(type_name) is str and type(fields) is tuple and all(type(f) is str for f in fields)):
        return None
    if not (0 <= call < len(data.get(path, {}).get(name, ()))):
        return None
    if kind == _RETURN_TYPE:
        return _return_type(type_name) if not fields else None
    if kind == _NAMEDTUPLE:
        try:
            return _namedtuple(type_name, fields)
        except (TypeError, ValueError):
            return None
    return None


def _rebuilt(value: Any, position: tuple[Any, ...], positions: dict[tuple[Any, ...], type], where: _Where) -> Any:
    kind = type(value)
    if kind is tuple or kind is list:
        value = kind(_rebuilt(v, (*position, i), positions, where) for i, v in enumerate(value))
    elif kind in _DICTS:
        value = kind((k, _rebuilt(v, (*position, k), positions, where)) for k, v in value.items())
    cls = positions.pop(position, None)
    if cls is None:
        return value
    arity = cls.n_sequence_fields if hasattr(cls, "n_sequence_fields") else len(cls._fields)
    if kind is not tuple or len(value) != arity:
        raise _Malformed(f"a type entry for `{where.at(position)}`, which holds no tuple of its length")
    return cls(value) if hasattr(cls, "n_sequence_fields") else cls._make(value)


def _clipped(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
