"""The shared timing harness of the benchmark scripts.

Every script measures the same way, so their numbers can be compared:

- one intra-op thread (``torch.set_num_threads(1)``), so the ratio measures Python-side
  overhead and not the luck of the thread pool;
- glibc never returns memory to the system (``mallopt(M_TRIM_THRESHOLD, -1)``) and serves
  blocks below 1 GiB from the heap (``M_MMAP_THRESHOLD``), so a forward never pays for
  ``mmap``/``munmap`` of its activations;
- every case is checked for correctness *before* it is timed;
- warm-up calls, then interleaved rounds: each round times every case once (``inner``
  calls each, the order rotated round to round), so slow drift of the machine hits all
  cases alike; the garbage collector is off while a round runs;
- time is this thread's CPU time by default (``--clock cpu``, ``time.thread_time``), so
  time spent descheduled on a shared machine does not count; ``--clock wall`` (the default
  on a GPU) uses ``time.perf_counter``;
- the result per case is the median and the 25th-75th percentiles of the per-call time
  over rounds, and its ratio to the bare forward *of the same round*, summarised the same
  way;
- results are written as JSON to ``benchmarks/results/<name>.json``.

Every script takes ``--quick`` (a smoke run of a few rounds on tiny models, used by
``tests/project/test_benchmarks.py`` so the scripts never rot), ``--rounds``, ``--inner`` and
``--out``. ``FUNHOOKS_BENCH_QUICK=1`` is the same as ``--quick``.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"
QUICK_ENV = "FUNHOOKS_BENCH_QUICK"

# glibc mallopt parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 30
NO_TRIM = -1

DEFAULT_ROUNDS = 31
DEFAULT_WARMUP = 20
QUICK_ROUNDS = 3
QUICK_WARMUP = 2
QUICK_INNER = 2
TARGET_ROUND_SECONDS = 0.02
"""With ``--inner 0`` (the default), calls per round are chosen so one case's round lasts about this long."""

MAX_CASE_ROUND_SECONDS = 0.1
"""A case slower than this per call (torchlens) gets fewer calls per round, at least one."""
MAX_WARMUP_SECONDS = 2.0
"""Warm-up of one case stops after this long (at least two calls)."""
MIN_WARMUP_CALLS = 2

PERCENTILES = (25, 75)


def _set_mallopt() -> bool:
    """Turn glibc trimming off; False where there is no glibc (macOS, musl)."""
    name = ctypes.util.find_library("c")
    if name is None or platform.system() != "Linux":
        return False
    try:
        libc = ctypes.CDLL(name)
        ok_trim = libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM)
        ok_mmap = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        return False
    return bool(ok_trim and ok_mmap)


def parse_args(
    description: str, argv: Sequence[str] | None = None, *,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The common command line: ``--quick``, ``--rounds``, ``--inner``, ``--warmup``, ``--out``, ``--device``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the GPU numbers)")
    parser.add_argument("--clock", choices=("auto", "cpu", "wall"), default="auto",
                        help="cpu: this thread's CPU time (steady on a shared machine); wall: elapsed time; "
                             "auto: cpu on the CPU, wall on a GPU")
    if add_arguments is not None:
        add_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny sizes, few rounds, no timing claims")
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument("--inner", type=int, default=0, help="calls per case per round (0: about 20 ms worth)")
    parser.add_argument("--warmup", type=int, default=None, help=f"warm-up calls per case (default {DEFAULT_WARMUP})")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS_DIR, help="directory for the JSON result")
    args = parser.parse_args(argv)
    args.quick = args.quick or os.environ.get(QUICK_ENV, "") not in ("", "0")
    if args.rounds is None:
        args.rounds = QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS
    if args.warmup is None:
        args.warmup = QUICK_WARMUP if args.quick else DEFAULT_WARMUP
    if args.quick and args.inner == 0:
        args.inner = QUICK_INNER
    if args.clock == "auto":
        args.clock = "wall" if args.device.startswith("cuda") else "cpu"
    return args


