"""Activation stores: write throughput, peak memory over dataset sizes, random-batch reads.

Write (one call = write every batch into a fresh directory; MB/s = the batches' bytes over
the call's wall time):

- ``torch.save per batch``: ``torch.save(x, f"{i}.pt")`` for each batch;
- ``save_file per batch``: ``safetensors.torch.save_file({"x": x}, f"{i}.safetensors")``;
- ``fh.ActivationWriter``: ``writer.write(state, i, record)`` for each batch, then
  ``writer.result(state)``, with ``fsync=False`` (what the two loops above do: no fsync);
- ``fh.ActivationWriter, fsync=True``: the default, durable writer;
- ``torch.save per batch + fsync`` and ``save_file per batch + fsync``: the loops made as
  durable, for comparing the durable writer fairly.

The batches are made once and held in memory; the writer is fed the Records a run would
give (``{"0": {"output": (x,)}}``), so only the write path is measured. Every case is
checked to read back equal before timing. Then interleaved rounds, the order rotated;
before each case ``os.sync()`` (not timed) so no case pays for another's dirty pages;
wall-clock time (this is I/O). Per case: the median MB/s and its 25th-75th percentiles,
and the ratio to the faster of the two plain loops *of the same round*. Goal (issue 15):
the writer within 20% of that, i.e. a ratio >= 0.8.

Memory: for each dataset size (100, 1,000, 10,000 batches) a fresh process writes that many
batches, each made on the fly and dropped, through ``fh.ActivationWriter``; reported: its
peak RSS (``VmHWM``) and the peak's growth over the RSS after set-up. Goal: flat within
10% from 100 to 10,000 batches.

Collect memory (issue 36): for each dataset size (16, 64, 256 batches) a fresh process runs
``fh.collect`` (``fsync=False``) of a ``Linear(1024, 1024)`` over batches of 1024 x 1024 float32
(4 MiB, made on the fly from a seeded generator), writing its output; reported: the peak RSS
(``VmHWM``) above the RSS after set-up (model, writer, one batch run), over
``COLLECT_RSS_REPEATS`` processes per size (median and max: the peak varies from process to
process with the C allocator). Goal: about two batches (8 MiB) plus a constant, flat in the
number of batches.

Read: random batches of ``READ_BATCH`` rows from the written store, through ``ds[indices]``
and through a ``DataLoader(ds, batch_size=READ_BATCH, shuffle=True)``; rows/s and MB/s
(the files are in the page cache: they were just written).

Collect (issue 30): a model run over the batches, its hidden layer written, two ways:
``hooks + save_file``, the hand-written loop (``register_forward_hook`` keeping the output,
``safetensors.torch.save_file`` per batch, no fsync), and ``fh.collect`` with
``fsync=False`` (statistics and input fingerprints included). Interleaved rounds; per round
the ratio collect time / loop time, median and quartiles. Goal: a ratio <= 1.0.

Run: ``python benchmarks/bench_store.py`` (``--quick`` for a smoke run; ``--dir`` for the
disk to write to, default a temporary directory).
"""

from __future__ import annotations

import argparse
import collections.abc
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import _common
import funhooks as fh

NAME = "store"
BATCHES, BATCH, WIDTH = 128, 256, 768  # 128 x 768 KiB = 96 MiB per call
ROWS_PER_SHARD = 8192  # 24 MiB shards: several commits per call
WRITE_ROUNDS = 7
RSS_SIZES = (100, 1_000, 10_000)
RSS_BATCH, RSS_WIDTH = 64, 256  # 64 KiB per batch: 10,000 batches = 625 MiB on disk
READ_BATCH, READ_CALLS = 256, 50
COLLECT_RSS_SIZES, COLLECT_RSS_REPEATS, COLLECT_ROWS = (16, 64, 256), 5, 1024  # 1024 x 1024 float32: 4 MiB
QUICK = {"batches": 4, "batch": 8, "width": 16, "rows_per_shard": 12, "rounds": 2, "rss_sizes": (10, 20),
         "read_calls": 3, "collect_rss_sizes": (4, 8), "collect_rss_repeats": 1}


def _model() -> nn.Module:
    return nn.Sequential(nn.Identity())


