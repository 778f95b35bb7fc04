"""Column statistics of an activation store: count, mean, variance and mean row norm of
every floating-point column, computed while the store is written.

Each shard's statistics are computed while it is written, from the rows going into it
(exactly the bytes the file gets), in chunks of :data:`STATS_CHUNK_ROWS` rows from its
first row (float32 sums within a chunk, ``float64`` merges between chunks and shards,
Chan's pairwise update), and written on its manifest line when it is committed. :meth:`ActivationDataset.stats <funhooks.ActivationDataset.stats>` merges
the lines in store order; ``stats(recompute=True)`` reads every shard again and runs the
same computation, so a second pass gives exactly the numbers written (and both agree with
a ``float64`` reference over all rows to about 1e-6 relative).

Normalisation for SAE training: :meth:`ColumnStats.norm_scale` is the factor that gives the
rows a chosen mean L2 norm; SAELens scales the residual stream to a mean norm of
``sqrt(d)``: ``x * stats.norm_scale(math.sqrt(d))``. Standardising (``(x - mean) / std``)
uses ``mean`` and ``std``.

Costs: nothing is read back. Per written row, about three passes of float32 arithmetic
over its floating-point columns; rows of a chunk that come in several batches are first
copied into one chunk buffer per column (at most ``STATS_CHUNK_ROWS`` rows each, kept by
the writer), chunks that lie inside one batch are used in place. The arithmetic works in
one reused buffer of ``STATS_CHUNK_ROWS`` rows of the widest column (float32, or float64
for float64 columns): it allocates nothing the size of a chunk. Per shard line, two
numbers per element of a row (JSON, exact ``float64`` round trips).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import attrs
import torch

from funhooks import _frozen
from funhooks.errors import StoreError

from ._shards import Column

__all__ = ["STATS_CHUNK_ROWS", "ColumnStats", "Moments", "merge", "Buffers", "shard_moments", "Accumulator", "to_json",
           "from_json"]

STATS_CHUNK_ROWS = 1024
"""Rows per chunk of the statistics pass (float32 sums inside a chunk, float64 between chunks)."""


class Moments(NamedTuple):
    """Mergeable sums of one column over some rows: their number, mean, sum of squared deviations
    from the mean (``m2``, both float64 and flat) and the sum of the rows' L2 norms."""

    rows: int
    mean: torch.Tensor
    m2: torch.Tensor
    norm_sum: float


def merge(a: Moments, b: Moments) -> Moments:
    """The moments of `a`'s rows followed by `b`'s (Chan et al.'s pairwise update)."""
    if not a.rows:
        return b
    if not b.rows:
        return a
    n = a.rows + b.rows
    delta = b.mean - a.mean
    mean = a.mean + delta * (b.rows / n)
    m2 = a.m2 + b.m2 + delta * delta * (a.rows * b.rows / n)
    return Moments(n, mean, m2, a.norm_sum + b.norm_sum)


class Buffers:
    """The memory the statistics pass reuses from chunk to chunk and shard to shard (kept by
    the writer for its whole run): per column, a chunk's rows that came in several batches;
    per computation dtype, one chunk's working copy (``STATS_CHUNK_ROWS`` rows of the widest
    column), so that no chunk-sized temporary is allocated per chunk."""

    def __init__(self) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        self._work: dict[torch.dtype, torch.Tensor] = {}

    def work(self, dtype: torch.dtype, rows: int, width: int) -> torch.Tensor:
        """A ``(rows, width)`` buffer of `dtype` to overwrite (``rows <= STATS_CHUNK_ROWS``)."""
        buf = self._work.get(dtype)
        if buf is None or buf.numel() < STATS_CHUNK_ROWS * width:
            buf = self._work[dtype] = torch.empty(STATS_CHUNK_ROWS * width, dtype=dtype)
        return buf[:rows * width].view(rows, width)


