"""Activation stores across processes: a killed writer resumes, ranks write their own shards."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch
from store_helpers import contents, same_rows, store_inputs, store_model

import funhooks as fh

pytest.importorskip("safetensors")

CHILD_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 60
FEATURES, VOCAB = 3, 20


# -- subprocess scenarios ----------------------------------------------------------------------


def _child(*args: str, env: dict | None = None) -> subprocess.Popen:
    tests = str(pathlib.Path(__file__).resolve().parents[1])  # the shared helpers: store_helpers
    helpers = os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": helpers, **(env or {})}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _child_batches() -> list[torch.Tensor]:
    return [x * (i + 1) for i, x in enumerate(store_inputs(40, 3))]


def _child_writer(directory: str, rows_per_shard: int, **kw) -> fh.ActivationWriter:
    return fh.ActivationWriter(store_model(), [fh.outputs("0"), fh.outputs("2")], directory, rows_per_shard=rows_per_shard,
                               dtype=torch.bfloat16, **kw)


def _child_want() -> dict[str, torch.Tensor]:
    model = store_model()
    with torch.no_grad():
        xs = _child_batches()
        return {"0/output": torch.cat([model[0](x) for x in xs]).bfloat16(),
                "2/output": torch.cat([model(x) for x in xs]).bfloat16()}


def _slow(batches, delay: float):
    for i, b in enumerate(batches):
        print(f"batch {i}", flush=True)
        time.sleep(delay)
        yield b


def test_a_killed_writer_resumes_without_duplicates_or_losses(tmp_path):
    """SIGKILL while writing (fsync on, a commit every 4 rows): the rank's lock is released,
    the store holds a prefix, and `collect` again completes it exactly."""
    want = _child_want()
    for kill_after in (5, 17):
        directory = tmp_path / str(kill_after)
        proc = _child("kill", str(directory))
        try:
            for line in proc.stdout:
                if line.strip() == f"batch {kill_after}":
                    break
            else:
                pytest.fail(f"the writer ended before batch {kill_after}: {proc.wait()}")
            with pytest.raises(fh.StoreError) as info:
                _child_writer(directory, 4).init()
            assert str(info.value) == (
                f"ActivationWriter: one writer at a time writes a rank of a store, got rank 0 of {str(directory)!r} "
                "locked by another process. Stop that process, or write with another `rank=` or directory."
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=CHILD_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        got = contents(directory)
        n = len(got["0/output"])
        assert 0 < n < len(want["0/output"]) and same_rows(got, {k: v[:n] for k, v in want.items()})
        ds = fh.collect(_child_writer(directory, 4), _child_batches())
        assert same_rows(ds[:], want)
        assert sorted(p.name for p in directory.iterdir() if not p.name.startswith("shard.")) == [
            ".lock.rank0", "manifest.rank0.jsonl"]


def _run_limited(directory: pathlib.Path, limit: int, rows_per_shard: int) -> str:
    proc = _child("limited", str(directory), str(limit), str(rows_per_shard))
    out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, out
    return out.strip().splitlines()[-1]


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_a_full_disk_keeps_what_was_committed(tmp_path):
    """Writes that fail for real (a file-size limit, EFBIG) while appending to the manifest
    or while writing a shard: a one-line StoreError, the committed shards intact, no file
    left over, and a later run completes the store."""
    want = _child_want()
    reference = tmp_path / "reference"
    fh.collect(_child_writer(reference, 4, fsync=False), _child_batches())
    lines = (reference / "manifest.rank0.jsonl").read_bytes().splitlines(keepends=True)
    shard_bytes = json.loads(lines[1])["bytes"]
    assert shard_bytes < len(b"".join(lines[:4]))
    for directory, limit, rows, kept in ((tmp_path / "manifest", len(b"".join(lines[:4])) + 20, 4, 3),
                                         (tmp_path / "shard", len(lines[0]) + 8, 64, 0)):
        message = _run_limited(directory, limit, rows)
        failing = f"shard.rank0.{kept:06d}.safetensors"
        assert message == (
            f"ActivationWriter: a shard is written whole or not at all, got OSError 27 (File too large) "
            f"{'committing' if kept else 'writing'} {failing} in {str(directory)!r}. Free space (or pick another "
            f"directory) and run again: the {kept} committed shards of rank 0 are kept and writing resumes at "
            f"batch {kept * 4 // 3}."
        )
        names = sorted(p.name for p in directory.iterdir())
        shards = [f"shard.rank0.{k:06d}.safetensors" for k in range(kept)]
        assert names == [".lock.rank0", "manifest.rank0.jsonl", *shards]
        if kept:
            assert same_rows(contents(directory), {k: v[:4 * kept] for k, v in want.items()})
        ds = fh.collect(_child_writer(directory, rows), _child_batches())
        assert same_rows(ds[:], want)


def test_ranks_write_their_own_shards_and_read_as_one_dataset(tmp_path):
    """Two gloo ranks `collect` their own batches into one directory (rank from
    torch.distributed); the dataset reads rank 0's rows, then rank 1's."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    procs = [_child("rank", str(tmp_path / "store"), str(tmp_path / "rendezvous"), str(rank)) for rank in range(2)]
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ds = fh.ActivationDataset(tmp_path / "store", columns="2/output")
    model = store_model()
    with torch.no_grad():
        want = torch.cat([model(x).bfloat16() for rank in range(2) for x in _rank_batches(rank)])
    assert ds.metadata["ranks"] == [0, 1] and ds.shards == -(-30 // 4) + -(-24 // 4)
    assert torch.equal(ds[:], want)


def _rank_batches(rank: int) -> list[torch.Tensor]:
    return _child_batches()[rank * 10:(rank + 1) * 10 - 2 * rank]


def _main(mode: str, *args: str) -> None:
    torch.set_num_threads(1)
    if mode == "kill":
        fh.collect(_child_writer(args[0], 4), _slow(_child_batches(), 0.05))
    elif mode == "limited":
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(args[1]), resource.RLIM_INFINITY))
        try:
            fh.collect(_child_writer(args[0], int(args[2])), _child_batches())
        except fh.StoreError as e:
            print(e)
    elif mode == "rank":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args[1]}", rank=int(args[2]), world_size=2,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            fh.collect(_child_writer(args[0], 4), _rank_batches(int(args[2])))
            dist.barrier()
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    _main(*sys.argv[1:])