def setup(clock: str = "cpu") -> dict[str, Any]:
    """Fix the measuring conditions (one thread, no trimming) and describe them."""
    torch.set_num_threads(1)
    mallopt = _set_mallopt()
    return {"torch_threads": torch.get_num_threads(), "mallopt_no_trim": mallopt, "gc_during_rounds": False,
            "clock": clock}


def machine() -> dict[str, Any]:
    """What ran the benchmark: CPU, cores, load, versions, the git commit of the tree."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False,
            cwd=pathlib.Path(__file__).resolve().parent,
        ).stdout.strip()
    except OSError:
        commit = ""
    import funhooks

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "funhooks": funhooks.__version__,
        "git_commit": commit,
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _percentile(values: Sequence[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def summarise(values: Sequence[float]) -> dict[str, float]:
    """Median and the 25th / 75th percentiles of `values`."""
    return {
        "median": statistics.median(values),
        "p25": _percentile(values, PERCENTILES[0]),
        "p75": _percentile(values, PERCENTILES[1]),
    }


class PerRound:
    """A case built afresh (untimed) before its turn in every round and dropped after it
    (its ``close()`` called first, when it has one).

    For a case whose mere existence could change the others' cost (older funhooks versions
    kept global hooks installed while a capture function was alive, which slowed every
    module call in the process): building it per turn keeps the other cases clean.
    """

    def __init__(self, factory: Callable[[], Callable[[], Any]]) -> None:
        self.factory = factory


def _resolve(case: Callable[[], Any] | PerRound) -> Callable[[], Any]:
    return case.factory() if isinstance(case, PerRound) else case


def _release(fn: Callable[[], Any]) -> None:
    close = getattr(fn, "close", None)
    if close is not None:
        close()


def time_cases(
    cases: dict[str, Callable[[], Any]], *, baseline: str, rounds: int, warmup: int, inner: int = 0,
    sync: Callable[[], None] | None = None, clock: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Time `cases` in interleaved rounds; per case: seconds per call and ratio to `baseline`.

    Args:
        cases: name -> a callable of no arguments doing one call of the thing measured, or a
            :class:`PerRound` building such a callable, alive only during its own turn.
        baseline: the name of the case the ratios are taken to (the bare forward).
        rounds: interleaved rounds; each times every case once.
        warmup: untimed calls per case first.
        inner: calls per case per round; 0 picks about ``TARGET_ROUND_SECONDS`` worth of the
            baseline. A case slower than ``MAX_CASE_ROUND_SECONDS`` per round gets fewer calls.
        sync: called after each case's calls (``torch.cuda.synchronize`` on a GPU).
        clock: ``"cpu"``, this thread's CPU time (``time.thread_time``: time the thread
            spent descheduled on a shared machine is not counted), or ``"wall"``
            (``time.perf_counter``). Default: ``"wall"`` when `sync` is given, else ``"cpu"``.

    Returns:
        name -> {"seconds": {median, p25, p75}, "ratio": {median, p25, p75}, "calls_per_round"}.
    """
    if clock is None:
        clock = "cpu" if sync is None else "wall"
    sync = sync or (lambda: None)
    once: dict[str, float] = {}
    for name, case in cases.items():
        fn = _resolve(case)
        start = time.perf_counter()
        for i in range(warmup):
            t = time.perf_counter()
            fn()
            sync()
            once[name] = time.perf_counter() - t
            if i + 1 >= MIN_WARMUP_CALLS and time.perf_counter() - start > MAX_WARMUP_SECONDS:
                break
        _release(fn)
        del fn
    gc.collect()
    n = inner or max(1, int(TARGET_ROUND_SECONDS / max(once.get(baseline, 0.0), 1e-7)))
    calls = {name: max(1, min(n, int(MAX_CASE_ROUND_SECONDS / max(once.get(name, 0.0), 1e-9)))) for name in cases}
    calls[baseline] = n
    names = list(cases)
    per_call: dict[str, list[float]] = {k: [] for k in names}
    ratios: dict[str, list[float]] = {k: [] for k in names}
    now = time.thread_time if clock == "cpu" else time.perf_counter
    for r in range(rounds):
        gc.collect()
        gc.disable()
        try:
            order = names[r % len(names):] + names[: r % len(names)]
            times = {}
            for name in order:
                fn, k = _resolve(cases[name]), calls[name]
                start = now()
                for _ in range(k):
                    fn()
                sync()
                times[name] = (now() - start) / k
                _release(fn)
                del fn
        finally:
            gc.enable()
        for name in names:
            per_call[name].append(times[name])
            ratios[name].append(times[name] / times[baseline])
    return {
        name: {"seconds": summarise(per_call[name]), "ratio": summarise(ratios[name]), "calls_per_round": calls[name]}
        for name in names
    }


