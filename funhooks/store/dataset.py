"""Activation datasets, read: every rank's shards of a store as one memory-mapped Dataset.

:class:`ActivationDataset` reads the manifests (see ``_shards.py``) and nothing else: only
committed shards are part of it, in rank order, then shard order, then row order. Shards
are opened lazily with ``safetensors.safe_open``, whose tensors map the file instead of
reading it, and at most ``MAX_OPEN_SHARDS`` are kept open (per process: a DataLoader
worker opens its own). Rows come back as copies, never as views of a mapping, and exactly
as recorded (after the writer's cast).

Costs: opening the dataset reads the manifests and ``stat``s every shard (no data). One row
(``ds[i]``) costs a bisection and one small copy per column; a batch (``ds[indices]``, or a
DataLoader through ``__getitems__``) one gather per shard it touches. Pages of the files
are read by the kernel on first touch and stay in the page cache, not in this process.
"""

from __future__ import annotations

import bisect
import collections
import importlib.util
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from funhooks.errors import ExtraError, StoreError

from . import _manifest, _shards

__all__ = ["MAX_OPEN_SHARDS", "ActivationDataset"]

MAX_OPEN_SHARDS = 64
"""Shards kept mapped at once per process; the least recently used one is closed first."""

CALLER = "ActivationDataset"
_AGREE = (("columns", "columns"), ("specs", "specs"), ("flatten", "`flatten`"), ("dtype", "`dtype`"))


def require_safetensors(caller: str) -> Any:
    """The safetensors module, or an ExtraError naming the ``store`` extra."""
    if importlib.util.find_spec("safetensors") is None:
        raise ExtraError(
            f"{caller}: activation stores are safetensors files, got safetensors not installed. "
            "Install the extra: pip install 'funhooks[store]'."
        )
    import safetensors

    return safetensors


def _safe_open() -> Any:
    require_safetensors(CALLER)
    from safetensors import safe_open

    return safe_open


