"""The Record file format: what ``Record.save`` writes and ``Record.load`` reads.

A zip archive written by ``torch.save`` holding ``{format, version, data, types}``: plain
data only (tensors, numbers, strings, None, lists, tuples, plain dicts), read back with
``torch.load(weights_only=True)`` so loading never runs code. Namedtuples and
``torch.return_types`` are written as tuples and listed in ``types`` to be rebuilt. A file
is written to a temporary name, synced, read back and only then renamed; a file is checked
(archive, checksums, format, version, structure) before it is trusted.

Cost: one pass over the values to save; loading reads the file twice (checksums, then torch).
"""

from __future__ import annotations

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
from collections.abc import Hashable, Mapping
from typing import TypeAlias

import attrs
import torch

from funhooks import _frozen, _torch
from funhooks.errors import RecordError

from ._compare import DICTS, PLAIN, TENSORS, is_namedtuple
from .node import RecordData, StoredValue

__all__ = ["read", "write"]

_FORMAT = "funhooks.Record"
_FORMAT_VERSION = 2
"""1: ``{format, version, data}``; 2 adds ``types``, the namedtuples and ``torch.return_types``
to rebuild (as ``(path, name, call, position, kind, type name, fields)``)."""
_NAMEDTUPLE, _RETURN_TYPE = "namedtuple", "torch.return_types"
_ZIP_MAGIC = b"PK\x03\x04"

_Position: TypeAlias = "tuple[Hashable, ...]"
"""Where a value sits inside one call's value: the indexes and dict keys leading to it."""
_TypeEntry: TypeAlias = "tuple[str, str, int, _Position, str, str, tuple[str, ...]]"
"""An entry of ``types``: ``(path, name, call, position, kind, type name, fields)``, a plain
tuple so that ``torch.load(weights_only=True)`` reads it."""


def write(data: RecordData, file: str) -> None:
    """Write a Record's `data` to `file` (see ``Record.save``)."""
    types_: list[_TypeEntry] = []
    plain = {p: {n: [_plain(v, _Where(p, n, i, len(vs)), (), types_, file) for i, v in enumerate(vs)]
                 for n, vs in names.items()}
             for p, names in data.items()}
    _write_atomically({"format": _FORMAT, "version": _FORMAT_VERSION, "data": plain, "types": types_}, file)


def read(file: str, map_location: torch.serialization.MAP_LOCATION = None) -> RecordData:
    """The data of the Record in `file` (see ``Record.load``), checked."""
    _check_archive(file)
    _torch.weights_only_reads_complex()
    try:
        blob = torch.load(file, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, EOFError, struct.error, UnicodeDecodeError) as error:  # the pickle stream
        if "PytorchStreamReader" in str(error):  # torch < 2.5 wraps the archive's error into the pickle's
            raise RecordError(_truncated(file, "a tensor its pickle refers to is missing")) from error
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
    return _decoded(blob, file)


# -- the file format -------------------------------------------------------------------------


@_frozen.frozen
@attrs.frozen
class _Where:
    """One call's value in a Record, for messages: ``rec['fc']['output']`` or ``rec.calls('fc', 'output')[1]``."""

    path: str
    name: str
    call: int
    calls: int

    def at(self, position: _Position) -> str:
        head = (f"rec[{self.path!r}][{self.name!r}]" if self.calls == 1
                else f"rec.calls({self.path!r}, {self.name!r})[{self.call}]")
        return head + "".join(f"[{k!r}]" for k in position)


def _plain(value: StoredValue, where: _Where, position: _Position, types_: list[_TypeEntry], file: str) -> StoredValue:
    """`value` as plain data ``torch.load(weights_only=True)`` reads, its namedtuples noted in `types_`."""
    kind = type(value)
    if kind in PLAIN or _is_saveable_tensor(value):
        return value
    if kind is tuple or kind is list:
        return kind(_plain(v, where, (*position, i), types_, file) for i, v in enumerate(value))
    if kind in DICTS:
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


def _is_saveable_tensor(value: object) -> bool:
    return type(value) in TENSORS or (isinstance(value, torch.Tensor) and value.is_nested)


