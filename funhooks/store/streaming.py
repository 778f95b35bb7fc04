"""Activation datasets, streamed: a store read as an ``IterableDataset``, shuffled through a
bounded buffer, split across ranks and DataLoader workers, resumable mid-epoch.

The rows of a store are cut into *blocks* of at most :data:`BLOCK_ROWS` rows inside a shard.
Each epoch the blocks are put in a seeded order (the store's order with ``shuffle=False``),
and that sequence of rows is cut into equal parts, one per rank, as ``DistributedSampler``
does: ``ceil(rows / world_size)`` each, the last rank's part completed with the epoch's first
rows again (``drop_last=False``, the default: at most ``world_size - 1`` rows read twice),
or ``rows // world_size`` each, the last ``rows % world_size`` rows of the epoch's order left
out (``drop_last=True``). So every rank yields the same number of batches (DDP needs it: a
rank with fewer would wait for the others forever), and otherwise every row goes to exactly
one rank. A rank's part is cut into whole batches, one run of them per DataLoader worker
(the numbers of each worker's batches are the same on every rank). A consumer (a worker of
a rank) reads its pieces of blocks one after the other, each as one contiguous copy out of
the memory-mapped shard (the speed of the disk, or of the page cache); with ``shuffle=True`` the rows pass through a buffer of `buffer`
rows: when it is full it is permuted, half of it goes out, and the other half waits with the
next rows read. So the rows of many blocks, of many shards, are mixed, and memory holds the
buffer and one batch.

Everything is a function of ``(seed, epoch)``, the number of ranks and the number of
workers: iterating again gives the same rows in the same order. Resuming: ``start=k``
skips the first ``k`` items (batches, or rows without `batch_size`) that this rank's
DataLoader handed out, its workers taking turns one item each (DataLoader's order; the
resumed loader's first worker takes over the part whose turn came next). The skipped part
is replayed on row numbers alone, then the buffer is read back in one gather.

Costs: per block, one copy of its rows; with shuffling, per row about four copies inside
the buffer (join, permute, emit) and one random permutation per half buffer; a resume, the
permutations of the skipped part and one gather of the buffer.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch

from funhooks.errors import StoreError

from .dataset import ActivationDataset

__all__ = ["BLOCK_ROWS", "SHUFFLE_BUFFER_ROWS", "ActivationStream"]

BLOCK_ROWS = 8192
"""A consumer reads at most this many consecutive rows of a shard at a time."""
SHUFFLE_BUFFER_ROWS = 1 << 16
"""The default shuffle buffer, in rows."""
_CALLER = "ActivationStream"
_INDEX = "__index__"
_Chunk = dict[str, torch.Tensor]


class _Block(NamedTuple):
    start: int
    stop: int


def _seed(*parts: int) -> int:
    """A 63-bit seed mixing `parts` (the same on every machine and Python)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _check(name: str, value: object, low: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        none = " or None" if allow_none else ""
        raise StoreError(f"{_CALLER}: `{name}` is an int >= {low}{none}, got {value!r}. Pass one.")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""Rows are moved as same-width ints: float8, bool and uint have no index_select or cat everywhere."""


def _take(chunk: _Chunk, index: torch.Tensor) -> _Chunk:
    return {k: v.view(_BITS[v.element_size()]).index_select(0, index).view(v.dtype) for k, v in chunk.items()}


def _join(chunks: Sequence[_Chunk]) -> _Chunk:
    return {k: torch.cat([c[k].view(_BITS[c[k].element_size()]) for c in chunks]).view(chunks[0][k].dtype)
            for k in chunks[0]}


def _part(blocks: Sequence[_Block], lo: int, hi: int) -> list[_Block]:
    """Rows `lo`..`hi` of the epoch's sequence (the rows of `blocks` in order, from its start again
    past its end), as pieces of blocks."""
    starts = list(itertools.accumulate((b.stop - b.start for b in blocks), initial=0))
    out, at = [], lo
    while at < hi:
        q = at % starts[-1]
        i = bisect.bisect_right(starts, q) - 1
        begin = blocks[i].start + q - starts[i]
        take = min(blocks[i].stop - begin, hi - at)
        out.append(_Block(begin, begin + take))
        at += take
    return out


class _Turns(NamedTuple):
    taken: list[int]
    """How many of each worker's items are among the first `start`."""
    next: int
    """The worker whose turn comes next."""