def _chunk(x: torch.Tensor, buffers: Buffers) -> Moments:
    n = x.shape[0]
    x = x.reshape(n, -1)
    work = buffers.work(torch.float64 if x.dtype == torch.float64 else torch.float32, n, x.shape[1])
    if x.dtype != work.dtype:
        x = work.copy_(x)
    mean = x.sum(0) / n
    norm = torch.linalg.vector_norm(x, dim=1).sum()
    m2 = torch.sub(x, mean, out=work).square_().sum(0)
    return Moments(n, mean.double(), m2.double(), float(norm))


def shard_moments(read: Callable[[str, int, int], torch.Tensor], columns: Sequence[Column],
                  rows: int) -> dict[str, Moments]:
    """The moments of every floating-point column of one shard of `rows` rows;
    ``read(name, start, stop)`` gives rows ``start:stop`` of a column."""
    out, buffers = {}, Buffers()
    for c in columns:
        if not c.dtype.is_floating_point:
            continue
        width = math.prod(c.shape)
        total = Moments(0, torch.zeros(width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64), 0.0)
        for start in range(0, rows, STATS_CHUNK_ROWS):
            total = merge(total, _chunk(read(c.name, start, min(rows, start + STATS_CHUNK_ROWS)), buffers))
        out[c.name] = total
    return out


class Accumulator:
    """The moments of the floating-point columns of one shard, fed its rows as they are written.

    Rows are cut into the chunks :func:`shard_moments` reads (``STATS_CHUNK_ROWS`` rows from
    the shard's first row), so the result is bit-equal to that pass over the finished file.
    A chunk inside one batch is used in place; a chunk's rows that come in several batches
    are gathered in ``buffers.rows`` (one ``STATS_CHUNK_ROWS``-row tensor per column, made on
    first use and kept in the `buffers` given, so that the next shard reuses them).
    """

    def __init__(self, columns: Sequence[Column], buffers: Buffers) -> None:
        self.columns = [c for c in columns if c.dtype.is_floating_point]
        self._reuse, self._chunks, self._held = buffers, buffers.rows, 0
        self.totals = {c.name: Moments(0, torch.zeros(math.prod(c.shape), dtype=torch.float64),
                                       torch.zeros(math.prod(c.shape), dtype=torch.float64), 0.0)
                       for c in self.columns}

    def _add(self, name: str, x: torch.Tensor) -> None:
        self.totals[name] = merge(self.totals[name], _chunk(x, self._reuse))

    def add(self, rows: Mapping[str, torch.Tensor]) -> None:
        """The next rows of the shard (same length in every column)."""
        if not self.columns:
            return
        n = rows[self.columns[0].name].shape[0]
        for c in self.columns:
            x, held, at = rows[c.name], self._held, 0
            if held:
                chunk = self._chunks[c.name]
                at = min(n, STATS_CHUNK_ROWS - held)
                chunk[held:held + at].copy_(x[:at])
                if held + at == STATS_CHUNK_ROWS:
                    self._add(c.name, chunk)
            while n - at >= STATS_CHUNK_ROWS:
                self._add(c.name, x[at:at + STATS_CHUNK_ROWS])
                at += STATS_CHUNK_ROWS
            if at < n:
                if c.name not in self._chunks:
                    self._chunks[c.name] = torch.empty((STATS_CHUNK_ROWS, *c.shape), dtype=c.dtype)
                self._chunks[c.name][:n - at].copy_(x[at:])
        self._held = (self._held + n) % STATS_CHUNK_ROWS

    def moments(self) -> dict[str, Moments]:
        """The moments of every row added (the last, partial chunk included)."""
        if self._held:
            for c in self.columns:
                self._add(c.name, self._chunks[c.name][:self._held])
            self._held = 0
        return self.totals


def to_json(moments: Mapping[str, Moments]) -> dict[str, object]:
    return {name: {"count": m.rows, "mean": m.mean.tolist(), "m2": m.m2.tolist(), "norm_sum": m.norm_sum}
            for name, m in moments.items()}


