"""Big models: the first run's plan, per module, from 500 to 50,000 modules.

A run resolves its specs against the model once (a *plan*) and caches it; this script
times the first run on a model it never saw, so the plan is made inside the timing. Each
sample builds a fresh model (untimed), then times one of:

- ``with_hooks``: entering and leaving ``with fh.with_hooks(model, fh.outputs("**"))``
  without a forward (plan making, attaching and detaching);
- ``capture``: ``fh.capture(model, fh.outputs("**"))``, the call that makes its plan;
- ``hook_outputs``: ``with fh.with_hooks(model, fh.hook_outputs(list(model)))``, fastai's
  list of modules;
- ``again``: the same ``with_hooks`` a second time on the same model (the cached plan: its
  reuse check, attaching and detaching);

and, as the bare-PyTorch baseline of the same sample, ``list(model.named_modules())``.
``with_hooks``, ``capture`` and ``again`` run on a Sequential of ``Linear(4, 4)`` (tiny
weights, so memory stays small), ``hook_outputs`` too; ``moe`` is ``with_hooks`` on a
mixture-of-experts shape: a ModuleList of layers, each a ModuleList of experts, each a
``Sequential(Linear, ReLU, Linear)``.

The garbage collector stays on, as in a real session, and the script first makes the heap
such a session has: a few hundred thousand live Python objects (a list of small dicts), so
the collector's full collections cost what they cost there. The number of collections of
each generation that landed inside the timed call is reported beside the time.

Reported per case and size: the median (and 25th-75th percentiles) of microseconds per
module over samples, its ratio to ``named_modules`` of the same sample, and per case the
max/min ratio of the medians across sizes (1.0 is perfectly linear; the issue's goal is
<= 15 us per module at every size, with no jump).

Run: ``python benchmarks/bench_plan.py`` (``--quick`` for a smoke run; ``--samples N``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _common
import funhooks as fh

NAME = "plan"
SIZES = (500, 2_000, 8_000, 20_000, 50_000)
QUICK_SIZES = (200, 1_000)
SAMPLES = 5
QUICK_SAMPLES = 2
LIVE_OBJECTS = 300_000
"""Small dicts kept alive while timing: the heap of a real session, for realistic full collections."""
QUICK_LIVE_OBJECTS = 30_000
EXPERTS = 256
EXPERT_MODULES = 4
"""Modules per expert: the Sequential and its Linear, ReLU, Linear."""
WIDTH = 4
CASES = ("with_hooks", "capture", "hook_outputs", "again", "moe")


def linears(n: int) -> nn.Module:
    """A Sequential of `n` ``Linear(4, 4)``: `n` + 1 modules."""
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(n)])


def expert() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))


class MoE(nn.Module):
    """Layers of experts, every expert run on the whole input (no router: the plan is what is measured)."""

    def __init__(self, layers: int, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([expert() for _ in range(experts)]) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = sum(e(x) for e in layer) / len(layer)
        return x


def moe(n: int) -> nn.Module:
    """About `n` modules shaped like a mixture of experts: layers x experts (256 once there
    are enough modules) of small MLPs."""
    experts = min(EXPERTS, max(1, n // (2 * EXPERT_MODULES)))
    return MoE(max(1, n // (EXPERT_MODULES * experts)), experts)


def _enter(model: nn.Module, spec: fh.Spec) -> None:
    with fh.with_hooks(model, spec):
        pass


def _case(name: str, n: int) -> tuple[nn.Module, Callable[[], Any]]:
    """A fresh model for case `name` and the call to time on it (made untimed)."""
    if name == "moe":
        model = moe(n)
        return model, lambda: _enter(model, fh.outputs("**"))
    model = linears(n)
    if name == "capture":
        return model, lambda: fh.capture(model, fh.outputs("**"))
    if name == "hook_outputs":
        spec = fh.hook_outputs(list(model))
        return model, lambda: _enter(model, spec)
    if name == "again":
        _enter(model, fh.outputs("**"))
    return model, lambda: _enter(model, fh.outputs("**"))


class _Collections:
    """Counts the garbage collector's collections per generation (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.counts[info["generation"]] += 1

    def take(self) -> list[int]:
        counts, self.counts = self.counts, [0, 0, 0]
        return counts