def _writer(directory: pathlib.Path, rows_per_shard: int, fsync: bool) -> fh.ActivationWriter:
    return fh.ActivationWriter(_model(), fh.outputs("0"), directory, rows_per_shard=rows_per_shard, fsync=fsync)


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cases(batches: list[torch.Tensor], rows_per_shard: int) -> dict[str, Callable[[pathlib.Path], None]]:
    """name -> a function writing every batch into a given (empty) directory."""

    def per_batch(save: Callable[[torch.Tensor, pathlib.Path], None], suffix: str, durable: bool) -> Callable:
        def call(d: pathlib.Path) -> None:
            for i, x in enumerate(batches):
                path = d / f"{i}{suffix}"
                save(x, path)
                if durable:
                    _fsync(path)
            if durable:
                _fsync(d)

        return call

    def writer(fsync: bool) -> Callable:
        records = [fh.Record({"0": {"output": (x,)}}) for x in batches]

        def call(d: pathlib.Path) -> None:
            w = _writer(d, rows_per_shard, fsync)
            state = w.init()
            for i, rec in enumerate(records):
                state = w.write(state, i, rec)
            w.result(state)

        return call

    def torch_save(x: torch.Tensor, path: pathlib.Path) -> None:
        torch.save(x, path)

    def st_save(x: torch.Tensor, path: pathlib.Path) -> None:
        save_file({"x": x}, path)

    return {
        "torch.save per batch": per_batch(torch_save, ".pt", False),
        "save_file per batch": per_batch(st_save, ".safetensors", False),
        "fh.ActivationWriter": writer(False),
        "fh.ActivationWriter, fsync=True": writer(True),
        "torch.save per batch + fsync": per_batch(torch_save, ".pt", True),
        "save_file per batch + fsync": per_batch(st_save, ".safetensors", True),
    }


def _check(cases: dict[str, Callable], batches: list[torch.Tensor], root: pathlib.Path) -> bool:
    """Every case writes what reads back as the batches."""
    want = torch.cat(batches)
    ok = True
    for name, call in cases.items():
        d = root / "check"
        d.mkdir()
        call(d)
        if name.startswith("fh."):
            got = fh.ActivationDataset(d)[:]["0/output"]
        elif name.startswith("torch.save"):
            got = torch.cat([torch.load(d / f"{i}.pt", weights_only=True) for i in range(len(batches))])
        else:
            got = torch.cat([load_file(d / f"{i}.safetensors")["x"] for i in range(len(batches))])
        ok = ok and torch.equal(got, want)
        shutil.rmtree(d)
    return ok


def time_writes(cases: dict[str, Callable], nbytes: int, rounds: int, root: pathlib.Path) -> dict[str, Any]:
    """Interleaved rounds of every case; MB/s and the ratio to the faster plain loop per round."""
    names = list(cases)
    mbs: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        seconds = {}
        for name in names[r % len(names):] + names[:r % len(names)]:
            d = root / f"round{r}"
            d.mkdir()
            os.sync()
            start = time.perf_counter()
            cases[name](d)
            seconds[name] = time.perf_counter() - start
            shutil.rmtree(d)
        fastest_plain = min(seconds["torch.save per batch"], seconds["save_file per batch"])
        for name in names:
            mbs[name].append(nbytes / 2**20 / seconds[name])
            ratios[name].append(fastest_plain / seconds[name])
    return {n: {"MB/s": _common.summarise(mbs[n]), "ratio_to_faster_plain_loop": _common.summarise(ratios[n])}
            for n in names}


def _collect_cases(batches: list[torch.Tensor], rows_per_shard: int) -> dict[str, Callable[[pathlib.Path], None]]:
    """name -> a function running a model over every batch and writing its hidden layer into a directory."""
    width = batches[0].shape[1]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).eval()

    def by_hand(d: pathlib.Path) -> None:
        kept: list[torch.Tensor] = []
        handle = model[1].register_forward_hook(lambda m, args, out: kept.append(out))
        try:
            with torch.no_grad():
                for i, x in enumerate(batches):
                    model(x)
                    save_file({"x": kept.pop()}, d / f"{i}.safetensors")
        finally:
            handle.remove()

    def by_collect(d: pathlib.Path) -> None:
        writer = fh.ActivationWriter(model, fh.outputs("1"), d, rows_per_shard=rows_per_shard, fsync=False)
        fh.collect(writer, batches, progress=False)

    return {"hooks + save_file": by_hand, "fh.collect, fsync=False": by_collect}