def synchronizer(device: str) -> Callable[[], None] | None:
    """``torch.cuda.synchronize`` for a CUDA device (timings then wait for the kernels), else None."""
    return torch.cuda.synchronize if device.startswith("cuda") else None


def write(name: str, out: pathlib.Path, payload: dict[str, Any]) -> pathlib.Path:
    """Write ``<out>/<name>.json`` (with the machine and conditions added) and return its path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    payload = {"benchmark": name, "machine": machine(), **payload}
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def format_table(title: str, results: dict[str, dict[str, Any]]) -> str:
    """A plain-text table of one model's timings, for the terminal."""
    lines = [title, f"  {'case':<34} {'us/call':>9} {'p25-p75 us':>17} {'ratio':>7} {'p25-p75':>13}"]
    for name, r in results.items():
        s, q = r["seconds"], r["ratio"]
        lines.append(
            f"  {name:<34} {s['median'] * 1e6:9.1f} {s['p25'] * 1e6:8.1f}-{s['p75'] * 1e6:<8.1f}"
            f" {q['median']:7.2f} {q['p25']:6.2f}-{q['p75']:<6.2f}"
        )
    return "\n".join(lines)


def tensors_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Same length and every pair equal (exactly; the cases compute the same ops)."""
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def check(ok: bool, what: str) -> None:
    """Stop the benchmark before timing anything when a case computes the wrong thing."""
    if not ok:
        print(f"correctness check failed: {what}", file=sys.stderr)
        raise SystemExit(1)


# -- the models every script measures ------------------------------------------------------

DEEP_NARROW_DEPTH = 48
DEEP_NARROW_WIDTH = 64
BATCH = 32
IMAGE = (3, 32, 32)
CNN_WIDTHS = (16, 32, 64)
CLASSES = 10
QUICK_CNN_WIDTHS = (4, 8)
QUICK_BATCH = 2
"""Sizes of the smoke runs (``--quick``): enough to exercise every case, nothing to time."""


def deep_narrow(depth: int = DEEP_NARROW_DEPTH, width: int = DEEP_NARROW_WIDTH) -> torch.nn.Module:
    """``depth`` x (Linear(width, width), ReLU): many cheap modules, the worst case for hooks."""
    from torch import nn

    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).eval()


class _Block(torch.nn.Module):
    """A ResNet basic block; each ReLU is its own module so every module runs once per call."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        from torch import nn

        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = (
            nn.Identity() if stride == 1 and c_in == c_out
            else nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))
        )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(y + self.shortcut(x))


def small_cnn(widths: Sequence[int] = CNN_WIDTHS, classes: int = CLASSES) -> torch.nn.Module:
    """A small ResNet-like CNN for 3x32x32 images: stem, one block per width, pool, linear."""
    from torch import nn

    layers: list[nn.Module] = [nn.Conv2d(IMAGE[0], widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]), nn.ReLU()]
    c = widths[0]
    for i, w in enumerate(widths):
        layers.append(_Block(c, w, stride=1 if i == 0 else 2))
        c = w
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, classes)]
    return nn.Sequential(*layers).eval()


def hooked_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``fh.outputs("**")`` stores, in the same order: every module below the root."""
    return [m for name, m in model.named_modules() if name]
