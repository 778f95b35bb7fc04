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

import concurrent.futures
import itertools
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence, Sized
from typing import Any, TypeAlias, TypeVar

import torch

from funhooks._modes import in_mode
from funhooks.errors import LoopError, StoreError
from funhooks.records.record import Record
from funhooks.runs.pure import capture
from funhooks.training.progress import wrap

from . import _fingerprint
from ._sink import Sink
from .dataset import ActivationDataset
from .writer import ActivationWriter

__all__ = ["collect"]

_R = TypeVar("_R")

_Batch: TypeAlias = Any
"""One of the user's batches: a dict, a tuple or list, or one value, as the model takes it."""
_Mask = Callable[[_Batch], torch.Tensor]
"""``mask(batch)``: the rows of a batch to keep, as a bool tensor."""


def _call(fn: Callable[..., _R], batch: _Batch) -> _R:
    if isinstance(batch, Mapping):
        return fn(**batch)
    if isinstance(batch, (tuple, list)):
        return fn(*batch)
    return fn(batch)


def _mask_of(mask: str | _Mask | None, batch: _Batch, index: int) -> torch.Tensor | None:
    if mask is None or callable(mask):
        return None if mask is None else mask(batch)
    if isinstance(batch, Mapping) and mask in batch:
        return batch[mask]
    keys = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
    raise LoopError(
        f"collect: `mask={mask!r}` names a key of every batch, got batch {index} with keys {keys}. "
        "Yield dicts holding it (e.g. a tokenizer's `attention_mask`), or pass `mask=lambda batch: ...`."
    )


def _remaining(inputs: Iterable[_Batch], start: int) -> Generator[tuple[int, _Batch], None, None]:
    """``(index, batch)`` from batch `start` on. Holds no batch it gave: the caller's loop lets
    go of one before the next is made."""
    if isinstance(inputs, Sequence):  # indexable: the written batches are not even loaded
        yield from ((i, inputs[i]) for i in range(start, len(inputs)))
    else:
        yield from itertools.islice(enumerate(inputs), start, None)


class _Inputs:
    """The fingerprint of the batches seen so far, checked against the store's record of them.

    Batches the store already holds are digested at once (a resumed run is refused before it
    writes anything); later ones on the sink's worker thread, in order, while the model runs
    (the digest releases the GIL), so fingerprinting costs ``collect`` no time on a machine with
    a second core. A shard's manifest line waits for the digest of its last batch when it is
    committed.
    """

    def __init__(self, sink: Sink, directory: object) -> None:
        committed = sink.committed_inputs
        ok = (isinstance(committed, Mapping) and isinstance(committed.get("batches"), int)
              and isinstance(committed.get("fingerprint"), str))
        self.recorded: Mapping[str, Any] | None = committed if ok else None
        self.directory, self.batches, self.fingerprint = directory, 0, _fingerprint.START
        self.sink = sink
        self._parts: _fingerprint.Parts = []
        """The bytes of the batch being digested on the worker, held until ``release``."""

    def see(self, index: int, batch: _Batch) -> Mapping[str, object]:
        """Take batch `index` into the fingerprint (once); refuse inputs the store was not written from."""
        if index < self.batches:
            return _Seen(self.batches, self._last)
        self.batches = index + 1
        if self.recorded is not None and self.batches <= self.recorded["batches"]:
            self.fingerprint = _fingerprint.chain(self.fingerprint, batch)
            if self.batches == self.recorded["batches"]:
                self._check(self.fingerprint)
            self._last = _done(self.fingerprint)
        else:
            self._parts = _fingerprint.parts(batch)  # this thread takes the bytes, the worker only digests them
            self._last = self.sink.background(self._chain, self._parts)  # one worker: in batch order
        return _Seen(self.batches, self._last)

    def release(self) -> None:
        """Let go of the last batch's bytes (here, not on the worker thread: see ``_sink.py``)."""
        self._parts = []

    def _chain(self, batch: _fingerprint.Parts) -> str:
        self.fingerprint = _fingerprint.chain_parts(self.fingerprint, batch)  # only the worker writes it now
        return self.fingerprint

    def end(self) -> None:
        """Refuse inputs that ran out before the batches the store was written from."""
        if self.recorded is not None and self.batches < self.recorded["batches"]:
            self._check(f"{self.batches} batches")

    _last: concurrent.futures.Future[str]

    def _check(self, got: str) -> None:
        want = self.recorded["batches"], self.recorded["fingerprint"]  # type: ignore[index]
        if got != want[1]:
            raise StoreError(
                f"collect: a store is continued with the inputs that wrote it, got {got!r} for the first {want[0]} "
                f"batches where {str(self.directory)!r} was written from inputs of fingerprint {want[1]!r}. Pass the "
                "same inputs in the same order, or write to a new directory."
            )