def _turns(counts: Sequence[int], start: int) -> _Turns:
    """Where a DataLoader stands after handing out `start` items, its workers taking turns
    and a finished worker leaving the turn."""
    taken = [0] * len(counts)
    while start > 0:
        active = [w for w, n in enumerate(counts) if taken[w] < n]
        if not active:
            break
        rounds = min(min(counts[w] - taken[w] for w in active), start // len(active))
        if rounds:
            for w in active:
                taken[w] += rounds
            start -= rounds * len(active)
            continue
        for w in active[:start]:
            taken[w] += 1
        if start < len(active):
            return _Turns(taken, active[start])
        start = 0
    return _Turns(taken, next((w for w, n in enumerate(counts) if taken[w] < n), 0))


class ActivationStream(torch.utils.data.IterableDataset):
    """A store's rows as an ``IterableDataset``: shuffled through a bounded buffer, split
    without duplicates across ranks and DataLoader workers, the same number of rows and
    batches to every rank (see `drop_last`), resumable mid-epoch.

    Args:
        dataset: an :class:`~funhooks.ActivationDataset` (its `columns` choice is kept).
        batch_size: yield batches of this many rows (the last of a consumer may be
            shorter); None: yield single rows. Use ``DataLoader(stream, batch_size=None)``
            with batches, which is much faster than collating rows.
        shuffle: mix the rows (blocks in a seeded order, then the buffer); False: each
            consumer reads its blocks in store order, with one consumer exactly the store.
        buffer: rows in the shuffle buffer (memory: this many rows).
        seed, epoch: the order is a function of both; pass the epoch number for a new one.
        start: skip the first `start` items this rank's loader handed out (to resume).
        rank, world_size: this process's place; None: ``torch.distributed``'s, or 0 of 1.
        drop_last: every rank reads the same number of rows: False (as ``DistributedSampler``)
            pads the last rank's part with the epoch's first rows (at most ``world_size - 1``
            rows read twice); True leaves the epoch's last ``rows % world_size`` rows out.

    Raises:
        StoreError: for a bad argument (at construction).

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tempfile.mkdtemp(),
        ...                              rows_per_shard=10)
        >>> ds = fh.collect(writer, [torch.arange(8.0).reshape(4, 2) + 8 * i for i in range(10)])
        >>> stream = fh.ActivationStream(fh.ActivationDataset(writer.directory, columns="0/output"),
        ...                              batch_size=8, buffer=16, seed=0)
        >>> batches = list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=0))
        >>> len(batches), sorted(torch.cat(batches)[:, 0].tolist()) == list(range(0, 80, 2))
        (5, True)
        >>> resumed = fh.ActivationStream(stream.dataset, batch_size=8, buffer=16, seed=0, start=3)
        >>> all(torch.equal(a, b) for a, b in zip(batches[3:], resumed, strict=True))
        True
    """

    def __init__(self, dataset: ActivationDataset, *, batch_size: int | None = None, shuffle: bool = True,
                 buffer: int = SHUFFLE_BUFFER_ROWS, seed: int = 0, epoch: int = 0, start: int = 0,
                 rank: int | None = None, world_size: int | None = None, drop_last: bool = False) -> None:
        if not isinstance(dataset, ActivationDataset):
            raise StoreError(
                f"{_CALLER}: `dataset` is an fh.ActivationDataset, got {type(dataset).__name__}. "
                "Pass fh.ActivationDataset(directory)."
            )
        for name, value, low, none in (("batch_size", batch_size, 1, True), ("buffer", buffer, 2, False),
                                       ("seed", seed, 0, False), ("epoch", epoch, 0, False),
                                       ("start", start, 0, False), ("rank", rank, 0, True),
                                       ("world_size", world_size, 1, True)):
            _check(name, value, low, none)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise StoreError(f"{_CALLER}: `{name}` is a bool, got {flag!r}. Pass True or False.")
        dist = torch.distributed
        live = dist.is_available() and dist.is_initialized()
        world = world_size if world_size is not None else dist.get_world_size() if live else 1
        place = rank if rank is not None else dist.get_rank() if live else 0
        if place >= world:
            raise StoreError(
                f"{_CALLER}: `rank` is in range({world}), got {place}. Pass the rank of this process among `world_size`."
            )
        self.dataset, self.batch_size, self.shuffle, self.buffer = dataset, batch_size, shuffle, buffer
        self.seed, self.epoch, self.start, self.rank, self.world_size = seed, epoch, start, place, world
        self.drop_last = drop_last

    def __repr__(self) -> str:
        return (f"ActivationStream({self.dataset!r}, batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"buffer={self.buffer}, seed={self.seed}, epoch={self.epoch}, start={self.start}, "
                f"rank={self.rank}, world_size={self.world_size}, drop_last={self.drop_last})")

    # -- the plan: which blocks each consumer reads ------------------------------------------
    def _blocks(self) -> list[_Block]:
        blocks, at = [], 0
        for rows in self.dataset.shard_rows:
            blocks += [_Block(at + a, at + min(rows, a + BLOCK_ROWS)) for a in range(0, rows, BLOCK_ROWS)]
            at += rows
        if self.shuffle:
            order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(_seed(self.seed, self.epoch)))
            blocks = [blocks[i] for i in order.tolist()]
        return blocks

    @property
    def rows_per_rank(self) -> int:
        """Rows each rank reads per epoch: ``ceil(len / world_size)``, or ``len // world_size``
        with `drop_last` (0 for an empty store)."""
        total = len(self.dataset)
        return total // self.world_size if self.drop_last or not total else -(-total // self.world_size)

    def _items(self, rows: int) -> int:
        return rows if self.batch_size is None else -(-rows // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        workers, worker = (1, 0) if info is None else (info.num_workers, info.id)
        consumers = self.world_size * workers
        blocks = self._blocks()
        rows = self.rows_per_rank
        items, size, lo = self._items(rows), self.batch_size or 1, self.rank * rows
        bounds = [min(rows, w * items // workers * size) for w in range(workers)] + [rows]
        mine = [_part(blocks, lo + bounds[w], lo + bounds[w + 1]) for w in range(workers)]
        counts = [self._items(bounds[w + 1] - bounds[w]) for w in range(workers)]
        turns = _turns(counts, self.start)
        role = (turns.next + worker) % workers  # a resumed loader's first worker takes the next turn
        gen = torch.Generator().manual_seed(_seed(self.seed, self.epoch, self.rank * workers + role, consumers))
        return self._rows(mine[role], gen, turns.taken[role] * (self.batch_size or 1))

    # -- reading -----------------------------------------------------------------------------
    def _read(self, block: _Block, dry: bool) -> _Chunk:
        index = {_INDEX: torch.arange(block.start, block.stop)}
        return index if dry else {**self._gather(slice(block.start, block.stop)), **index}

    def _gather(self, index: slice | torch.Tensor) -> _Chunk:
        got = self.dataset[index]
        return got if isinstance(got, dict) else {"": got}

    def _fill(self, chunk: _Chunk) -> _Chunk:
        """A chunk read on row numbers alone, with its rows."""
        return {**self._gather(chunk[_INDEX]), **chunk} if len(chunk) == 1 else chunk

    def _mixed(self, blocks: list[_Block], gen: torch.Generator, skip: int) -> Iterator[_Chunk]:
        """Chunks of rows in the stream's order; the first `skip` rows only as row numbers."""
        dry = skip > 0
        kept: list[_Chunk] = []
        held = 0
        for block in blocks:
            if dry and skip <= 0:
                kept, dry = [self._fill(c) for c in kept], False
            kept.append(self._read(block, dry))
            held += block.stop - block.start
            if not self.shuffle:
                out, kept, held = kept[0], [], 0
                skip -= len(out[_INDEX])
                yield out
                continue
            while held >= self.buffer:
                pool = _join(kept)
                order = torch.randperm(held, generator=gen)
                half = held // 2
                out, rest = _take(pool, order[:half]), _take(pool, order[half:])
                kept, held = [rest], held - half
                skip -= half
                yield out
        if kept:
            if dry:
                kept = [self._fill(c) for c in kept]
            pool = _join(kept)
            yield _take(pool, torch.randperm(held, generator=gen)) if self.shuffle else pool

    def _rows(self, blocks: list[_Block], gen: torch.Generator, skip: int) -> Iterator[Any]:
        carry: list[_Chunk] = []
        size = self.batch_size or 1
        waiting = 0
        for chunk in self._mixed(blocks, gen, skip):
            n = len(chunk[_INDEX])
            if skip >= n:
                skip -= n
                continue
            if skip:
                chunk = _take(self._fill(chunk), torch.arange(skip, n))
                n, skip = n - skip, 0
            chunk = self._fill(chunk)
            carry.append(chunk)
            waiting += n
            if waiting < size:
                continue
            pool = _join(carry) if len(carry) > 1 else carry[0]
            cut = waiting - waiting % size
            for a in range(0, cut, size):
                yield self._item({k: v[a:a + size] for k, v in pool.items()})
            carry = [{k: v[cut:] for k, v in pool.items()}] if cut < waiting else []
            waiting -= cut
        if waiting:
            yield self._item(_join(carry))

    def _item(self, chunk: _Chunk) -> Any:
        chunk = {k: v for k, v in chunk.items() if k != _INDEX}
        if self.batch_size is None:
            chunk = {k: v[0] for k, v in chunk.items()}
        return chunk[""] if "" in chunk else chunk