def from_json(obj: object, column: Column, rows: int, where: str, caller: str) -> Moments:
    """One column's moments from the manifest line of a shard of `rows` rows; a StoreError for a
    field that does not fit: the shape of each, a ``count`` other than `rows`, a negative ``m2``
    or ``norm_sum`` (sums of squares and of norms; NaN, from NaN rows, passes)."""
    width = math.prod(column.shape)
    fields = obj if isinstance(obj, Mapping) else {}
    ok = (isinstance(fields.get("count"), int) and not isinstance(fields["count"], bool)
          and all(isinstance(fields.get(k), list) and len(fields[k]) == width for k in ("mean", "m2"))
          and isinstance(fields.get("norm_sum"), (int, float)) and not isinstance(fields["norm_sum"], bool))
    try:
        mean = torch.tensor(fields["mean"], dtype=torch.float64) if ok else None
        m2 = torch.tensor(fields["m2"], dtype=torch.float64) if ok else None
    except (TypeError, ValueError, RuntimeError):
        mean = m2 = None
    fix = "Restore the manifest, or read the statistics again with `ds.stats(recompute=True)`."
    if mean is None or m2 is None:
        raise StoreError(
            f"{caller}: a shard line's `stats` give {column.name!r} a `count` and `mean`, `m2` lists of {width} "
            f"numbers and a `norm_sum`, got {obj!r:.80} in {where}. {fix}"
        )
    problem = (f"`count` {fields['count']!r} where the shard holds {rows} rows" if fields["count"] != rows else
               f"a negative `m2` ({float(m2.min())!r})" if bool((m2 < 0).any()) else
               f"a negative `norm_sum` ({fields['norm_sum']!r})" if fields["norm_sum"] < 0 else None)
    if problem is not None:
        raise StoreError(
            f"{caller}: a shard line's `stats` for {column.name!r} are those of the shard's rows (a `count` equal to "
            f"its rows, sums of squares and norms >= 0), got {problem} in {where}. {fix}"
        )
    return Moments(rows, mean.reshape(-1), m2.reshape(-1), float(fields["norm_sum"]))


def _shape(dims: Iterable[int]) -> tuple[int, ...]:
    return tuple(dims)


@_frozen.frozen
@attrs.frozen(eq=False)
class ColumnStats:
    """The statistics of one floating-point column over every row of a store.

    Attributes:
        count: rows.
        mean: per element of a row, float64, the row's shape.
        var: population variance (divided by `count`) per element, float64.
        mean_norm: the mean over rows of each row's L2 norm (the row flattened).

    A store without rows has NaN statistics, as ``torch.mean`` of nothing.

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tempfile.mkdtemp())
        >>> ds = fh.collect(writer, [torch.tensor([[3.0, 4.0], [0.0, 0.0]])])
        >>> s = ds.stats()["0/output"]
        >>> s.count, s.mean.tolist(), s.var.tolist(), s.mean_norm
        (2, [1.5, 2.0], [2.25, 4.0], 2.5)
        >>> s.norm_scale()  # x * 0.4 has a mean norm of 1
        0.4
    """

    count: int
    mean: torch.Tensor
    var: torch.Tensor
    mean_norm: float
    shape: tuple[int, ...] = attrs.field(converter=_shape, repr=False)

    @classmethod
    def of(cls, moments: Moments, shape: Sequence[int]) -> ColumnStats:
        if not moments.rows:
            nan = torch.full(tuple(shape), math.nan, dtype=torch.float64)
            return cls(0, nan, nan.clone(), math.nan, shape)
        n = moments.rows
        return cls(moments.rows, moments.mean.reshape(shape), (moments.m2 / n).reshape(shape),
                   moments.norm_sum / n, shape)

    @property
    def std(self) -> torch.Tensor:
        """Population standard deviation per element, float64."""
        return self.var.sqrt()

    def norm_scale(self, target: float = 1.0) -> float:
        """The factor that scales the rows to a mean L2 norm of `target`.

        SAELens's normalisation of a ``d``-wide residual stream is ``norm_scale(math.sqrt(d))``.
        """
        return target / self.mean_norm if self.mean_norm else 1.0