def time_collect(cases: dict[str, Callable], rounds: int, root: pathlib.Path) -> dict[str, Any]:
    """Interleaved rounds of both ways; seconds and the ratio collect / hand-written per round."""
    seconds: dict[str, list[float]] = {n: [] for n in cases}
    for r in range(rounds):
        names = list(cases)[r % 2:] + list(cases)[:r % 2]
        for name in names:
            d = root / f"collect{r}"
            d.mkdir()
            os.sync()
            start = time.perf_counter()
            cases[name](d)
            seconds[name].append(time.perf_counter() - start)
            shutil.rmtree(d)
    ratios = [c / h for c, h in zip(seconds["fh.collect, fsync=False"], seconds["hooks + save_file"], strict=True)]
    return {"seconds": {n: _common.summarise(v) for n, v in seconds.items()},
            "ratio_collect_to_hand": _common.summarise(ratios)}


def rss_child(directory: str, batches: int, batch: int, width: int) -> dict[str, float]:
    """Write `batches` generated batches; peak RSS and the RSS after set-up, in MiB."""
    torch.set_num_threads(1)
    writer = _writer(pathlib.Path(directory), rows_per_shard=65536, fsync=False)
    state = writer.init()
    gen = torch.Generator().manual_seed(0)
    state = writer.write(state, 0, fh.Record({"0": {"output": (torch.randn(batch, width, generator=gen),)}}))
    base = _rss_now()
    for i in range(1, batches):
        x = torch.randn(batch, width, generator=gen)
        state = writer.write(state, i, fh.Record({"0": {"output": (x,)}}))
    ds = writer.result(state)
    assert len(ds) == batches * batch
    peak = _status_mib("VmHWM")
    return {"peak_rss_mib": peak, "rss_after_setup_mib": base, "growth_mib": peak - base}


class _Generated(collections.abc.Sequence):
    """`n` batches of COLLECT_ROWS x COLLECT_ROWS float32, each made when it is read (seeded)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        if not 0 <= i < self.n:
            raise IndexError(i)
        return torch.randn(COLLECT_ROWS, COLLECT_ROWS, generator=torch.Generator().manual_seed(i))


def collect_rss_child(directory: str, batches: int) -> dict[str, float]:
    """``fh.collect`` of `batches` generated 4 MiB batches; peak RSS over the RSS after set-up, in MiB."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(COLLECT_ROWS, COLLECT_ROWS))
    with torch.no_grad():
        model(_Generated(1)[0])
    writer = fh.ActivationWriter(model, fh.outputs("0"), pathlib.Path(directory), rows_per_shard=16 * COLLECT_ROWS,
                                 fsync=False)
    base = _rss_now()
    ds = fh.collect(writer, _Generated(batches), progress=False)
    assert len(ds) == batches * COLLECT_ROWS
    peak = _status_mib("VmHWM")
    return {"peak_rss_mib": peak, "rss_after_setup_mib": base, "growth_mib": peak - base}


def measure_collect_rss(sizes: tuple[int, ...], repeats: int, root: pathlib.Path) -> dict[str, Any]:
    out = {}
    for n in sizes:
        runs = []
        for r in range(repeats):
            d = root / f"collect-rss{n}-{r}"
            proc = subprocess.run([sys.executable, __file__, "--collect-rss-child", str(d), str(n)],
                                  capture_output=True, text=True, check=False,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                raise SystemExit(1)
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1])["growth_mib"])
            shutil.rmtree(d, ignore_errors=True)
        out[str(n)] = {"growth_mib": runs, "median_mib": statistics.median(runs), "max_mib": max(runs)}
    return out


