"""Activation datasets, written: the activations chosen by specs, streamed to shards on disk.

:class:`ActivationWriter` is a reducer whose state is an open sink: folded over the Steps of
:func:`funhooks.evaluate` or :func:`funhooks.train` (or fed a Record per batch through
``write``), it turns each batch's stored tensors into *rows* and streams them into
safetensors shards; its result is the :class:`~funhooks.ActivationDataset` that reads them.
:func:`collect` does the same for a plain iterable of inputs through :func:`funhooks.capture`.

Rows: a column is ``"<Record path>/<record name>"`` (the module's path, or a standard
point's, e.g. ``"blocks.0.resid_post/output"``); each batch gives ``(batch, *row)``
tensors, or ``(batch, position, *row)`` merged into one row per position with
``flatten=True``, where a mask keeps the real tokens only. Floating-point columns can be
cast (``dtype=torch.bfloat16``); other columns keep their dtype.

Resuming: a batch is identified by its index (``step.iteration``). After an exception,
``KeyboardInterrupt`` or a killed process, run the same code again: the writer finds where
its committed shards end and skips the batches before that point (``collect`` skips them
without running the model), so no row is written twice or lost. Do not drop the written
batches from the steps yourself: ``fh.evaluate`` would number the rest from 0 again, and
the writer would take them for the batches it already has.

Ranks: each rank writes its own shards (rank from ``torch.distributed``, or ``rank=``); the
dataset reads every rank's shards as one.

Costs: memory holds the current batch, never a shard: rows go from the activation to their
place in the file (a CPU activation that needs no cast or mask is written without a copy;
otherwise one copy, on the device, before the move to the host, which syncs a GPU once per
batch). Disk: per shard, three ``fsync`` calls (``fsync=False`` skips them: a killed process
still loses nothing, a machine crash may). The safetensors extra (``funhooks[store]``) is
needed to write and read.
"""

from __future__ import annotations

import os
import pathlib
import platform
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch
from torch import nn

from funhooks import _frozen, _torch
from funhooks._version import __version__
from funhooks.errors import ReducerError, StoreError
from funhooks.records.record import Record
from funhooks.specs.selector import resolve
from funhooks.specs.spec import Spec
from funhooks.training.step import Step

from . import _manifest, _rows, _shards, _sink
from .dataset import ActivationDataset, require_safetensors

__all__ = ["SHARD_BYTES", "ActivationWriter", "WriterState"]

SHARD_BYTES = 1 << 27
"""With ``rows_per_shard=None``, a shard holds as many rows as fit in this many bytes (128 MiB)."""

CALLER = _sink.CALLER
_Mask = Callable[[Step], torch.Tensor]
"""``mask(step)``: the rows of a step to keep, as a bool tensor."""


def _as_specs(specs: Spec | Iterable[Spec]) -> tuple[Spec, ...]:
    out = (specs,) if isinstance(specs, Spec) else tuple(specs)
    for spec in out:
        if not isinstance(spec, Spec) or spec.is_edit or spec.gather:
            raise ReducerError(
                f"{CALLER}: `specs` store one value per module call on this rank, got {spec!r}. Pass observers "
                "such as fh.outputs(...) or fh.observe(...), without `gather=True` (each rank writes its own rows)."
            )
    if not out:
        raise ReducerError(f"{CALLER}: `specs` say what to write, got none. Pass e.g. fh.outputs('blocks.*').")
    return out


def _check_dtype(writer: ActivationWriter, attribute: attrs.Attribute[torch.dtype | None], dtype: object) -> None:
    floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point and _shards.is_storable(dtype)
    if dtype is not None and not floating:
        raise ReducerError(
            f"{CALLER}: `dtype` is a floating-point dtype to cast floating-point columns to, got {dtype!r}. "
            "Pass torch.bfloat16, torch.float16, torch.float32, or None to keep the recorded dtypes."
        )


def _check_rows(writer: ActivationWriter, attribute: attrs.Attribute[int | None], rows: object) -> None:
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        raise ReducerError(
            f"{CALLER}: `rows_per_shard` is a positive int or None, got {rows!r}. "
            f"Pass e.g. 65536, or None for shards of about {SHARD_BYTES >> 20} MiB."
        )


