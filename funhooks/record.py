"""Record: the immutable tree of what a run stored, keyed by module path.

Each node maps record names to the values of every call, in call order. A Record holds no
reference to the model (paths are strings) and, with ``detach=True``, none to the autograd
graph. It is a registered pytree, so ``torch.func`` transforms return it batched and
``torch.utils._pytree.tree_map`` sees its tensors.

Memory: a Record keeps every stored value alive; ``rec.map(torch.Tensor.cpu)`` or saving
and dropping it are the ways to release device memory.
"""

from __future__ import annotations

import collections
import os
import types
from collections.abc import Callable, Iterator, KeysView, Mapping
from typing import Any

import torch

from . import _torch
from .errors import FrozenError, RecordError, RecordKeyError

__all__ = ["Record", "RecordNode"]

_SAVEABLE = (torch.Tensor, int, float, complex, str, bool, type(None), torch.dtype, torch.device, torch.Size)
"""Leaves that ``torch.load(weights_only=True)`` reads back without running code."""
_NO_NOTES: Mapping[str, tuple[tuple[str | None, str], ...]] = types.MappingProxyType({})
"""A Record's notes on absences, by path: ``(name or None, sentence)`` pairs."""
_FORMAT = "funhooks.Record"
_FORMAT_VERSION = 1


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

    __slots__ = ("_path", "_values", "_notes")

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
                  for path, names in _checked(data or {})}
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
        """Write the record with ``torch.save``; :meth:`load` reads it without unpickling code.

        Raises:
            TypeError: when a stored value is not a tensor, number, str, bool, None or a
                list / tuple / dict of those.
        """
        data = {p: {n: list(vs) for n, vs in names.items()} for p, names in self._data.items()}
        for leaf in _torch.tree_leaves(data):
            if not isinstance(leaf, _SAVEABLE):
                raise TypeError(
                    f"Record.save: stored values are tensors, numbers, str, bool or None in lists, "
                    f"tuples and dicts, got {type(leaf).__name__}. Store plain data, or "
                    "`rec.map(...)` it first."
                )
        torch.save({"format": _FORMAT, "version": _FORMAT_VERSION, "data": data}, path)

    @classmethod
    def load(cls, path: str | os.PathLike, *, map_location: Any = None) -> Record:
        """Read a record written by :meth:`save` (``torch.load(weights_only=True)``).

        Example:
            >>> import tempfile, os, torch, funhooks as fh
            >>> rec = fh.Record({"fc": {"output": (torch.arange(3),)}})
            >>> with tempfile.TemporaryDirectory() as d:
            ...     rec.save(os.path.join(d, "rec.pt"))
            ...     back = fh.Record.load(os.path.join(d, "rec.pt"))
            >>> back.equal(rec)
            True
        """
        blob = torch.load(path, map_location=map_location, weights_only=True)
        if not isinstance(blob, dict) or blob.get("format") != _FORMAT:
            raise RecordError(
                f"Record.load: expected a file written by `Record.save`, got {type(blob).__name__} "
                f"from {os.fspath(path)!r}. Load it with `torch.load` instead."
            )
        return cls(blob["data"])

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
    return types.MappingProxyType({p: tuple(sorted(ns, key=lambda n: n[0] is not None)) for p, ns in index.items()})


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
    if isinstance(x, (float, complex)) and x != x and y != y:
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


_torch.register_pytree(Record, _flatten, _unflatten, "funhooks.Record")
