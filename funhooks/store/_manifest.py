"""The manifest of an activation store: the commit log that says which shards exist.

A store is a directory; rank ``r`` owns these files in it:

- ``manifest.rank{r}.jsonl`` (JSON Lines). Line 1 is the header: format name and version,
  the columns (dtype and shape of one row), specs, model class, module paths, options and
  library versions. Each further line commits one shard: ``{"shard", "file", "rows",
  "bytes", "end", "crc32s", "stats"}``, where ``end = [b, r]`` says that the rows committed
  so far are those of every batch before ``b`` plus the first ``r`` rows of batch ``b``, and
  ``crc32s`` holds the CRC-32 of each region of the shard's file: ``"header"`` (its first
  ``8 + header size`` bytes) and each column's tensor bytes, by column name (column names
  always hold a ``/``). Stores written before it have ``crc32``, the checksum of the whole
  file, or, older still, no checksum.
  ``file`` is exactly the shard's own name below: a line naming anything else (a path out
  of the directory) is refused, and a listed shard that is a symbolic link too.
- ``shard.rank{r}.{k:06d}.safetensors``, the shards (``_shards.py``).
- hidden files: the temporary of the shard being written, and ``.lock.rank{r}``.

Commit order, so that a process killed anywhere leaves the store as it was before the
shard or after it, never with half a shard: data into the temporary, ``fsync``, rename to
the final name, ``fsync`` the directory, append the manifest line, ``fsync`` the manifest.
Readers trust the manifest alone: a shard file it does not list, or a last line without
its newline, is not part of the store (the next writer of that rank deletes or cuts them).
A failed append is cut back. Nothing is pickled: the manifest is JSON.

Costs: per committed shard, one line appended and (with ``fsync``) an ``fsync`` of the
shard, the directory and the manifest; opening reads and checks the manifest and ``stat``s
each shard (checksums are checked by ``ActivationDataset.verify``, which reads every byte).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pathlib
import re
import secrets
import stat
import types
from collections.abc import Mapping
from typing import TypeGuard

import attrs
import torch

from funhooks import _frozen
from funhooks.errors import StoreError

from ._shards import HEADER, SHARD, TEMP_SUFFIX, Column, JsonObject, is_storable

__all__ = ["FORMAT", "FORMAT_VERSION", "RankLock", "append_line", "check_listed", "create_manifest", "fsync_directory",
           "manifest_path", "ranks_in", "read_manifest"]

FORMAT = "funhooks.activations"
FORMAT_VERSION = 1
"""The version of this layout; a reader refuses any other."""

_MANIFEST = "manifest.rank{rank}.jsonl"
_LOCK = ".lock.rank{rank}"
_MANIFEST_RE = re.compile(r"manifest\.rank(\d+)\.jsonl")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
"""Opened with this, a store's own file that is a symbolic link fails instead of being followed."""
_ROW_BYTES_LIMIT = 1 << 63


def manifest_path(directory: pathlib.Path, rank: int) -> pathlib.Path:
    return directory / _MANIFEST.format(rank=rank)


def ranks_in(directory: pathlib.Path) -> list[int]:
    """The ranks with a manifest in `directory`, in order."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _MANIFEST_RE.fullmatch(p.name)))


@_frozen.frozen
@attrs.frozen
class _Manifest:
    """What a rank's manifest commits: the header (None before the first batch) and shard lines."""

    path: pathlib.Path
    header: JsonObject | None
    shards: tuple[JsonObject, ...]
    valid_bytes: int
    """Bytes up to the last complete line; more on disk means the last line was torn."""
    size: int


