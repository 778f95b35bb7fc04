"""Shard files of an activation store: one safetensors file per shard, written as a stream.

A shard ``shard.rank{r}.{k:06d}.safetensors`` holds one tensor per column, rows first, in
the safetensors layout: an 8-byte little-endian header size, a JSON header (dtype, shape
and byte range of each tensor, plus ``__metadata__``), then the raw little-endian bytes.
It is written under a hidden temporary name and renamed once whole (see ``_manifest.py``
for when it counts as part of the store).

Why the layout is written here and not by ``safetensors.torch.save_file``: that function
needs a shard's whole tensors in memory, so every batch would first be copied into a
shard-sized buffer. Here each batch's rows go from the activation straight to their place
in the file (one ``write`` per column, no copy), so memory holds one batch, not one shard.
The files are read by the safetensors library itself (``dataset.py``), which checks the
layout, and the tests read them with ``safetensors.torch.load_file`` too.

Costs: per batch one ``seek`` and ``write`` per column; the last, shorter shard of a run is
compacted once, moving its columns to close the space left for rows that never came (at
most one shard's bytes, copied ``_COPY_CHUNK_BYTES`` at a time). Checksums are never read
back: each column's region keeps a running CRC-32 of the bytes written into it
(``zlib.crc32`` on the batch's own buffer, at gigabytes per second, the GIL released),
and the header's is taken when it is written at the end. Compaction moves a region
whole, so its CRC-32 stays that of its bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import pathlib
import re
import secrets
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, BinaryIO, NamedTuple, TypeAlias

import attrs
import torch

from funhooks import _frozen
from funhooks.errors import StoreError

__all__ = ["Column", "HEADER", "JsonObject", "SHARD", "ShardFile", "TEMP_SUFFIX", "crc32_of", "dtype_name",
           "is_storable", "rank_files", "region_sizes"]

SHARD = "shard.rank{rank}.{index:06d}.safetensors"
TEMP_SUFFIX = ".tmp"
_COPY_CHUNK_BYTES = 1 << 20
"""Compaction of a last, shorter shard copies, and ``verify`` reads, at most this many bytes at
a time, through one buffer of this size (a constant next to a batch)."""

JsonObject: TypeAlias = "Mapping[str, Any]"
"""A JSON object as ``json.loads`` reads it: its values are whatever the file holds, so every
field the store uses is checked before it is read (``_manifest``); also what the writer builds."""

_SHARD_RE = r"\.?shard\.rank{rank}\.\d+\.safetensors(\.[0-9a-f]+\.tmp)?"

_CODES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
    torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
                     ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _CODES[getattr(torch, _name)] = _code


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``."""
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise StoreError(f"ActivationDataset: a column's dtype is a torch dtype name, got {name!r}. Rewrite the store.")
    return dtype


def is_storable(dtype: torch.dtype) -> bool:
    """Whether the safetensors layout has a code for `dtype`."""
    return dtype in _CODES


