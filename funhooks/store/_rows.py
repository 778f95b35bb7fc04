"""Rows: how one batch's Record becomes the rows of an activation store's columns.

A column is ``"<Record path>/<record name>"``; its value in a batch is one tensor,
``(batch, *row)`` or, with ``flatten``, ``(batch, position, *row)`` whose two leading
dimensions merge into one row per position. A mask of the leading shape keeps the True
rows (the real tokens); floating-point columns are cast to ``dtype``, the others keep
theirs; the rows go to the CPU, contiguous.

Costs: a CPU column that needs no flattening copy, mask or cast is passed on without a
copy; otherwise one copy, made on the column's device before the move to the host, so a
GPU sends only the kept rows at the cast width (the move syncs it once per batch).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from funhooks.errors import RecordError, StoreError
from funhooks.records.node import Calls
from funhooks.records.record import Record

from . import _shards

__all__ = ["describe", "rows_of"]

_CALLER = "ActivationWriter"


def _unfit(calls: Calls, lead: int) -> str | None:
    """What is wrong with a column's calls in one batch, or None."""
    if len(calls) != 1:
        return f"{len(calls)} calls"
    if not isinstance(calls[0], torch.Tensor):
        return f"a {type(calls[0]).__name__}"
    return f"shape {tuple(calls[0].shape)}" if calls[0].dim() < lead else None


def rows_of(record: Record, columns: Sequence[tuple[str, str, str]], *, flatten: bool, dtype: torch.dtype | None,
            mask: torch.Tensor | None, batch: int) -> dict[str, torch.Tensor]:
    """The rows of one batch: column name -> ``(rows, *row)`` tensor, contiguous, on the CPU.

    Args:
        record: the batch's Record.
        columns: ``(column, Record path, record name)`` of every column.
        flatten: merge ``(batch, position)`` into rows.
        dtype: the cast of floating-point columns, or None.
        mask: a bool (or 0/1) tensor of the leading shape, or None.
        batch: the batch index, for messages.

    Raises:
        StoreError: for a column missing, not a tensor, not dense, called more than once, of
            too few dimensions; columns whose leading shapes differ; a mask of another shape.
    """
    values, lead = {}, 2 if flatten else 1
    for name, path, rec_name in columns:
        try:
            calls = record.calls(path, rec_name)
        except RecordError:
            calls = ()
        got = _unfit(calls, lead)
        if got is not None:
            raise StoreError(
                f"{_CALLER}: each column holds one {'(batch, position, ...)' if flatten else '(batch, ...)'} "
                f"tensor per batch, got {got} for {name!r} in batch {batch}. Run the steps with "
                "`specs=writer.specs`, and store a tensor (fh.observe(where, fn) can pick one from a tuple)."
            )
        if calls[0].layout != torch.strided:
            raise StoreError(
                f"{_CALLER}: columns hold dense (strided) tensors, got a {calls[0].layout} tensor for {name!r} in batch "
                f"{batch}. Store a dense one (e.g. `.to_dense()` in an fh.observe spec)."
            )
        values[name] = calls[0].detach()
    leads = {name: tuple(v.shape[:lead]) for name, v in values.items()}
    shape = next(iter(leads.values()))
    if any(s != shape for s in leads.values()):
        raise StoreError(
            f"{_CALLER}: the columns of a batch share their leading {'(batch, position)' if flatten else 'batch'} "
            f"dimensions, got {leads} in batch {batch}. Write modules with other shapes to another store."
        )
    keep = None
    if mask is not None:
        keep = torch.as_tensor(mask)
        keep = keep if keep.dtype == torch.bool else keep != 0
        if tuple(keep.shape) != shape:
            raise StoreError(
                f"{_CALLER}: a mask has the columns' leading shape {shape}, got {tuple(keep.shape)} in batch {batch}. "
                f"Pass a {'(batch, position)' if flatten else '(batch,)'} mask of the same batch."
            )
        keep = keep.reshape(-1)
    out = {}
    for name, v in values.items():
        v = v.flatten(0, 1) if flatten else v
        if keep is not None:
            v = v[keep.to(v.device)]
        cast = dtype if dtype is not None and v.is_floating_point() else v.dtype
        if not _shards.is_storable(cast):
            raise StoreError(
                f"{_CALLER}: columns hold bool, integer or floating-point tensors, got {cast} for {name!r} in batch "
                f"{batch}. Store a real tensor (e.g. `.real` or `.abs()` in an fh.observe spec)."
            )
        out[name] = v.to(device="cpu", dtype=cast).contiguous()
    return out


def describe(rows: Mapping[str, torch.Tensor]) -> list[_shards.Column]:
    """The columns of `rows`: name, dtype, shape of one row."""
    return [_shards.Column(name, t.dtype, t.shape[1:]) for name, t in rows.items()]