class ActivationDataset(torch.utils.data.Dataset):
    """The rows an :class:`~funhooks.ActivationWriter` committed, as a random-access Dataset.

    Args:
        directory: the store's directory (every rank's shards are read, as one dataset).
        columns: None: every row is a dict of all columns; a column name: every row is that
            tensor; a list of names: dicts of those.

    ``ds[i]`` is one row; ``ds[indices]`` (a list, tensor or slice) stacks rows into a batch
    in one gather per shard. It works with a ``DataLoader``, with workers too.

    Raises:
        StoreError: for a directory without a store, of another format version, whose ranks
            disagree, with a listed shard missing or replaced, or an unknown column.
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
        manifests = [_manifest.read_manifest(_manifest.manifest_path(self.directory, r), CALLER) for r in ranks]
        manifests = [m for m in manifests if m.header is not None]
        if not manifests:
            raise StoreError(
                f"{CALLER}: a store's directory holds a manifest.rank<r>.jsonl per rank, got none with a header in "
                f"{str(self.directory)!r}. Write one with fh.ActivationWriter or fh.collect, or check the path."
            )
        first = manifests[0]
        for m in manifests[1:]:
            for key, what in _AGREE:
                if m.header.get(key) != first.header.get(key):  # type: ignore[union-attr]
                    raise StoreError(
                        f"{CALLER}: the ranks of a store agree on their {what}, got {m.path.name} with "
                        f"{m.header.get(key)!r} and {first.path.name} with {first.header.get(key)!r} "  # type: ignore[union-attr]
                        f"in {str(self.directory)!r}. Write every rank with one writer, or keep them in separate "
                        "directories."
                    )
        self._files: list[tuple[pathlib.Path, int]] = []
        for m in manifests:
            error = _manifest.check_listed(m, int(m.header["rank"]), self.directory, CALLER)  # type: ignore[index]
            if error is not None:
                raise error
            self._files += [(self.directory / line["file"], int(line["rows"])) for line in m.shards]
        self._starts = [0]
        for _, rows in self._files:
            self._starts.append(self._starts[-1] + rows)
        self._starts_t = torch.tensor(self._starts[:-1], dtype=torch.long)
        self.metadata: dict[str, Any] = {**first.header, "ranks": [int(m.header["rank"]) for m in manifests]}  # type: ignore[index, dict-item]
        """The header of the first rank (format, columns, specs, model, module paths, options,
        versions), plus ``"ranks"``."""
        every = [_shards.Column.from_json(c) for c in first.header["columns"]]  # type: ignore[index]
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
                f"{CALLER}: `columns` names columns of the store, got {unknown or wanted!r}; the store has "
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
        path, rows = self._files[s]
        problem: str | None
        try:
            with self._safe_open(path, framework="pt") as f:
                tensors = {c.name: f.get_tensor(c.name) for c in self._columns}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            tensors, problem = {}, f"unreadable ({type(e).__name__}: {e})"
        else:
            problem = None
            for c in self._columns:
                t = tensors[c.name]
                if (t.dtype, tuple(t.shape)) != (c.dtype, (rows, *c.shape)):
                    problem = f"with {c.name!r} as {t.dtype} {tuple(t.shape)}"
        if problem is not None:
            raise StoreError(
                f"{CALLER}: a shard holds the rows its manifest line says, got {path.name} {problem} where the "
                f"manifest says {rows} rows of {[c.describe() for c in self._columns]}. Restore the file, or write "
                "the store again."
            )
        self._cache[s] = tensors
        if len(self._cache) > MAX_OPEN_SHARDS:
            self._cache.popitem(last=False)
        return tensors

    def _row(self, i: int) -> Any:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{CALLER}: an index is in range(-{n}, {n}), got {i}. Index a row of the dataset.")
        i %= n
        s = bisect.bisect_right(self._starts, i) - 1
        tensors = self._open(s)
        row = {c.name: tensors[c.name][i - self._starts[s]].clone() for c in self._columns}
        return row[self._columns[0].name] if self._single else row

    def _batch(self, indices: Any) -> dict[str, torch.Tensor]:
        idx = torch.as_tensor(indices, dtype=torch.long)
        shape, idx = idx.shape, idx.reshape(-1)
        n = len(self)
        if idx.numel() and (int(idx.min()) < -n or int(idx.max()) >= n):
            bad = int(idx.min()) if int(idx.min()) < -n else int(idx.max())
            raise IndexError(f"{CALLER}: an index is in range(-{n}, {n}), got {bad}. Index rows of the dataset.")
        idx = idx % max(n, 1)
        shard = torch.searchsorted(self._starts_t, idx, right=True) - 1
        out = {c.name: torch.empty((idx.numel(), *c.shape), dtype=c.dtype) for c in self._columns}
        for s in torch.unique(shard).tolist():
            where = (shard == s).nonzero().squeeze(1)
            local = idx[where] - self._starts[s]
            tensors = self._open(s)
            for name, t in out.items():
                t.index_copy_(0, where, tensors[name].index_select(0, local))
        return {name: t.reshape(*shape, *t.shape[1:]) for name, t in out.items()}

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            index = range(*index.indices(len(self)))
        if isinstance(index, int) or (isinstance(index, torch.Tensor) and index.dim() == 0):
            return self._row(int(index))
        batch = self._batch(list(index) if isinstance(index, range) else index)
        return batch[self._columns[0].name] if self._single else batch

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """Rows `indices` in one gather per shard (a DataLoader calls this for each batch)."""
        batch = self._batch(indices)
        if self._single:
            return list(batch[self._columns[0].name].unbind(0))
        return [dict(zip(batch, row, strict=True)) for row in zip(*(t.unbind(0) for t in batch.values()), strict=True)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_cache"], state["_safe_open"] = collections.OrderedDict(), None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._safe_open, self._pid = _safe_open(), os.getpid()