def _shape(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(dims)


@_frozen.frozen
@attrs.frozen
class Column:
    """One column of a store: its name (``"<Record path>/<record name>"``) and one row's dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...] = attrs.field(converter=_shape)

    @property
    def row_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, obj: JsonObject) -> Column:
        return cls(str(obj["name"]), _parse_dtype(obj["dtype"]), _shape(int(d) for d in obj["shape"]))

    def describe(self) -> str:
        return f"{dtype_name(self.dtype)} rows of shape {self.shape}"


HEADER = "header"
"""The key of a shard's header region (its 8-byte size and JSON header) in a manifest line's ``crc32s``."""


class _Finished(NamedTuple):
    """A finished shard file: its size in bytes and the CRC-32 of each region: ``HEADER``
    (bytes ``0:8 + header size``) and every column's tensor bytes, by column name."""

    bytes: int
    crc32s: dict[str, int]


def crc32_of(f: io.BufferedIOBase, size: int | None = None) -> int:
    """The CRC-32 of the next `size` bytes of `f` (all that is left if None; fewer if
    the file ends first), read ``_COPY_CHUNK_BYTES`` at a time."""
    crc, buffer = 0, memoryview(bytearray(_COPY_CHUNK_BYTES))
    while size is None or size > 0:
        got = f.readinto(buffer if size is None else buffer[:min(size, _COPY_CHUNK_BYTES)])
        if not got:
            break
        crc = zlib.crc32(buffer[:got], crc)
        size = None if size is None else size - got
    return crc


def region_sizes(columns: Sequence[Column], rows: int) -> list[tuple[str, int]]:
    """(column name, bytes) of each column region of a shard of `rows` rows, in file order."""
    return [(c.name, rows * c.row_bytes) for c in _in_layout_order(columns)]


def rank_files(directory: pathlib.Path, rank: int) -> list[pathlib.Path]:
    """Every shard file and shard temporary of `rank` in `directory`, listed or not."""
    pattern = re.compile(_SHARD_RE.format(rank=rank))
    return [p for p in directory.iterdir() if pattern.fullmatch(p.name)]


def _layout(columns: Sequence[Column], rows: int) -> dict[str, tuple[int, int]]:
    """Byte range of each column in the data section: widest dtypes first, so every
    tensor starts aligned to its element size (the data section starts at a multiple of 8)."""
    out, at = {}, 0
    for c in columns:
        out[c.name] = (at, at + rows * c.row_bytes)
        at += rows * c.row_bytes
    return out


def _in_layout_order(columns: Sequence[Column]) -> list[Column]:
    return sorted(columns, key=lambda c: (-c.dtype.itemsize, c.name))


def _header(columns: Sequence[Column], rows: int, meta: Mapping[str, str], reserve: int = 0) -> bytes:
    """The safetensors JSON header for `rows` rows, padded with spaces to a multiple of 8
    and to at least `reserve` bytes."""
    obj: dict[str, object] = {"__metadata__": dict(meta)}
    for c in columns:
        begin, end = _layout(columns, rows)[c.name]
        obj[c.name] = {"dtype": _CODES[c.dtype], "shape": [rows, *c.shape], "data_offsets": [begin, end]}
    raw = json.dumps(obj, separators=(",", ":")).encode()
    size = max(len(raw), reserve)
    size += -size % 8
    return raw + b" " * (size - len(raw))


def _buffer(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (valid while `t` is alive)."""
    n = t.numel() * t.element_size()
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class ShardFile:
    """One shard being written: a temporary file laid out for `capacity` rows."""

    def __init__(self, directory: pathlib.Path, rank: int, index: int, columns: Sequence[Column],
                 capacity: int, meta: Mapping[str, str]) -> None:
        self.final = directory / SHARD.format(rank=rank, index=index)
        self.temp = directory / f".{self.final.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}"
        self.columns = _in_layout_order(columns)
        self.capacity, self.rows, self._meta = capacity, 0, dict(meta)
        header = _header(self.columns, capacity, self._meta)
        self._reserve, self._data = len(header), 8 + len(header)
        self._begin = {name: b for name, (b, _) in _layout(self.columns, capacity).items()}
        self._crc32s = dict.fromkeys(self._begin, 0)
        self._head = struct.pack("<Q", len(header)) + header
        self._file = open(self.temp, "xb+")  # noqa: SIM115 - closed by finish() or discard()
        try:
            self._file.write(self._head)
        except BaseException:
            self.discard()
            raise

    def buffers(self, rows: Mapping[str, torch.Tensor]) -> list[tuple[str, memoryview]]:
        """Each column's bytes in `rows` (contiguous CPU tensors of one length), in file order,
        without a copy: what :meth:`write` writes and :meth:`digest` checksums (valid while the
        caller keeps `rows` alive)."""
        return [(c.name, _buffer(rows[c.name])) for c in self.columns]

    def write(self, buffers: Sequence[tuple[str, memoryview]], rows: int) -> None:
        """Write the next `rows` rows, as :meth:`buffers` gave them: a ``seek`` and a ``write``
        per column, which allocate nothing (the store's worker thread calls this)."""
        if rows:
            for c, (_, data) in zip(self.columns, buffers, strict=True):
                self._file.seek(self._data + self._begin[c.name] + self.rows * c.row_bytes)
                self._file.write(data)
        self.rows += rows

    def digest(self, buffers: Sequence[tuple[str, memoryview]]) -> None:
        """Add the next rows' bytes (as :meth:`buffers` gave them, in write order) to their
        columns' running CRC-32s."""
        for name, data in buffers:
            self._crc32s[name] = zlib.crc32(data, self._crc32s[name])

    def finish(self, *, fsync: bool) -> _Finished:
        """Finish the file (compacted when it holds fewer than `capacity` rows); its size and checksums."""
        if self.rows < self.capacity:
            self._compact()
        self._file.flush()
        if fsync:
            os.fsync(self._file.fileno())
        self._file.close()
        return _Finished(self._data + sum(self.rows * c.row_bytes for c in self.columns),
                         {HEADER: zlib.crc32(self._head), **self._crc32s})

    def _compact(self) -> None:
        header = _header(self.columns, self.rows, self._meta, reserve=self._reserve)
        assert len(header) == self._reserve, "a header for fewer rows is never longer"
        buffer = memoryview(bytearray(_COPY_CHUNK_BYTES))
        for c in self.columns:
            src, dst = self._data + self._begin[c.name], self._data + _layout(self.columns, self.rows)[c.name][0]
            left = self.rows * c.row_bytes
            while left and src != dst:  # dst < src: copying forward never overwrites unread bytes
                self._file.seek(src)
                got = self._file.readinto(buffer[:min(left, _COPY_CHUNK_BYTES)])
                self._file.seek(dst)
                self._file.write(buffer[:got])
                src, dst, left = src + got, dst + got, left - got
        self._file.seek(8)
        self._file.write(header)
        self._head = self._head[:8] + header
        self._file.truncate(self._data + sum(self.rows * c.row_bytes for c in self.columns))

    def discard(self) -> None:
        """Close and delete the temporary (never raises)."""
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(OSError):
            self.temp.unlink()
