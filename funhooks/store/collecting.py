"""collect: a plain iterable of inputs through ``capture``, into an activation store.

For data that is not a training loop: each batch goes through :func:`funhooks.capture`
(``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else
``model(batch)``) in eval mode without gradients, and its Record to
:meth:`ActivationWriter.write <funhooks.ActivationWriter.write>`. On a restart the batches
already committed are skipped without running the model (an indexable `inputs` is not
even read for them).

Costs: those of ``capture`` (the hooked modules wrapped for each call) and of the
writer; nothing is kept between batches.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, TypeAlias, TypeVar

import torch

from funhooks._modes import in_mode
from funhooks.errors import LoopError
from funhooks.runs.pure import capture
from funhooks.training import progress as _progress

from .dataset import ActivationDataset
from .writer import ActivationWriter

__all__ = ["collect"]

_R = TypeVar("_R")

Batch: TypeAlias = Any
"""One of the user's batches: a dict, a tuple or list, or one value, as the model takes it."""
Mask = Callable[[Batch], torch.Tensor]
"""``mask(batch)``: the rows of a batch to keep, as a bool tensor."""


def _call(fn: Callable[..., _R], batch: Batch) -> _R:
    if isinstance(batch, Mapping):
        return fn(**batch)
    if isinstance(batch, (tuple, list)):
        return fn(*batch)
    return fn(batch)


def _mask_of(mask: str | Mask | None, batch: Batch, index: int) -> torch.Tensor | None:
    if mask is None or callable(mask):
        return None if mask is None else mask(batch)
    if isinstance(batch, Mapping) and mask in batch:
        return batch[mask]
    keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
    raise LoopError(
        f"collect: `mask={mask!r}` names a key of every batch, got batch {index} with keys {keys}. "
        "Yield dicts holding it (e.g. a tokenizer's `attention_mask`), or pass `mask=lambda batch: ...`."
    )


def _remaining(inputs: Iterable[Batch], start: int) -> Iterator[tuple[int, Batch]]:
    if isinstance(inputs, Sequence):  # indexable: the written batches are not even loaded
        return ((i, inputs[i]) for i in range(start, len(inputs)))
    return itertools.islice(enumerate(inputs), start, None)


def collect(writer: ActivationWriter, inputs: Iterable[Batch], *, mask: str | Mask | None = None,
            progress: bool | None = None) -> ActivationDataset:
    """Run ``writer.model`` over `inputs` through :func:`funhooks.capture` and write the activations.

    The model runs in eval mode (restored afterwards) under ``torch.no_grad()``. A batch is
    called as ``model(**batch)`` for a dict, ``model(*batch)`` for a tuple or list, else
    ``model(batch)``. Batches a previous, interrupted run committed are skipped without
    running the model.

    Args:
        writer: the :class:`ActivationWriter` (its ``mask`` reads Steps; give `mask` here).
        inputs: an iterable of batches, in the same order on every run.
        mask: a key of each dict batch (e.g. ``"attention_mask"``) or ``mask(batch)``,
            giving the rows to keep; None keeps all.
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        The :class:`~funhooks.ActivationDataset` of ``writer.directory``.

    Raises:
        LoopError: for a `mask` key missing from a batch, or a writer with its own `mask`.
        StoreError: as for :class:`ActivationWriter`.

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8))
        >>> batches = [{"input": torch.randint(1, 50, (4, 6))} for _ in range(3)]
        >>> for b in batches:
        ...     b["input"][:, 4:] = 0  # two padding positions per sequence
        >>> writer = fh.ActivationWriter(model, fh.outputs("1"), tempfile.mkdtemp(), flatten=True, dtype=torch.bfloat16)
        >>> ds = fh.collect(writer, batches, mask=lambda b: b["input"] != 0)
        >>> len(ds), ds[0]["1/output"].dtype
        (48, torch.bfloat16)
    """
    if writer.mask is not None:
        raise LoopError(
            "collect: the rows to keep are `collect(..., mask=)`, a function of the batch, got a writer with its own "
            "`mask`, a function of Steps. Build the writer without `mask=`."
        )
    state = writer.init()
    fn = capture(writer.model, writer.specs)
    model = writer.model
    total = len(inputs) - state.next_batch if isinstance(inputs, Sized) else None
    batches = _progress.wrap((b for b in _remaining(inputs, state.next_batch)), total=total, desc="collect",
                             progress=progress)
    try:
        with in_mode(model, False), torch.no_grad():
            for index, batch in batches:
                keep = _mask_of(mask, batch, index)
                _, record = _call(fn, batch)
                state = writer.write(state, index, record, mask=keep)
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    return writer.result(state)

