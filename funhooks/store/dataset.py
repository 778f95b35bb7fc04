"""Activation datasets, read: every rank's shards of a store as one memory-mapped Dataset.

:class:`ActivationDataset` reads the manifests (see ``_shards.py``) and nothing else: only
committed shards are part of it, in rank order, then shard order, then row order. Shards
are opened lazily with ``safetensors.safe_open``, whose tensors map the file instead of
reading it, and at most ``MAX_OPEN_SHARDS`` are kept open (per process: a DataLoader
worker opens its own). Rows come back as copies, never as views of a mapping, and exactly
as recorded (after the writer's cast).

Trust: the manifests are checked field by field, and a shard is read only under the plain
name the writer gave it in the store's directory, never through a link. A shard's own
metadata (rank and index) is checked when it is first mapped, so swapped files are refused
before a row of them is returned; :meth:`ActivationDataset.verify` reads every byte against
the CRC-32s each manifest line records (one per region of the file: the header and each
column; the whole file's for stores written before regions had their own).

Costs: opening the dataset reads the manifests and ``stat``s every shard (no data). One row
(``ds[i]``) costs a bisection and one small copy per column; a batch (``ds[indices]``, or a
DataLoader through ``__getitems__``) one gather per shard it touches. Pages of the files
are read by the kernel on first touch and stay in the page cache, not in this process.
"""

from __future__ import annotations

import bisect
import collections
import importlib.util
import json
import os
import pathlib
import types
from collections.abc import Sequence
from typing import Any, NamedTuple, TypeAlias

import torch

from funhooks.errors import ExtraError, StoreError

from . import _manifest, _shards
from .stats import ColumnStats, Moments, from_json, merge, shard_moments

__all__ = ["MAX_OPEN_SHARDS", "ActivationDataset", "require_safetensors"]

MAX_OPEN_SHARDS = 64
"""Shards kept mapped at once per process; the least recently used one is closed first."""

_CALLER = "ActivationDataset"
_Row: TypeAlias = "torch.Tensor | dict[str, torch.Tensor]"
"""One row: its tensor for a store opened on one column, else its tensors by column name."""
_AGREE = (("columns", "columns"), ("specs", "specs"), ("flatten", "`flatten`"), ("dtype", "`dtype`"))


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer dtype of each element size, through which rows of any dtype are gathered."""


class _Listed(NamedTuple):
    """A shard as its manifest lists it."""

    path: pathlib.Path
    rows: int
    rank: int
    shard: int
    crc32: int | None
    """The whole file's CRC-32 (stores written before ``crc32s``), or None."""
    crc32s: dict[str, int] | None
    """The CRC-32 of each region (``_shards.HEADER`` and each column), or None."""
    stats: object
    """The line's ``stats`` (None in stores written before statistics)."""


def _as_indices(index: object) -> torch.Tensor:
    """`index` as a tensor of row numbers; a TypeError for anything but ints."""
    if isinstance(index, str):
        raise TypeError(
            f"{_CALLER}: an index picks rows by position, got {index!r}. To read one column, open the store with "
            f"`columns={index!r}`: fh.ActivationDataset(directory, columns={index!r})."
        )
    try:
        idx = torch.as_tensor(index)
    except (TypeError, ValueError, RuntimeError):
        idx = None
    if idx is None or (idx.numel() and (idx.dtype == torch.bool or idx.is_floating_point() or idx.is_complex())):
        raise TypeError(
            f"{_CALLER}: an index is an int, a slice, or a list or tensor of ints, got {index!r}. "
            "Pass row numbers (int(x) rounds a float towards zero)."
        )
    return idx.long()


def require_safetensors(caller: str) -> types.ModuleType:
    """The safetensors module, or an ExtraError naming the ``store`` extra."""
    if importlib.util.find_spec("safetensors") is None:
        raise ExtraError(
            f"{caller}: activation stores are safetensors files, got safetensors not installed. "
            "Install the extra: pip install 'funhooks[store]'."
        )
    import safetensors

    return safetensors