def _status_mib(field: str) -> float:
    """A memory field of /proc/self/status, in MiB (``VmHWM``: this process's peak RSS;
    unlike ``ru_maxrss``, it does not start from the parent's RSS at fork)."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise SystemExit(f"no {field} in /proc/self/status")


def _rss_now() -> float:
    return _status_mib("VmRSS")


def measure_rss(sizes: tuple[int, ...], batch: int, width: int, root: pathlib.Path) -> dict[str, Any]:
    out = {}
    for n in sizes:
        d = root / f"rss{n}"
        proc = subprocess.run([sys.executable, __file__, "--rss-child", str(d), str(n), str(batch), str(width)],
                              capture_output=True, text=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if proc.returncode != 0:
            print(proc.stderr, file=sys.stderr)
            raise SystemExit(1)
        out[str(n)] = json.loads(proc.stdout.strip().splitlines()[-1])
        shutil.rmtree(d)
    peaks = [r["peak_rss_mib"] for r in out.values()]
    return {"sizes": out, "peak_max_over_min": max(peaks) / min(peaks)}


def time_reads(directory: pathlib.Path, calls: int, rounds: int, batch: int) -> dict[str, Any]:
    ds = fh.ActivationDataset(directory, columns="0/output")
    row_bytes = ds[0].numel() * ds[0].element_size()
    gen = torch.Generator().manual_seed(0)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, generator=gen)

    def by_index() -> None:
        for _ in range(calls):
            ds[torch.randint(len(ds), (batch,), generator=gen)]

    def by_loader() -> None:
        for i, _ in enumerate(loader):
            if i + 1 == calls:
                break

    out = {}
    for name, fn in (("ds[indices]", by_index), ("DataLoader(shuffle=True)", by_loader)):
        fn()  # warm: maps the shards, fills the page cache
        per_round = []
        for _ in range(rounds):
            start = time.perf_counter()
            fn()
            per_round.append(calls * batch / (time.perf_counter() - start))
        rows = statistics.median(per_round)
        out[name] = {"rows/s": _common.summarise(per_round), "MB/s": rows * row_bytes / 2**20}
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rss-child":
        print(json.dumps(rss_child(sys.argv[2], *map(int, sys.argv[3:6]))))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--collect-rss-child":
        print(json.dumps(collect_rss_child(sys.argv[2], int(sys.argv[3]))))
        return

    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--dir", type=pathlib.Path, default=None, help="where to write (default: a temp dir)")

    args = _common.parse_args(__doc__.splitlines()[0], add_arguments=extra)
    conditions = _common.setup("wall")
    q = QUICK if args.quick else {}
    n, batch, width = q.get("batches", BATCHES), q.get("batch", BATCH), q.get("width", WIDTH)
    rows_per_shard = q.get("rows_per_shard", ROWS_PER_SHARD)
    rounds = q.get("rounds", args.rounds if args.rounds != _common.DEFAULT_ROUNDS else WRITE_ROUNDS)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(batch, width, generator=gen) for _ in range(n)]
    nbytes = sum(x.numel() * x.element_size() for x in batches)
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    try:
        cases = _cases(batches, rows_per_shard)
        correct = _check(cases, batches, root)
        _common.check(correct, "a case did not read back the batches it wrote")
        write = time_writes(cases, nbytes, rounds, root)
        print(f"write: {n} batches of {batch} x {width} float32 ({nbytes / 2**20:.0f} MiB), {rounds} rounds")
        for name, r in write.items():
            m, q_ = r["MB/s"], r["ratio_to_faster_plain_loop"]
            print(f"  {name:<34} {m['median']:8.0f} MB/s ({m['p25']:.0f}-{m['p75']:.0f})   ratio {q_['median']:.2f} "
                  f"({q_['p25']:.2f}-{q_['p75']:.2f})")
        collected = time_collect(_collect_cases(batches, rows_per_shard), rounds, root)
        c = collected["ratio_collect_to_hand"]
        for name, t in collected["seconds"].items():
            print(f"  collect: {name:<25} {t['median'] * 1e3:8.1f} ms")
        print(f"  collect / hand-written loop: {c['median']:.2f} ({c['p25']:.2f}-{c['p75']:.2f})")
        store = root / "read"
        cases["fh.ActivationWriter"](store)
        read = time_reads(store, q.get("read_calls", READ_CALLS), max(3, rounds), min(READ_BATCH, n * batch))
        for name, r in read.items():
            print(f"  read {name:<28} {r['rows/s']['median']:10.0f} rows/s  {r['MB/s']:8.0f} MB/s")
        rss = measure_rss(q.get("rss_sizes", RSS_SIZES), RSS_BATCH, q.get("width", RSS_WIDTH), root)
        for size, r in rss["sizes"].items():
            print(f"  rss {size:>6} batches: peak {r['peak_rss_mib']:.1f} MiB, "
                  f"growth over set-up {r['growth_mib']:.1f} MiB")
        print(f"  peak max/min {rss['peak_max_over_min']:.3f}")
        collect_rss = measure_collect_rss(q.get("collect_rss_sizes", COLLECT_RSS_SIZES),
                                          q.get("collect_rss_repeats", COLLECT_RSS_REPEATS), root)
        for size, r in collect_rss.items():
            print(f"  collect rss {size:>4} batches of 4 MiB: peak over set-up median {r['median_mib']:.1f} MiB, "
                  f"max {r['max_mib']:.1f} MiB ({', '.join(f'{g:.1f}' for g in r['growth_mib'])})")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "correct": correct,
        "data": {"batches": n, "batch": batch, "width": width, "dtype": "float32", "bytes": nbytes,
                 "rows_per_shard": rows_per_shard, "rounds": rounds},
        "results": {"write": write, "collect": collected, "read": read, "rss": rss, "collect_rss": collect_rss},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
