"""The manifest of an activation store: the commit log that says which shards exist.

A store is a directory; rank ``r`` owns these files in it:

- ``manifest.rank{r}.jsonl`` (JSON Lines). Line 1 is the header: format name and version,
  the columns (dtype and shape of one row), specs, model class, module paths, options and
  library versions. Each further line commits one shard: ``{"shard", "file", "rows",
  "bytes", "end"}``, where ``end = [b, r]`` says that the rows committed so far are those
  of every batch before ``b`` plus the first ``r`` rows of batch ``b``.
- ``shard.rank{r}.{k:06d}.safetensors``, the shards (``_shards.py``).
- hidden files: the temporary of the shard being written, and ``.lock.rank{r}``.

Commit order, so that a process killed anywhere leaves the store as it was before the
shard or after it, never with half a shard: data into the temporary, ``fsync``, rename to
the final name, ``fsync`` the directory, append the manifest line, ``fsync`` the manifest.
Readers trust the manifest alone: a shard file it does not list, or a last line without
its newline, is not part of the store (the next writer of that rank deletes or cuts them).
A failed append is cut back. Nothing is pickled: the manifest is JSON.

Costs: per committed shard, one line appended and (with ``fsync``) an ``fsync`` of the
shard, the directory and the manifest; opening reads the manifest and ``stat``s each shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import secrets
from collections.abc import Mapping
from typing import Any

import attrs

from funhooks.errors import StoreError

from ._shards import TEMP_SUFFIX

FORMAT = "funhooks.activations"
FORMAT_VERSION = 1
"""The version of this layout; a reader refuses any other."""

MANIFEST = "manifest.rank{rank}.jsonl"
LOCK = ".lock.rank{rank}"
_MANIFEST_RE = re.compile(r"manifest\.rank(\d+)\.jsonl")


def manifest_path(directory: pathlib.Path, rank: int) -> pathlib.Path:
    return directory / MANIFEST.format(rank=rank)


def ranks_in(directory: pathlib.Path) -> list[int]:
    """The ranks with a manifest in `directory`, in order."""
    if not directory.is_dir():
        return []
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _MANIFEST_RE.fullmatch(p.name)))


@attrs.frozen
class Manifest:
    """What a rank's manifest commits: the header (None before the first batch) and shard lines."""

    path: pathlib.Path
    header: dict[str, Any] | None
    shards: tuple[dict[str, Any], ...]
    valid_bytes: int
    """Bytes up to the last complete line; more on disk means the last line was torn."""
    size: int


def read_manifest(path: pathlib.Path, caller: str) -> Manifest:
    """Read `path` (an absent file is an empty manifest); a torn last line is left out."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return Manifest(path, None, (), 0, 0)
    cut = data.rfind(b"\n") + 1
    lines = []
    for i, line in enumerate(data[:cut].splitlines(), start=1):
        try:
            obj = json.loads(line)
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
        check_header_format(header, path, caller)
    return Manifest(path, header, tuple(lines[1:]), cut, len(data))


def check_header_format(header: Mapping[str, Any], path: pathlib.Path, caller: str) -> None:
    """Refuse a manifest of another format, or of another version of this one."""
    if header.get("format") != FORMAT:
        raise StoreError(
            f"{caller}: a manifest starts with a header of format {FORMAT!r}, got {header.get('format')!r} in "
            f"{str(path)!r}. Point to a directory written by fh.ActivationWriter, or move that file away."
        )
    if header.get("version") != FORMAT_VERSION:
        wrote = header.get("versions", {}).get("funhooks", "another release")
        raise StoreError(
            f"{caller}: this funhooks reads and writes store format version {FORMAT_VERSION}, got version "
            f"{header.get('version')!r} in {str(path)!r}. Read it with the funhooks that wrote it ({wrote}), "
            "or write the store again in a new directory."
        )


def check_listed(manifest: Manifest, rank: int, directory: pathlib.Path, caller: str) -> StoreError | None:
    """None, or the error for the first listed shard that is missing or has another size."""
    for k, line in enumerate(manifest.shards):
        path = directory / line["file"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = None
        if size != line["bytes"]:
            first = manifest.shards[k - 1]["end"][0] if k else 0
            got = "missing" if size is None else f"{size} bytes where the manifest says {line['bytes']}"
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


def create_manifest(path: pathlib.Path, header: Mapping[str, Any], *, fsync: bool) -> None:
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


def append_line(path: pathlib.Path, obj: Mapping[str, Any], *, fsync: bool) -> None:
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

_fcntl: Any
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
        fd = os.open(directory / LOCK.format(rank=rank), os.O_RDWR | os.O_CREAT, 0o644)
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
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
