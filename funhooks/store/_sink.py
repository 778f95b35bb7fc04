"""The open side of one rank of an activation store: its lock, manifest and current shard.

An :class:`~funhooks.ActivationWriter`'s state holds one ``Sink``. Opening it recovers from
whatever interruption came before (a torn manifest line is cut, shard files and
temporaries the manifest does not list are deleted, listed shards are checked to be
there) and locks the rank. ``append`` streams a batch's rows into the current shard and
commits every shard that fills; ``flush`` commits the last, shorter one.

In one process, opening a rank again (a restart after an exception) closes the sink that
had it, whose state then refuses further steps. A sink dropped without a flush deletes
its temporary and releases its lock when it is garbage collected.

Costs: memory holds no rows (they go from the activation to the file) beyond the
statistics' buffers (``stats.Buffers``: a chunk per floating-point column, one working
chunk). Each piece of rows is written by the worker thread while this thread takes its
CRC-32s and statistics; ``append`` returns once both are done, so the worker holds no rows
after it: the caller lets go of batch ``i`` before it makes batch ``i + 1``. The worker's
only other task is ``collect``'s input fingerprint of the batch the model is running on
(at most ``_MAX_PENDING`` unfinished). No shard is read back: its checksums and statistics
are computed from the rows as they are written, and a shard is committed once they are
done. See ``_shards.py`` for the per-batch and per-shard I/O.

Why the worker only writes (and CRCs fingerprints): glibc's ``malloc`` (2.36 here) does not
reuse a freed block for an aligned request of the same size (torch's CPU tensors are 64-byte
aligned), and a small allocation placed between two freed blocks keeps them apart. A
worker that ran torch calls (the statistics) moved small blocks between the threads' caches
and left such separators: peak resident memory while ``collect`` wrote 4 MiB batches was
20-85 MiB over the start from run to run, against 16-29 MiB now (``benchmarks/bench_store.py``,
"collect rss"). The worker's calls (``write``, ``zlib.crc32``, BLAKE2b) allocate nothing
from that heap.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import pathlib
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar, cast

import torch

from funhooks.errors import StoreError

from . import _manifest, _shards, stats

__all__ = ["CALLER", "Sink"]

CALLER = "ActivationWriter"
_T = TypeVar("_T")
_OPEN: dict[tuple[str, int], tuple[weakref.ref[Sink], _Held]] = {}
"""(real directory, rank) -> the sink that has it open in this process, and what it holds (a
sink being collected, its finalizer not yet run, may still hold the lock)."""


class _Held:
    """What a sink must give back: its lock and its unfinished shard."""

    def __init__(self, lock: _manifest.RankLock) -> None:
        self.lock = lock
        self.shard: _shards.ShardFile | None = None

    def close(self) -> None:
        shard, self.shard = self.shard, None
        if shard is not None:
            shard.discard()
        self.lock.release()


class Sink:
    """One rank of a store, open for writing."""

    def __init__(self, directory: pathlib.Path, rank: int, *, fsync: bool) -> None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            where = "a file" if directory.exists() else f"which cannot be made ({e.strerror})"
            raise StoreError(
                f"{CALLER}: a store is a directory (created if needed), got {str(directory)!r}, {where}. Pass the "
                "path of a directory, or of nothing yet."
            ) from None
        self.directory, self.rank, self.fsync = directory, rank, fsync
        key = (os.path.realpath(directory), rank)
        previous = _OPEN.get(key)
        earlier = None if previous is None else previous[0]()
        if earlier is not None:
            earlier.close()
        elif previous is not None:  # collected, maybe on another thread that has yet to run its finalizer
            previous[1].close()
        self._held = _Held(_manifest.RankLock(directory, rank, CALLER))
        self._moments: stats.Accumulator | None = None
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._worker_pid = 0
        self._pending: collections.deque[concurrent.futures.Future[object]] = collections.deque()
        """The ``background`` tasks not known to be done, oldest first (at most ``_MAX_PENDING``)."""
        self._reuse = stats.Buffers()
        """The statistics' buffers, kept from shard to shard."""
        self._finalizer = weakref.finalize(self, _Held.close, self._held)
        try:
            self._recover()
        except BaseException:
            self.close()
            raise
        _OPEN[key] = (weakref.ref(self), self._held)
        self.version = 0
        self.closed = False
        self.failed: str | None = None
        self.inputs: Mapping[str, object] | None = None
        """What the rows written so far were made from (``{"batches", "fingerprint"}``), set by
        ``collect`` before each batch and written on every shard line it commits."""

    def _recover(self) -> None:
        path = _manifest.manifest_path(self.directory, self.rank)
        manifest = _manifest.read_manifest(path, CALLER)
        if manifest.size > manifest.valid_bytes:  # a process died while appending a line
            os.truncate(path, manifest.valid_bytes)
        error = _manifest.check_listed(manifest, self.rank, self.directory, CALLER)
        if error is not None:
            raise error
        listed = {line["file"] for line in manifest.shards}
        for p in _shards.rank_files(self.directory, self.rank):
            if p.name not in listed:
                p.unlink(missing_ok=True)
        self.manifest_path = path
        self.header = manifest.header
        self.shards = len(manifest.shards)
        self.rows = sum(line["rows"] for line in manifest.shards)
        self.end: tuple[int, int] = tuple(manifest.shards[-1]["end"]) if manifest.shards else (0, 0)
        self.committed_inputs = manifest.shards[-1].get("inputs") if manifest.shards else None
        self.columns = None if self.header is None else [_shards.Column.from_json(c) for c in self.header["columns"]]

    def close(self) -> None:
        """Give back the lock and delete the unfinished shard; later steps are refused."""
        self.closed = True
        if self._worker is not None:
            self._worker.shutdown(wait=True)
        self._finalizer()

    # -- writing ----------------------------------------------------------------------------
    def start(self, header: _shards.JsonObject, columns: Sequence[_shards.Column]) -> None:
        """Create the manifest with `header` (first batch of a new rank)."""
        _manifest.create_manifest(self.manifest_path, header, fsync=self.fsync)
        self.header, self.columns = dict(header), list(columns)

    @property
    def written(self) -> int:
        """Rows in committed shards and in the current one."""
        return self.rows + (self._held.shard.rows if self._held.shard is not None else 0)

    @property
    def capacity(self) -> int:
        assert self.header is not None
        return int(self.header["rows_per_shard"])

    def append(self, rows: Mapping[str, torch.Tensor], batch: int, first_row: int) -> None:
        """Write one batch's rows (from its row `first_row` on); commit every shard that fills.
        Returns when every row is written: nothing of `rows` is held after."""
        n = next(iter(rows.values())).shape[0] if rows else 0
        done = 0
        while done < n:
            shard = self._held.shard
            if shard is None:
                shard = self._io("opening", self._open_shard)
            take = min(n - done, shard.capacity - shard.rows)
            self._write(shard, {k: v[done:done + take] for k, v in rows.items()}, take)
            done += take
            if shard.rows == shard.capacity:
                self._commit((batch, first_row + done) if done < n else (batch + 1, 0))
        self.version += 1

    def _write(self, shard: _shards.ShardFile, piece: Mapping[str, torch.Tensor], rows: int) -> None:
        """`piece`'s rows into `shard`: the file written on the worker thread while this one
        takes their CRC-32s and statistics (both release the GIL); returns when both are done."""
        buffers = shard.buffers(piece)
        written = self._submit(shard.write, buffers, rows)
        try:
            shard.digest(buffers)
            assert self._moments is not None
            self._moments.add(piece)
        finally:
            _wait(written)
        self._io("writing", written.result)

    def _submit(self, fn: Callable[..., _T], *args: object) -> concurrent.futures.Future[_T]:
        """``fn(*args)`` on the worker thread, after everything submitted before it. The
        worker lets go of `args` before the future is done."""
        if self._worker is None or self._worker_pid != os.getpid():  # a forked child has no thread of it
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="funhooks-store")
            self._worker_pid = os.getpid()
            self._pending.clear()
        return self._worker.submit(_Task(fn, args).run)

    def background(self, fn: Callable[..., _T], *args: object) -> concurrent.futures.Future[_T]:
        """``fn(*args)`` on the sink's worker thread, after everything submitted before it
        (``collect``'s input fingerprints; `fn` should allocate nothing from the C heap:
        see the module's docstring). Waits first until fewer than ``_MAX_PENDING`` such tasks
        are unfinished, so the worker holds few arguments; an error of a task waited for
        raises here."""
        while self._pending and self._pending[0].done():
            self._pending.popleft().result()
        while len(self._pending) >= _MAX_PENDING:
            self._pending.popleft().result()
        future = self._submit(fn, *args)
        self._pending.append(cast("concurrent.futures.Future[object]", future))
        return future

    def flush(self, next_batch: int) -> None:
        """Commit the unfinished shard, if it holds rows; its end is batch `next_batch`. The
        worker thread ends here too (a later append starts another)."""
        shard = self._held.shard
        if shard is not None and shard.rows:
            self._commit((next_batch, 0))
        self._settle()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None

    def _settle(self) -> None:
        """Wait for every task handed to the worker through ``background`` (their errors raise here)."""
        while self._pending:
            self._pending.popleft().result()

    def _open_shard(self) -> _shards.ShardFile:
        about = {"format": _manifest.FORMAT, "version": _manifest.FORMAT_VERSION, "rank": self.rank,
                 "shard": self.shards}
        meta = {"format": "pt", "funhooks": json.dumps(about)}
        assert self.columns is not None
        shard = self._held.shard = _shards.ShardFile(self.directory, self.rank, self.shards, self.columns, self.capacity, meta)
        self._moments = stats.Accumulator(self.columns, self._reuse)
        return shard

    def _commit(self, end: tuple[int, int]) -> None:
        shard, moments = self._held.shard, self._moments
        assert shard is not None and moments is not None
        self._settle()

        def commit() -> None:
            finished = shard.finish(fsync=self.fsync)
            os.replace(shard.temp, shard.final)
            try:
                if self.fsync:
                    _manifest.fsync_directory(self.directory)
                line = {"shard": self.shards, "file": shard.final.name, "rows": shard.rows, "bytes": finished.bytes,
                        "end": list(end), "crc32s": finished.crc32s, "stats": stats.to_json(moments.moments())}
                if self.inputs is not None:
                    line["inputs"] = dict(self.inputs)
                _manifest.append_line(self.manifest_path, line, fsync=self.fsync)
            except BaseException:
                with contextlib.suppress(OSError):
                    shard.final.unlink()  # renamed but not listed: not part of the store
                raise

        self._io("committing", commit)
        self._held.shard = None
        self.shards += 1
        self.rows += shard.rows
        self.end = end

    def _io(self, doing: str, fn: Callable[..., _T], *args: object) -> _T:
        """``fn(*args)``; an OSError discards the unfinished shard and becomes a StoreError."""
        try:
            return fn(*args)
        except OSError as e:
            shard, self._held.shard = self._held.shard, None
            name = shard.final.name if shard is not None else f"shard {self.shards}"
            if shard is not None:
                shard.discard()
            what = f"{type(e).__name__} {e.errno} ({e.strerror})" if e.errno is not None else repr(e)
            self.failed = (
                f"{CALLER}: a shard is written whole or not at all, got {what} {doing} {name} in "
                f"{str(self.directory)!r}. Free space (or pick another directory) and run again: the {self.shards} "
                f"committed shards of rank {self.rank} are kept and writing resumes at batch {self.end[0]}."
            )
            raise StoreError(self.failed) from e


_MAX_PENDING = 1
"""``background`` tasks the worker may have unfinished before another waits for the oldest: one
input fingerprint of ``collect``, that of the batch the model runs on (a write waits for it
anyway: the worker runs its tasks in order)."""


def _wait(future: concurrent.futures.Future[_T]) -> None:
    """Wait until `future` is done, through a KeyboardInterrupt (raised again after): the worker
    reads rows the caller may free once this returns."""
    interrupted: KeyboardInterrupt | None = None
    while not future.done():
        try:
            concurrent.futures.wait([future])
        except KeyboardInterrupt as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted


class _Task(Generic[_T]):
    """``fn(*args)`` for the worker, which drops its references to them before the future is
    done: the caller, which holds them too, frees them on its own thread."""

    def __init__(self, fn: Callable[..., _T], args: tuple[object, ...]) -> None:
        self._call = [(fn, args)]

    def run(self) -> _T:
        fn, args = self._call.pop()
        return fn(*args)