def read_manifest(path: pathlib.Path, caller: str) -> _Manifest:
    """Read `path` (an absent file is an empty manifest); a torn last line is left out.

    Every field the store uses is checked: a damaged or crafted manifest is a StoreError
    naming its line and field, and a shard line names its shard exactly as the writer does,
    so no path out of the directory is ever followed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return _Manifest(path, None, (), 0, 0)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise _not_regular(path, caller) from None
    with os.fdopen(fd, "rb") as f:
        data = f.read()
    cut = data.rfind(b"\n") + 1
    lines = []
    for i, raw in enumerate(data[:cut].splitlines(), start=1):
        try:
            obj = json.loads(raw)
            if not isinstance(obj, dict):
                raise ValueError(f"a JSON {type(obj).__name__}")
        except ValueError as e:
            raise StoreError(
                f"{caller}: each line of a manifest is one JSON object, got line {i} of {str(path)!r} unreadable "
                f"({e}). Restore the file, or write the store again in a new directory."
            ) from None
        lines.append(obj)
    header = lines[0] if lines else None
    if header is not None:
        _check_header_format(header, path, caller)
        columns = _check_header(header, path, caller)
        for k, line in enumerate(lines[1:]):
            _check_line(line, k, int(header["rank"]), columns, path, caller)
    return _Manifest(path, header, tuple(lines[1:]), cut, len(data))


def _not_regular(path: pathlib.Path, caller: str) -> StoreError:
    return StoreError(
        f"{caller}: a store's files are regular files in its directory, got {str(path)!r}, a symbolic link. "
        "Copy the file it points to in its place, or write the store again in a new directory."
    )


def _is_int(value: object, low: int = 0, high: int | None = None) -> TypeGuard[int]:
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value < high))


class _Field:
    """Builds the error for one field of one manifest line."""

    def __init__(self, obj: JsonObject, line: int, path: pathlib.Path, caller: str) -> None:
        self.obj, self.line, self.path, self.caller = obj, line, path, caller

    def error(self, field: str, rule: str, obj: JsonObject | None = None) -> StoreError:
        obj = self.obj if obj is None else obj
        key = field.rsplit(".", 1)[-1]
        got = f"`{field}` {obj[key]!r}" if key in obj else f"no `{field}`"
        return StoreError(
            f"{self.caller}: {rule}, got {got} on line {self.line} of {str(self.path)!r}. Restore the manifest, or "
            "write the store again in a new directory."
        )


def _check_header(header: JsonObject, path: pathlib.Path, caller: str) -> list[Column]:
    """The columns of a header whose fields are all usable (a StoreError names the first that is not)."""
    field = _Field(header, 1, path, caller)
    match = _MANIFEST_RE.fullmatch(path.name)
    rank = int(match.group(1)) if match else header.get("rank")
    if not _is_int(header.get("rank")) or header["rank"] != rank:
        raise field.error("rank", f"a manifest's header gives the `rank` of its file name, {rank}")
    if not _is_int(header.get("rows_per_shard"), 1):
        raise field.error("rows_per_shard", "a manifest's header gives `rows_per_shard`, a positive int")
    columns = header.get("columns")
    if not isinstance(columns, list) or not columns:
        raise field.error("columns", "a manifest's header gives `columns`, a non-empty list of {name, dtype, shape} "
                                     "objects")
    out = []
    for j, c in enumerate(columns):
        c = c if isinstance(c, Mapping) else {}
        if not isinstance(c.get("name"), str):
            raise field.error(f"columns[{j}].name", "a column's `name` is a string", c)
        dtype = getattr(torch, str(c.get("dtype")), None)
        if not isinstance(dtype, torch.dtype) or not is_storable(dtype):
            raise field.error(f"columns[{j}].dtype", "a column's `dtype` names a dtype a store holds (bool, an int "
                                                     "or a float type)", c)
        shape = c.get("shape")
        if (not isinstance(shape, list) or not all(_is_int(d) for d in shape)
                or math.prod(shape) * dtype.itemsize >= _ROW_BYTES_LIMIT):
            raise field.error(f"columns[{j}].shape", "a column's `shape` is a list of non-negative ints, one row "
                                                     "under 2**63 bytes", c)
        out.append(Column(c["name"], dtype, shape))
    return out


def _check_line(line: JsonObject, k: int, rank: int, columns: list[Column], path: pathlib.Path,
                caller: str) -> None:
    """Refuse a shard line (the `k`-th) with a field the store cannot use."""
    field = _Field(line, k + 2, path, caller)
    if line.get("shard") != k or not _is_int(line["shard"]):
        raise field.error("shard", f"each shard line gives its place `shard`, {k} here")
    name = SHARD.format(rank=rank, index=k)
    if line.get("file") != name:
        raise field.error("file", f"each shard line names its file as the writer does, {name!r} here")
    if not _is_int(line.get("rows"), 1):
        raise field.error("rows", "each shard line gives its `rows`, a positive int")
    need = 8 + line["rows"] * sum(c.row_bytes for c in columns)
    if not _is_int(line.get("bytes"), need):
        raise field.error("bytes", f"each shard line gives its `bytes`, at least the {need} its rows take")
    end = line.get("end")
    if not isinstance(end, list) or len(end) != 2 or not all(_is_int(e) for e in end):
        raise field.error("end", "each shard line gives its `end`, [batch, row] as two non-negative ints")
    if "crc32" in line and not _is_int(line["crc32"], 0, 1 << 32):
        raise field.error("crc32", "each shard line gives its `crc32`, if any, as an int in range(2**32)")
    crcs = line.get("crc32s")
    regions = [HEADER, *(c.name for c in columns)]
    if "crc32s" in line and (not isinstance(crcs, dict) or sorted(crcs) != sorted(regions)
                             or not all(_is_int(v, 0, 1 << 32) for v in crcs.values())):
        raise field.error("crc32s", f"each shard line gives its `crc32s`, if any, as an int in range(2**32) for "
                                    f"each of {regions}")


def _check_header_format(header: JsonObject, path: pathlib.Path, caller: str) -> None:
    """Refuse a manifest of another format, or of another version of this one."""
    if header.get("format") != FORMAT:
        raise StoreError(
            f"{caller}: a manifest starts with a header of format {FORMAT!r}, got {header.get('format')!r} in "
            f"{str(path)!r}. Point to a directory written by fh.ActivationWriter, or move that file away."
        )
    if header.get("version") != FORMAT_VERSION:
        versions = header.get("versions")
        wrote = versions.get("funhooks", "another release") if isinstance(versions, Mapping) else "another release"
        raise StoreError(
            f"{caller}: this funhooks reads and writes store format version {FORMAT_VERSION}, got version "
            f"{header.get('version')!r} in {str(path)!r}. Read it with the funhooks that wrote it ({wrote}), "
            "or write the store again in a new directory."
        )


def check_listed(manifest: _Manifest, rank: int, directory: pathlib.Path, caller: str) -> StoreError | None:
    """None, or the error for the first listed shard that is missing, not a regular file, or of another size."""
    for k, line in enumerate(manifest.shards):
        path = directory / line["file"]
        try:
            found = path.lstat()  # a link is refused, not followed out of the store
        except FileNotFoundError:
            found = None
        if found is None or not stat.S_ISREG(found.st_mode) or found.st_size != line["bytes"]:
            first = manifest.shards[k - 1]["end"][0] if k else 0
            got = ("missing" if found is None else "a symbolic link" if stat.S_ISLNK(found.st_mode) else
                   "not a regular file" if not stat.S_ISREG(found.st_mode) else
                   f"{found.st_size} bytes where the manifest says {line['bytes']}")
            return StoreError(
                f"{caller}: every shard a manifest lists is in the store as written, got {line['file']!r} "
                f"(rank {rank}, shard {k}) {got} in {str(directory)!r}. Restore that file, or cut "
                f"{manifest.path.name} to its first {k + 1} lines so that a writer rewrites it from batch {first}."
            )
    return None


def fsync_directory(directory: pathlib.Path) -> None:
    """Make renames in `directory` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def create_manifest(path: pathlib.Path, header: JsonObject, *, fsync: bool) -> None:
    """Write the header line as a new manifest, atomically (temporary + rename)."""
    temp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    try:
        with open(temp, "xb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    if fsync:
        fsync_directory(path.parent)


def append_line(path: pathlib.Path, obj: JsonObject, *, fsync: bool) -> None:
    """Append one line; on failure the file is cut back to its old length."""
    with open(path, "ab") as f:
        size = f.seek(0, os.SEEK_END)
        try:
            f.write(json.dumps(obj).encode() + b"\n")
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):
                f.truncate(size)
            raise


# -- one writer per rank -------------------------------------------------------------------

_fcntl: types.ModuleType | None
try:
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows: no advisory locks, one writer per rank is on the user
    _fcntl = None


class RankLock:
    """An advisory lock on one rank of a store, held while a writer has it open.

    The kernel drops it when the holding process dies, so a killed writer never leaves
    a stale lock behind.
    """

    def __init__(self, directory: pathlib.Path, rank: int, caller: str) -> None:
        self._fd: int | None = None
        if _fcntl is None:
            return
        path = directory / _LOCK.format(rank=rank)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise _not_regular(path, caller) from None
        try:
            _fcntl.flock(fd, _fcntl.LOCK_EX | _fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StoreError(
                f"{caller}: one writer at a time writes a rank of a store, got rank {rank} of {str(directory)!r} "
                "locked by another process. Stop that process, or write with another `rank=` or directory."
            ) from None
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
