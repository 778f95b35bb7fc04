"""Per-example capture: ``torch.func.vmap`` over ``fh.capture`` vs a Python loop.

Both cases capture every module's output of the deep-narrow MLP for each of 64 examples,
one example at a time as the model sees it (an unbatched input):

- ``loop``: ``[f(x[i]) for i in range(64)]``, a Record per example;
- ``vmap``: ``torch.func.vmap(f)(x)``, one Record whose tensors carry the example dim.

``f = fh.capture(model, fh.outputs("**"))``. Checked before timing: the vmapped Record
equals the stacked per-example Records. The ratio reported is loop time / vmap time (the
speed-up; the issue's target is >= 5x). Needs ``fh.capture``: without it the script says
so and writes a result marked ``skipped``.

Run: ``python benchmarks/bench_vmap.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import _common
import funhooks as fh

NAME = "vmap"
BATCH = 64
QUICK_BATCH = 4
QUICK_DEPTH = 4
ATOL = 1e-5


def check(f: Callable[[torch.Tensor], tuple[Any, fh.Record]], x: torch.Tensor) -> bool:
    """The vmapped Record's stored tensors equal the per-example ones, stacked."""
    y, rec = torch.func.vmap(f)(x)
    loop = [f(xi) for xi in x]
    stacked = [torch.stack(ts) for ts in zip(*(r.stored() for _, r in loop))]
    ys = torch.stack([yi for yi, _ in loop])
    got = rec.stored()
    return (
        torch.allclose(y, ys, atol=ATOL)
        and len(got) == len(stacked)
        and all(a.shape == b.shape and torch.allclose(a, b, atol=ATOL) for a, b in zip(got, stacked))
    )


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    payload: dict[str, Any] = {"quick": args.quick, "conditions": conditions}
    if not hasattr(fh, "capture"):
        print("bench_vmap: skipped, this funhooks has no `fh.capture` yet.")
        _common.write(NAME, args.out, {**payload, "skipped": "funhooks has no `capture`", "correct": None, "results": {}})
        return
    torch.manual_seed(0)
    batch = QUICK_BATCH if args.quick else BATCH
    model = _common.deep_narrow(depth=QUICK_DEPTH if args.quick else _common.DEEP_NARROW_DEPTH).to(args.device)
    x = torch.randn(batch, _common.DEEP_NARROW_WIDTH, device=args.device)
    f = fh.capture(model, fh.outputs("**"))
    vmapped = torch.func.vmap(f)
    with torch.no_grad():
        correct = check(f, x)
        _common.check(correct, "vmap record != stacked per-example records")
        cases = {"loop": lambda: [f(xi) for xi in x], "vmap": lambda: vmapped(x)}
        timed = _common.time_cases(cases, baseline="loop", rounds=args.rounds, warmup=args.warmup, inner=args.inner, clock=args.clock,
                                     sync=_common.synchronizer(args.device))
    print(_common.format_table(f"deep-narrow, {batch} examples (ratio: time / loop time)", timed))
    speedup = 1 / timed["vmap"]["ratio"]["median"]
    print(f"vmap speed-up over the loop: {speedup:.1f}x")
    path = _common.write(NAME, args.out, {
        **payload, "rounds": args.rounds, "warmup": args.warmup, "correct": correct,
        "results": {"deep-narrow": {"batch": batch, "cases": timed, "speedup": speedup}},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