def _check_rank(writer: ActivationWriter, attribute: attrs.Attribute[int | None], rank: object) -> None:
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
        raise ReducerError(
            f"{CALLER}: `rank` is a non-negative int or None, got {rank!r}. "
            "Pass None to take torch.distributed's rank (0 without a process group)."
        )


def _check_mask(writer: ActivationWriter, attribute: attrs.Attribute[_Mask | None], mask: object) -> None:
    if mask is not None and not callable(mask):
        raise ReducerError(
            f"{CALLER}: `mask` is a function of a Step or None, got {type(mask).__name__}. Pass e.g. "
            "`mask=lambda step: step.record['embed']['ids'] != PAD`, or give `fh.collect(..., mask=)` a batch key."
        )


@_frozen.frozen
@attrs.frozen(eq=False)
class WriterState:
    """Where an :class:`ActivationWriter` stands: the next batch index it expects, the
    rows of that batch already written (after a restart), and its open rank of the store.

    A state is used once: pass the one ``step`` / ``write`` returned to the next call.

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2))
        >>> writer = fh.ActivationWriter(model, fh.outputs("0"), tempfile.mkdtemp(), rows_per_shard=4)
        >>> state = writer.init()
        >>> state.next_batch, state.rows
        (0, 0)
        >>> with fh.with_hooks(model, writer.specs) as run:
        ...     _ = model(torch.ones(3, 2))
        >>> state = writer.write(state, 0, run.record)
        >>> state.next_batch, state.rows
        (1, 3)
    """

    sink: _sink.Sink = attrs.field(repr=False)
    version: int = attrs.field(repr=False)
    next_batch: int
    skip_rows: int = 0

    @property
    def rows(self) -> int:
        """Rows written by this rank so far, in committed shards and the current one."""
        return self.sink.written


def _header_mismatch(header: _shards.JsonObject, ours: _shards.JsonObject, directory: pathlib.Path) -> str | None:
    for key, what in (("specs", "specs"), ("model", "model class"), ("flatten", "`flatten`"), ("dtype", "`dtype`")):
        if header.get(key) != ours[key]:
            return (
                f"{CALLER}: a store is continued with the {what} that started it, got {ours[key]!r} for "
                f"{str(directory)!r}, written with {header.get(key)!r}. Pass those, or write to a new directory."
            )
    if ours["rows_per_shard"] is not None and header.get("rows_per_shard") != ours["rows_per_shard"]:
        return (
            f"{CALLER}: a store is continued with the `rows_per_shard` that started it, got {ours['rows_per_shard']!r} "
            f"for {str(directory)!r}, written with {header.get('rows_per_shard')!r}. Pass that, or None."
        )
    return None


def _as_path(directory: str | os.PathLike[str]) -> pathlib.Path:
    return pathlib.Path(os.fspath(directory))