def _check(model: nn.Module) -> bool:
    """Before timing: a run's Record holds every called module's output, in module order."""
    with fh.with_hooks(model, fh.outputs("**")) as run:
        model(torch.randn(1, WIDTH))
    return list(run.record) == [p for p, m in model.named_modules() if p and not isinstance(m, nn.ModuleList)]


def measure(sizes: tuple[int, ...], samples: int, now: Callable[[], float]) -> dict[str, Any]:
    """Per case and size: us per module over `samples` fresh models, and ratio to ``named_modules``."""
    collections = _Collections()
    gc.callbacks.append(collections)
    per_module: dict[str, dict[int, list[float]]] = {c: {n: [] for n in sizes} for c in CASES}
    ratios: dict[str, dict[int, list[float]]] = {c: {n: [] for n in sizes} for c in CASES}
    full: dict[str, dict[int, list[int]]] = {c: {n: [] for n in sizes} for c in CASES}
    modules: dict[str, dict[int, int]] = {c: {} for c in CASES}
    try:
        for s in range(samples):
            for n in sizes:
                order = CASES[s % len(CASES):] + CASES[: s % len(CASES)]
                for name in order:
                    model, fn = _case(name, n)
                    count = sum(1 for _ in model.modules())
                    start = now()
                    list(model.named_modules())
                    bare = now() - start
                    collections.take()
                    start = now()
                    fn()
                    took = now() - start
                    full[name][n].append(collections.take()[2])
                    modules[name][n] = count
                    per_module[name][n].append(took / count * 1e6)
                    ratios[name][n].append(took / max(bare, 1e-9))
                    del model, fn
    finally:
        gc.callbacks.remove(collections)
    results: dict[str, Any] = {}
    for name in CASES:
        medians = {n: statistics.median(per_module[name][n]) for n in sizes}
        results[name] = {
            "sizes": {str(n): {"modules": modules[name][n], "us_per_module": _common.summarise(per_module[name][n]),
                               "ratio_to_named_modules": _common.summarise(ratios[name][n]),
                               "full_collections": full[name][n]} for n in sizes},
            "max_over_min": max(medians.values()) / min(medians.values()),
        }
    return results


def main() -> None:
    def more(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--samples", type=int, default=None, help=f"fresh models per case and size (default {SAMPLES})")

    args = _common.parse_args(__doc__.splitlines()[0], add_arguments=more)
    conditions = _common.setup(args.clock)
    conditions["gc_during_rounds"] = True  # the point: the collector runs, as in a session
    sizes = QUICK_SIZES if args.quick else SIZES
    samples = args.samples or (QUICK_SAMPLES if args.quick else SAMPLES)
    live = QUICK_LIVE_OBJECTS if args.quick else LIVE_OBJECTS
    heap = [{"index": i, "name": str(i)} for i in range(live)]  # a session's live objects
    correct = _check(linears(8)) and _check(moe(16))
    _common.check(correct, "a run's Record does not hold every module")
    now = time.thread_time if args.clock == "cpu" else time.perf_counter
    results = measure(sizes, samples, now)
    del heap
    print(f"first-run plan, us per module (median over {samples} fresh models; ratio to named_modules; "
          f"full collections inside the call)")
    print(f"  {'case':<14}" + "".join(f"{n:>20}" for n in sizes) + f"{'max/min':>9}")
    for name, r in results.items():
        cells = [r["sizes"][str(n)] for n in sizes]
        print(f"  {name:<14}" + "".join(
            f"{c['us_per_module']['median']:8.2f} {c['ratio_to_named_modules']['median']:6.1f}x {max(c['full_collections']):3d}"
            for c in cells) + f"{r['max_over_min']:9.2f}")
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "samples": samples, "live_objects": live,
        "correct": correct, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