def _safe_open() -> Any:
    require_safetensors(_CALLER)
    from safetensors import safe_open

    return safe_open


class ActivationDataset(torch.utils.data.Dataset):
    """The rows an :class:`~funhooks.ActivationWriter` committed, as a random-access Dataset.

    Args:
        directory: the store's directory (every rank's shards are read, as one dataset).
        columns: None: every row is a dict of all columns; a column name: every row is that
            tensor; a list of names: dicts of those.

    ``ds[i]`` is one row; ``ds[indices]`` (a list, tensor or slice) stacks rows into a batch
    in one gather per shard. It works with a ``DataLoader``, with workers too. Opening reads
    no shard data: ``ds.verify()`` checks every shard's bytes against its checksum.

    Raises:
        StoreError: for a directory without a store, of another format version, whose ranks
            disagree, with a damaged manifest, a listed shard missing, replaced or a link, or
            an unknown column; at a read, for a shard whose metadata or layout differs.
        TypeError: at a read, for an index that is not an int (a float, a bool, a column name).
        ExtraError: without safetensors (``funhooks[store]``).

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 5), nn.Tanh())
        >>> xs = [torch.randn(8, 3) for _ in range(4)]
        >>> writer = fh.ActivationWriter(model, fh.outputs("*"), tempfile.mkdtemp(), rows_per_shard=10)
        >>> ds = fh.fold(writer, fh.evaluate(model, xs, specs=writer.specs))
        >>> len(ds), sorted(ds[0]), ds[[0, 31]]["1/output"].shape
        (32, ['0/output', '1/output'], torch.Size([2, 5]))
        >>> tanh = fh.ActivationDataset(writer.directory, columns="1/output")
        >>> loader = torch.utils.data.DataLoader(tanh, batch_size=16, shuffle=True)
        >>> [tuple(b.shape) for b in loader]
        [(16, 5), (16, 5)]
    """

    def __init__(self, directory: str | os.PathLike, *, columns: str | Sequence[str] | None = None) -> None:
        self._safe_open = _safe_open()
        self.directory = pathlib.Path(os.fspath(directory))
        ranks = _manifest.ranks_in(self.directory)
        manifests = [_manifest.read_manifest(_manifest.manifest_path(self.directory, r), _CALLER) for r in ranks]
        manifests = [m for m in manifests if m.header is not None]
        if not manifests:
            raise StoreError(
                f"{_CALLER}: a store's directory holds a manifest.rank<r>.jsonl per rank, got none with a header in "
                f"{str(self.directory)!r}. Write one with fh.ActivationWriter or fh.collect, or check the path."
            )
        first = manifests[0]
        for m in manifests[1:]:
            for key, what in _AGREE:
                if m.header.get(key) != first.header.get(key):  # type: ignore[union-attr]
                    raise StoreError(
                        f"{_CALLER}: the ranks of a store agree on their {what}, got {m.path.name} with "
                        f"{m.header.get(key)!r} and {first.path.name} with {first.header.get(key)!r} "  # type: ignore[union-attr]
                        f"in {str(self.directory)!r}. Write every rank with one writer, or keep them in separate "
                        "directories."
                    )
        self._files: list[_Listed] = []
        for m in manifests:
            rank = int(m.header["rank"])  # type: ignore[index]
            error = _manifest.check_listed(m, rank, self.directory, _CALLER)
            if error is not None:
                raise error
            self._files += [_Listed(self.directory / line["file"], line["rows"], rank, line["shard"], line.get("crc32"),
                                    line.get("crc32s"), line.get("stats")) for line in m.shards]
        self._starts = [0]
        for listed in self._files:
            self._starts.append(self._starts[-1] + listed.rows)
        self._starts_t = torch.tensor(self._starts[:-1], dtype=torch.long)
        self.metadata: dict[str, Any] = {**first.header, "ranks": [int(m.header["rank"]) for m in manifests]}  # type: ignore[index, dict-item]
        """The header of the first rank (format, columns, specs, model, module paths, options,
        versions), plus ``"ranks"``."""
        every = [_shards.Column.from_json(c) for c in first.header["columns"]]  # type: ignore[index]
        self._every = every
        self._columns, self._single = self._select(every, columns)
        self._cache: collections.OrderedDict[int, dict[str, torch.Tensor]] = collections.OrderedDict()
        self._pid = os.getpid()

    def _select(self, every: list[_shards.Column],
                columns: str | Sequence[str] | None) -> tuple[list[_shards.Column], bool]:
        if columns is None:
            return every, False
        by_name = {c.name: c for c in every}
        wanted = [columns] if isinstance(columns, str) else list(columns)
        unknown = [w for w in wanted if w not in by_name]
        if unknown or not wanted:
            raise StoreError(
                f"{_CALLER}: `columns` names columns of the store, got {unknown or wanted!r}; the store has "
                f"{list(by_name)}. Pick some of those, or pass None for all."
            )
        return [by_name[w] for w in wanted], isinstance(columns, str)

    # -- what it holds ----------------------------------------------------------------------
    @property
    def columns(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Column name -> (dtype, shape of one row), of the columns this dataset returns."""
        return {c.name: (c.dtype, c.shape) for c in self._columns}

    @property
    def shards(self) -> int:
        """How many shard files, over every rank."""
        return len(self._files)

    def __len__(self) -> int:
        return self._starts[-1]

    def __repr__(self) -> str:
        return (f"ActivationDataset({str(self.directory)!r}, rows={len(self)}, shards={self.shards}, "
                f"columns={[c.name for c in self._columns]})")

    # -- reading ------------------------------------------------------------------------------
    def _open(self, s: int) -> dict[str, torch.Tensor]:
        """Shard `s`'s column tensors, memory-mapped, checked against the manifest once."""
        if self._pid != os.getpid():  # a forked worker maps the files itself
            self._cache, self._pid = collections.OrderedDict(), os.getpid()
        tensors = self._cache.get(s)
        if tensors is not None:
            self._cache.move_to_end(s)
            return tensors
        path, rows, rank, index, *_ = self._files[s]
        problem: str | None
        try:
            with self._safe_open(path, framework="pt") as f:
                tensors = {c.name: f.get_tensor(c.name) for c in self._columns}
                about = json.loads((f.metadata() or {}).get("funhooks", "{}"))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            tensors, problem = {}, f"unreadable ({type(e).__name__}: {e})"
        else:
            held = (about.get("rank"), about.get("shard")) if isinstance(about, dict) else (None, None)
            if held != (rank, index):
                raise StoreError(
                    f"{_CALLER}: a shard file holds the shard its manifest line lists, got {path.name} holding rank "
                    f"{held[0]} shard {held[1]} where the manifest lists rank {rank} shard {index}. Put the file back "
                    "under its name, or write the store again."
                )
            problem = None
            for c in self._columns:
                t = tensors[c.name]
                if (t.dtype, tuple(t.shape)) != (c.dtype, (rows, *c.shape)):
                    problem = f"with {c.name!r} as {t.dtype} {tuple(t.shape)}"
        if problem is not None:
            raise StoreError(
                f"{_CALLER}: a shard holds the rows its manifest line says, got {path.name} {problem} where the "
                f"manifest says {rows} rows of {[c.describe() for c in self._columns]}. Restore the file, or write "
                "the store again."
            )
        self._cache[s] = tensors
        if len(self._cache) > MAX_OPEN_SHARDS:
            self._cache.popitem(last=False)
        return tensors

    def verify(self) -> None:
        """Read every shard whole: its CRC-32, its own rank and index, and its columns' layout;
        and check each manifest line's statistics against its shard (a ``count`` equal to its
        rows, no negative sum of squares or norms).

        Opening a dataset checks each shard's size only, and a read checks a shard's rank,
        index and layout when it is first mapped; only this reads every byte, so bit rot
        inside a shard is found here. Shards of stores written before checksums are checked
        for all but the checksum.

        Raises:
            StoreError: naming the first shard that differs from its manifest line, or whose
                line's statistics cannot be its rows'.

        Example:
            >>> import tempfile, torch, funhooks as fh
            >>> from torch import nn
            >>> writer = fh.ActivationWriter(nn.Sequential(nn.Tanh()), fh.outputs("0"), tempfile.mkdtemp())
            >>> ds = fh.collect(writer, [torch.randn(4, 3)])
            >>> ds.verify()  # None: every shard is as written
        """
        for s, listed in enumerate(self._files):
            self._open(s)
            if listed.crc32s is not None:
                with open(listed.path, "rb") as f:
                    head = f.read(8)
                    size = 8 + int.from_bytes(head, "little") if len(head) == 8 else 0
                    f.seek(0)
                    regions = [(_shards.HEADER, size), *_shards.region_sizes(self._every, listed.rows)]
                    for name, size in regions:
                        self._check_crc(listed.path, _shards.crc32_of(f, size), listed.crc32s[name],
                                        " (header)" if name == _shards.HEADER else f" (column {name!r})")
            elif listed.crc32 is not None:
                with open(listed.path, "rb") as f:
                    self._check_crc(listed.path, _shards.crc32_of(f), listed.crc32, "")
            if isinstance(listed.stats, dict):
                for c in self._every:
                    if c.dtype.is_floating_point:
                        from_json(listed.stats.get(c.name), c, listed.rows, self._where(listed), _CALLER)

    def _where(self, listed: _Listed) -> str:
        return f"shard {listed.shard} of rank {listed.rank} ({listed.path.name}) in {str(self.directory)!r}"

    @staticmethod
    def _check_crc(path: pathlib.Path, crc: int, want: int, where: str) -> None:
        if crc != want:
            raise StoreError(
                f"{_CALLER}: a shard's bytes have the CRC-32 its manifest line records, got {path.name}{where} "
                f"with {crc:#010x} where the manifest says {want:#010x}. Restore the file, or write the store again."
            )

    def stats(self, *, recompute: bool = False) -> dict[str, ColumnStats]:
        """Count, mean, variance and mean norm of each floating-point column, over every row.

        The writer computed each shard's statistics when it committed the shard; they are
        merged here in store order. Shards of stores written before statistics existed are
        read now (once per call); ``recompute=True`` reads every shard, a second pass that
        gives exactly the numbers written (see ``funhooks.store.stats``).

        Raises:
            StoreError: for a shard line whose ``stats`` field is damaged or not its shard's
                (a ``count`` other than its rows, a negative ``m2`` or ``norm_sum``).

        Example:
            >>> import tempfile, torch, funhooks as fh
            >>> from torch import nn
            >>> writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tempfile.mkdtemp(),
            ...                              rows_per_shard=3)
            >>> ds = fh.collect(writer, [torch.randn(4, 8) for _ in range(5)])
            >>> s = ds.stats()["0/output"]
            >>> s.count, s.mean.shape, torch.allclose(s.var, ds[:]["0/output"].double().var(0, correction=0))
            (20, torch.Size([8]), True)
            >>> torch.equal(ds.stats(recompute=True)["0/output"].mean, s.mean)
            True
        """
        columns = [c for c in self._columns if c.dtype.is_floating_point]
        totals: dict[str, Moments] = {}
        for s, listed in enumerate(self._files):
            if recompute or not isinstance(listed.stats, dict):
                tensors = self._open(s)
                found = shard_moments(lambda name, a, b: tensors[name][a:b], columns, listed.rows)
            else:
                found = {c.name: from_json(listed.stats.get(c.name), c, listed.rows, self._where(listed),
                                           _CALLER) for c in columns}
            totals = {c.name: merge(totals[c.name], found[c.name]) if c.name in totals else found[c.name]
                      for c in columns}
        empty = Moments(0, torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), 0.0)
        return {c.name: ColumnStats.of(totals.get(c.name, empty), c.shape) for c in columns}

    @property
    def shard_rows(self) -> tuple[int, ...]:
        """Rows of each shard, in store order (rank, then shard)."""
        return tuple(listed.rows for listed in self._files)

    def _row(self, i: int) -> _Row:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{_CALLER}: an index is in range(-{n}, {n}), got {i}. Index a row of the dataset.")
        i %= n
        s = bisect.bisect_right(self._starts, i) - 1
        tensors = self._open(s)
        row = {c.name: tensors[c.name][i - self._starts[s]].clone() for c in self._columns}
        return row[self._columns[0].name] if self._single else row

    def _batch(self, indices: object) -> dict[str, torch.Tensor]:
        idx = _as_indices(indices)
        shape, idx = idx.shape, idx.reshape(-1)
        n = len(self)
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            bad = int(idx.min()) if int(idx.min()) < -n else int(idx.max())
            raise IndexError(f"{_CALLER}: an index is in range(-{n}, {n}), got {bad}. Index rows of the dataset.")
        idx = idx % max(n, 1)
        shard = torch.searchsorted(self._starts_t, idx, right=True) - 1
        out = {c.name: torch.empty((idx.numel(), *c.shape), dtype=c.dtype) for c in self._columns}
        for s in torch.unique(shard).tolist():
            where = (shard == s).nonzero().squeeze(1)
            local = idx[where] - self._starts[s]
            tensors = self._open(s)
            for name, t in out.items():  # copied as same-width ints: float8 and uint have no index_copy_
                bits = _BITS[t.element_size()]
                t.view(bits).index_copy_(0, where, tensors[name].view(bits).index_select(0, local))
        return {name: t.reshape(*shape, *t.shape[1:]) for name, t in out.items()}

    def _span(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """Rows ``start:stop`` (in range), read shard by shard as contiguous copies."""
        parts: dict[str, list[torch.Tensor]] = {c.name: [] for c in self._columns}
        s = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            tensors = self._open(s)
            end = min(stop, self._starts[s + 1])
            for name, got in parts.items():
                got.append(tensors[name][start - self._starts[s]:end - self._starts[s]])
            start, s = end, s + 1
        # joined as same-width ints: float8 and uint have no cat
        return {c.name: torch.cat([p.view(_BITS[c.dtype.itemsize]) for p in parts[c.name]]).view(c.dtype)
                if parts[c.name] else torch.empty((0, *c.shape), dtype=c.dtype) for c in self._columns}

    def __getitem__(self, index: object) -> Any:
        if isinstance(index, slice):
            begin, end, step = index.indices(len(self))
            if step == 1:
                batch = self._span(begin, max(begin, end))
                return batch[self._columns[0].name] if self._single else batch
            index = range(begin, end, step)
        if isinstance(index, int) and not isinstance(index, bool):
            return self._row(index)
        index = _as_indices(list(index) if isinstance(index, range) else index)
        if index.dim() == 0:
            return self._row(int(index))
        batch = self._batch(index)
        return batch[self._columns[0].name] if self._single else batch

    def __getitems__(self, indices: Sequence[int]) -> list[_Row]:
        """Rows `indices` in one gather per shard (a DataLoader calls this for each batch)."""
        batch = self._batch(indices)
        if self._single:
            return list(batch[self._columns[0].name].unbind(0))
        return [dict(zip(batch, row, strict=True)) for row in zip(*(t.unbind(0) for t in batch.values()), strict=True)]

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["_cache"], state["_safe_open"] = collections.OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._safe_open, self._pid = _safe_open(), os.getpid()