class _Seen(Mapping[str, object]):
    """``{"batches", "fingerprint"}`` of the batches seen so far; the fingerprint is read (and
    waited for) only when a manifest line is written."""

    def __init__(self, batches: int, fingerprint: concurrent.futures.Future[str]) -> None:
        self._batches, self._fingerprint = batches, fingerprint

    def __getitem__(self, key: str) -> object:
        if key == "batches":
            return self._batches
        if key == "fingerprint":
            return self._fingerprint.result()
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("batches", "fingerprint"))

    def __len__(self) -> int:
        return 2


def _done(value: str) -> concurrent.futures.Future[str]:
    future: concurrent.futures.Future[str] = concurrent.futures.Future()
    future.set_result(value)
    return future

def _budget_mask(record: Record, writer: ActivationWriter, keep: torch.Tensor | None, left: int) -> tuple[
        torch.Tensor | None, int]:
    """The mask keeping at most `left` of a batch's rows (its first ones), and how many it keeps."""
    _, path, name = writer.columns[0]
    calls = record.calls(path, name) if path in record else ()
    if not calls or not isinstance(calls[0], torch.Tensor):
        return keep, 0  # the writer names what is missing
    lead = tuple(calls[0].shape[:2 if writer.flatten else 1])
    base = torch.ones(lead, dtype=torch.bool) if keep is None else torch.as_tensor(keep).to("cpu") != 0
    if tuple(base.shape) != lead:
        return keep, 0  # the writer names the mismatch
    rows = int(base.sum())
    if rows <= left:
        return keep, rows
    flat = base.reshape(-1).clone()
    flat[flat.nonzero().squeeze(1)[left:]] = False
    return flat.reshape(lead), left


def collect(writer: ActivationWriter, inputs: Iterable[_Batch], *, mask: str | _Mask | None = None,
            max_rows: int | None = None, progress: bool | None = None) -> ActivationDataset:
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
        max_rows: stop once the store holds this many rows (tokens, with ``flatten=True``
            and a mask), keeping the first rows of the batch that reaches it; None: all inputs.
            ``0`` runs nothing: it returns a store that exists as it is, and is refused for a
            new directory (a store's columns come from its first batch; there is no empty
            store without columns).
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        The :class:`~funhooks.ActivationDataset` of ``writer.directory``.

    Inputs: each committed shard records how many batches its rows come from and a
    fingerprint of them (``funhooks.store._fingerprint``). Continuing a store, ``collect``
    reads those batches again (without running the model) and refuses inputs that differ.
    A batch cut by `max_rows` counts as consumed: a later call with a larger budget goes on
    from the next batch.

    Raises:
        LoopError: for a `mask` key missing from a batch, a writer with its own `mask`, a
            bad `max_rows`, or a new directory given no batch (``max_rows=0``, or empty `inputs`).
        StoreError: for inputs other than those the store was written from; as for
            :class:`ActivationWriter`.

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
    if max_rows is not None and (isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 0):
        raise LoopError(f"collect: `max_rows` is a non-negative int or None, got {max_rows!r}. Pass e.g. 1_000_000.")
    state = writer.init()
    sink = state.sink
    seen = _Inputs(sink, writer.directory)
    first = 0 if sink.committed_inputs is not None or not sink.rows else state.next_batch
    fn = capture(writer.model, writer.specs)
    model = writer.model
    total = len(inputs) - first if isinstance(inputs, Sized) else None
    batches = wrap(_remaining(inputs, first), total=total, desc="collect",
                   progress=progress)
    track = sink.committed_inputs is not None or not sink.rows  # a store written without a record keeps none
    try:
        with in_mode(model, False), torch.no_grad():
            for index, batch in batches:
                if max_rows is not None and state.rows >= max_rows:
                    break
                if track:
                    sink.inputs = seen.see(index, batch)
                if index < state.next_batch:
                    continue
                keep = _mask_of(mask, batch, index)
                record = _call(fn, batch)[1]  # the output goes (the record holds what is written)
                if max_rows is not None:
                    keep, _ = _budget_mask(record, writer, keep, max_rows - state.rows)
                state = writer.write(state, index, record, mask=keep)
                del record, keep, batch  # this batch's activations go now, not when the next batch's are made
                seen.release()  # its fingerprint is done: the write waited for the worker
            else:
                seen.end()
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
    if sink.header is None:  # a new directory, and no batch came: a store's columns come from its first batch
        sink.close()
        why = "`max_rows=0` asks for 0 rows" if max_rows == 0 else "`inputs` gave no batch"
        raise LoopError(
            f"collect: a new store takes its columns from its first batch, got {why} for {str(writer.directory)!r}, "
            "which holds no store yet. Pass max_rows >= 1 (or None for every input) and inputs that give a batch."
        )
    return writer.result(state)