@_frozen.frozen
@attrs.frozen
class ActivationWriter:
    """A reducer that streams the activations its specs store into a directory of shards.

    Args:
        model: the model the specs run on (its class and the selected module paths go into
            the store's metadata; selectors are resolved now).
        specs: a Spec or Specs whose stored values become columns, one per selected module,
            named ``"<Record path>/<record name>"`` as the Record keys them (the module's
            path, or a standard point's: ``"blocks.0.resid_post/output"``); each stores one
            tensor per batch.
        directory: where the store lives (created if needed; a store there is continued).
        dtype: cast floating-point columns to this dtype (e.g. ``torch.bfloat16``); None: as recorded.
        flatten: rows are positions: ``(batch, position, ...)`` values become
            ``(batch * position, ...)`` rows.
        mask: ``mask(step) -> bool tensor`` of shape ``(batch,)`` (``(batch, position)`` with
            `flatten`) keeping the True rows, e.g. real tokens; None keeps all.
        rows_per_shard: rows per shard file; None: as many as fit in :data:`SHARD_BYTES`.
        rank: this process's rank; None: ``torch.distributed``'s, or 0.
        fsync: make each shard durable before it is listed (a machine crash loses nothing
            committed); False is faster and still safe against killed processes.

    Result: the :class:`~funhooks.ActivationDataset` of `directory`, after the last, shorter
    shard is committed.

    Raises:
        ReducerError: for bad arguments. SelectorError: for a selector matching no module.
        StoreError: when `directory` is a file, holds a store of other specs or options or a
            damaged manifest (at ``init``), a batch's columns change shape or dtype or are not
            dense, a listed shard is missing, or a write fails.
        ExtraError: without safetensors (``funhooks[store]``).

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> batches = [torch.randn(16, 4) for _ in range(5)]
        >>> writer = fh.ActivationWriter(model, fh.outputs("1"), tempfile.mkdtemp(), rows_per_shard=32)
        >>> ds = fh.fold(writer, fh.evaluate(model, batches, specs=writer.specs))
        >>> len(ds), ds.shards, ds.columns
        (80, 3, {'1/output': (torch.float32, (8,))})
        >>> torch.equal(ds[17]["1/output"], model[:2](batches[1])[1].detach())  # batch 1, row 1
        True
    """

    model: nn.Module = attrs.field(repr=lambda m: type(m).__name__)
    specs: tuple[Spec, ...] = attrs.field(converter=_as_specs)
    directory: pathlib.Path = attrs.field(converter=_as_path)
    dtype: torch.dtype | None = attrs.field(default=None, kw_only=True, validator=_check_dtype)
    flatten: bool = attrs.field(default=False, kw_only=True, validator=attrs.validators.instance_of(bool))
    mask: _Mask | None = attrs.field(default=None, kw_only=True, validator=_check_mask)
    rows_per_shard: int | None = attrs.field(default=None, kw_only=True, validator=_check_rows)
    rank: int | None = attrs.field(default=None, kw_only=True, validator=_check_rank)
    fsync: bool = attrs.field(default=True, kw_only=True, validator=attrs.validators.instance_of(bool))
    columns: tuple[tuple[str, str, str], ...] = attrs.field(init=False, repr=False)
    """``(column, Record path, record name)`` of every column, in module order: the Record
    path is the module's path, or a standard point's own (``blocks.0.resid_post``)."""

    def __attrs_post_init__(self) -> None:
        found = []
        for i, spec in enumerate(self.specs):
            labels = dict(spec.labels)  # a standard point's Record path, by module path: the Record's key
            for path, _ in resolve(spec.where, self.model, caller=CALLER, spec=spec):
                key = labels.get(path, path)
                found.append((path, i, (f"{key}/{spec.name}", key, str(spec.name))))
        order = {p: i for i, (p, _) in enumerate(_torch.named_modules(self.model))}
        object.__setattr__(self, "columns", tuple(c for _, _, c in sorted(found, key=lambda f: (order[f[0]], f[1]))))

    # -- the reducer protocol ----------------------------------------------------------------
    def init(self) -> WriterState:
        """Open (or continue) this rank of the store; the state says where writing resumes."""
        versions = require_safetensors(CALLER).__version__
        sink = _sink.Sink(self.directory, self._rank(), fsync=self.fsync)
        try:
            others = [_manifest.read_manifest(_manifest.manifest_path(self.directory, r), CALLER).header
                      for r in _manifest.ranks_in(self.directory) if r != sink.rank]
            for header in [sink.header, *others]:
                ours = self._header(versions, sink.rank, [], False)
                problem = header and _header_mismatch(header, ours, self.directory)
                if problem:
                    raise StoreError(problem)
        except BaseException:
            sink.close()
            raise
        return WriterState(sink, sink.version, sink.end[0], sink.end[1])

    def step(self, state: WriterState, step: Step) -> WriterState:
        """Write the rows of one Step, the batch ``step.iteration``."""
        if step.iteration < state.next_batch:
            return self.write(state, step.iteration, step.record)
        return self.write(state, step.iteration, step.record, mask=None if self.mask is None else self.mask(step))

    def records(self, iteration: int, training: bool) -> bool:
        """Every step is written."""
        return True

    def result(self, state: WriterState) -> ActivationDataset:
        """Commit the last, shorter shard; the dataset of the whole store."""
        self._live(state).flush(state.next_batch)
        return ActivationDataset(self.directory)

    # -- the sink primitive ------------------------------------------------------------------
    def write(self, state: WriterState, batch: int, record: Record, *, mask: torch.Tensor | None = None) -> WriterState:
        """Write the rows of `record`, batch number `batch`, and return the next state.

        Batches come in order from 0; one before ``state.next_batch`` was written before a
        restart and is skipped. `mask` is as for ``mask(step)``.

        Example:
            >>> import tempfile, torch, funhooks as fh
            >>> from torch import nn
            >>> model = nn.Sequential(nn.Embedding(10, 4))
            >>> writer = fh.ActivationWriter(model, fh.outputs("0"), tempfile.mkdtemp(), flatten=True)
            >>> state = writer.init()
            >>> with fh.with_hooks(model, writer.specs) as run:
            ...     for i, ids in enumerate([torch.tensor([[1, 2, 0]]), torch.tensor([[3, 0, 0]])]):
            ...         _ = model(ids)
            ...         state = writer.write(state, i, run.take(), mask=ids != 0)
            >>> ds = writer.result(state)
            >>> len(ds), torch.equal(ds[2]["0/output"], model[0].weight[3])
            (3, True)
        """
        sink = self._live(state)
        if batch < state.next_batch:
            return state
        if batch > state.next_batch:
            raise StoreError(
                f"{CALLER}: batches come in order, each once, got batch {batch} where batch {state.next_batch} was "
                f"next in {str(self.directory)!r}. Feed every batch (a restart feeds them all from the first; the "
                "written ones are skipped), or fh.collect the inputs."
            )
        rows = _rows.rows_of(record, self.columns, flatten=self.flatten, dtype=self.dtype, mask=mask, batch=batch)
        if state.skip_rows:
            n = next(iter(rows.values())).shape[0]
            if n < state.skip_rows:
                raise StoreError(
                    f"{CALLER}: a restarted batch gives the rows it gave before, got {n} rows in batch {batch} of "
                    f"which {state.skip_rows} were written before the restart. Feed the same inputs, or write to a "
                    "new directory."
                )
            rows = {k: v[state.skip_rows:] for k, v in rows.items()}
        columns = _rows.describe(rows)
        if sink.header is None:
            header = self._header(require_safetensors(CALLER).__version__, sink.rank, columns, mask is not None)
            sink._io("creating the manifest for", sink.start, header, columns)
        else:
            self._check_columns(sink, columns, batch)
        sink.append(rows, batch, state.skip_rows)
        return WriterState(sink, sink.version, batch + 1, 0)

    # -- helpers --------------------------------------------------------------------------------
    def _rank(self) -> int:
        if self.rank is not None:
            return int(self.rank)
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _live(self, state: WriterState) -> _sink.Sink:
        sink = state.sink
        if sink.closed or sink.failed is not None or state.version != sink.version:
            why = ("a later `init()` reopened its rank" if sink.closed else
                   "a write failed" if sink.failed is not None else "it was used already")
            raise StoreError(
                f"{CALLER}: a state is used once, each step taking the one the last returned, got a state that "
                f"is stale ({why}). Start again from `writer.init()`: committed shards are kept."
            )
        return sink

    def _header(self, versions: str, rank: int, columns: Sequence[_shards.Column], masked: bool) -> dict[str, object]:
        model = _torch.unwrap(self.model)
        return {
            "format": _manifest.FORMAT, "version": _manifest.FORMAT_VERSION, "rank": rank,
            "columns": [c.to_json() for c in columns],
            "specs": [repr(s) for s in self.specs],
            "model": f"{type(model).__module__}.{type(model).__qualname__}",
            "modules": list(dict.fromkeys(path for _, path, _ in self.columns)),
            "flatten": self.flatten, "masked": masked,
            "dtype": None if self.dtype is None else _shards.dtype_name(self.dtype),
            "rows_per_shard": self.rows_per_shard if not columns else self._capacity(columns),
            "versions": {"funhooks": __version__, "torch": torch.__version__, "safetensors": versions,
                         "python": platform.python_version()},
        }

    def _capacity(self, columns: Sequence[_shards.Column]) -> int:
        if self.rows_per_shard is not None:
            return self.rows_per_shard
        return max(1, SHARD_BYTES // max(1, sum(c.row_bytes for c in columns)))

    def _check_columns(self, sink: _sink.Sink, columns: Sequence[_shards.Column], batch: int) -> None:
        for ours, got in zip(sink.columns or (), columns, strict=False):
            if ours != got:
                raise StoreError(
                    f"{CALLER}: every batch gives column {ours.name!r} {ours.describe()}, got {got.describe()} in "
                    f"batch {batch}. Give every batch one shape (with flatten=True a row is one position, and a mask "
                    "drops padding) and one dtype, or write to a new directory."
                )
