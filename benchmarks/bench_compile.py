"""A compiled hooked forward vs the compiled bare forward.

The model is compiled once (``compiled = torch.compile(model)``), before any run, then:

- ``compiled bare``: ``compiled(x)``;
- ``fh.with_hooks on compiled``: ``with fh.with_hooks(compiled, fh.outputs("**")) as run:
  compiled(x)`` and ``run.record`` (dynamo recompiles once for the active run and reuses it);
- ``compiled fh.capture``: ``torch.compile(fh.capture(model, fh.outputs("**")))`` (when
  funhooks has ``capture``);
- ``eager bare``, for scale.

Checked before timing, after the compiled model already ran bare (as a user would): outputs
and stored tensors equal the eager ones (to float tolerance). A case that fails its check
is reported (``failures`` in the JSON, ``correct: false``) and left out of the timing.
The model is a shorter deep-narrow MLP (16 x (Linear(64, 64), ReLU), batch 32) so the
compile itself stays short. ``--quick`` uses dynamo's ``eager`` backend (no inductor) and
4 layers.

Run: ``python benchmarks/bench_compile.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import _common
import funhooks as fh

NAME = "compile"
DEPTH = 16
QUICK_DEPTH = 4
ATOL = 1e-5


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, atol=ATOL) for x, y in zip(a, b))


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    backend = "eager" if args.quick else "inductor"
    torch.manual_seed(0)
    model = _common.deep_narrow(depth=QUICK_DEPTH if args.quick else DEPTH)
    x = torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)
    spec = fh.outputs("**")
    compiled = torch.compile(model, backend=backend)

    def hooked() -> tuple[Any, fh.Record]:
        with fh.with_hooks(compiled, spec) as run:
            y = compiled(x)
        return y, run.record

    cases: dict[str, Callable[[], Any]] = {"compiled bare": lambda: compiled(x), "fh.with_hooks on compiled": hooked}
    if hasattr(fh, "capture"):
        compiled_capture = torch.compile(fh.capture(model, spec), backend=backend)
        cases["compiled fh.capture"] = lambda: compiled_capture(x)
    cases["eager bare"] = lambda: model(x)

    with torch.no_grad():
        y_ref = model(x)
        with fh.with_hooks(model, spec) as run:
            model(x)
        ref = run.record.stored()
        checks: dict[str, bool] = {"compiled bare": torch.allclose(compiled(x), y_ref, atol=ATOL)}
        failures: dict[str, str] = {}
        for name in ("fh.with_hooks on compiled", "compiled fh.capture"):
            if name not in cases:
                continue
            try:  # called after the bare compiled model ran, as a user would
                y, rec = cases[name]()
                stored = rec.stored()
            except Exception as err:  # reported and left out of the timing, never hidden
                checks[name], failures[name] = False, f"{type(err).__name__}: {str(err)[:300]}"
                continue
            checks[name] = torch.allclose(y, y_ref, atol=ATOL) and _close(stored, ref)
            if not checks[name]:
                failures[name] = f"stored {len(stored)} of {len(ref)} module outputs, or values differ"
        checks["bare after runs"] = torch.allclose(compiled(x), y_ref, atol=ATOL)
        fh.testing.assert_no_hooks(model)
        for name, why in failures.items():
            print(f"bench_compile: {name!r} failed its check and is not timed: {why}")
            del cases[name]
        _common.check(checks["compiled bare"] and checks["bare after runs"], f"{checks}")
        timed = _common.time_cases(cases, baseline="compiled bare", rounds=args.rounds, warmup=args.warmup, inner=args.inner, clock=args.clock)
    print(_common.format_table(f"deep-narrow {len(_common.hooked_modules(model))} modules, backend {backend}", timed))
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "backend": backend, "rounds": args.rounds,
        "warmup": args.warmup, "correct": not failures, "checks": checks, "failures": failures,
        "results": {"deep-narrow": {"modules_hooked": len(_common.hooked_modules(model)), "cases": timed}},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