def _is_plain_key(key: object) -> bool:
    kind = type(key)
    return (kind in PLAIN and kind is not torch.Size) or (type(key) is tuple and all(map(_is_plain_key, key)))


def _tuple_type(kind: type) -> tuple[str, str, tuple[str, ...]] | None:
    """``(kind, type name, fields)`` for a tuple type :meth:`Record.load` can rebuild, else None."""
    if not issubclass(kind, tuple):
        return None
    if kind.__module__ == "torch.return_types" and _return_type(kind.__name__) is kind:
        return _RETURN_TYPE, kind.__name__, ()
    if is_namedtuple(kind):
        try:
            fields = tuple(getattr(kind, "_fields"))
            _namedtuple(kind.__name__, fields)
        except (TypeError, ValueError):  # e.g. fields renamed to `_1` by `rename=True`
            return None
        return _NAMEDTUPLE, kind.__name__, fields
    return None


def _conversion(value: object) -> str:
    if _torch.is_dtensor(value):  # a shard (FSDP2): its data is in its local tensor
        return "Store `value.full_tensor()` (the whole, a collective) or `value.to_local()` (this rank's part) instead."
    if isinstance(value, torch.Tensor):
        return "Store `value.as_subclass(torch.Tensor)` instead."
    if is_namedtuple(type(value)):
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


def _write_atomically(blob: dict[str, object], file: str) -> None:
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
        try:
            with os.fdopen(descriptor, "wb") as f:  # a file object: the archive's folder is `archive`, not the temporary name
                torch.save(blob, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as error:
            failed = _failed_write(error)
            if failed is None:
                raise
            raise type(failed)(failed.errno, f"{failed.strerror}; Record.save wrote nothing, and a file already at "
                               "this path is unchanged", file) from error
        _torch.weights_only_reads_complex()
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


def _failed_write(error: BaseException) -> OSError | None:
    """The error of the disk behind a failed write (a full disk): `error`, or the one torch's
    ``RuntimeError: [enforce fail at inline_container.cc]`` hides as its context; else None."""
    found = error if isinstance(error, OSError) else error.__context__
    return found if isinstance(found, OSError) else None


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


def _decoded(blob: object, file: str) -> RecordData:
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


def _checked_blob(blob: dict[str, object], version: object) -> RecordData:
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


def _check_plain(value: StoredValue, where: _Where, position: _Position) -> None:
    kind = type(value)
    if kind in PLAIN or _is_saveable_tensor(value):
        return
    if kind is tuple or kind is list:
        for i, v in enumerate(value):
            _check_plain(v, where, (*position, i))
    elif kind in DICTS and all(map(_is_plain_key, value)):
        for k, v in value.items():
            _check_plain(v, where, (*position, k))
    else:
        raise _Malformed(f"a {kind.__name__} at `{where.at(position)}`")


def _rebuild_types(data: dict[str, dict[str, list[StoredValue]]], entries: object) -> dict[str, dict[str, list[StoredValue]]]:
    """`data` with the namedtuples and return types its `types` entries name rebuilt, in place."""
    if type(entries) is not list:
        raise _Malformed(f"{type(entries).__name__} for `types`")
    wanted: dict[tuple[str, str, int], dict[_Position, type]] = {}
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


def _entry_type(entry: object, data: dict[str, dict[str, list[StoredValue]]]) -> type | None:
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


def _rebuilt(value: StoredValue, position: _Position, positions: dict[_Position, type], where: _Where) -> StoredValue:
    kind = type(value)
    if kind is tuple or kind is list:
        value = kind(_rebuilt(v, (*position, i), positions, where) for i, v in enumerate(value))
    elif kind in DICTS:
        value = kind((k, _rebuilt(v, (*position, k), positions, where)) for k, v in value.items())
    cls = positions.pop(position, None)
    if cls is None:
        return value
    arity = cls.n_sequence_fields if hasattr(cls, "n_sequence_fields") else len(getattr(cls, "_fields"))
    if kind is not tuple or len(value) != arity:
        raise _Malformed(f"a type entry for `{where.at(position)}`, which holds no tuple of its length")
    return cls(value) if hasattr(cls, "n_sequence_fields") else getattr(cls, "_make")(value)


def _clipped(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
