"""A compiled hooked forward vs the compiled bare forward.

The model is compiled once (``compiled = torch.compile(model)``), before any run, then:

- ``compiled bare``: ``compiled(x)``;
- ``fh.with_hooks on compiled``: ``with fh.with_hooks(compiled, fh.outputs("**")) as run:
  compiled(x)`` and ``run.record`` (dynamo recompiles once for the active run and reuses it);
- ``eager bare``, for scale;
- then, apart: ``compiled fh.capture`` (``torch.compile(fh.capture(model, fh.outputs("**")))``,
  when funhooks has ``capture``) against ``compiled bare (capture alive)``, measured beside it
  (older funhooks versions kept global hooks installed while a capture function lived);
- then a copy of the model compiled in place (``model.compile()``):
  ``compiled in place, bare`` and ``fh.with_hooks on compiled in place``;
- residue: an unrelated eager model's bare forward, timed before anything else and again
  after the runs on the compiled model (``unrelated bare, after / before``): what the runs
  left in the process (older funhooks versions left a global hook for good).

Checked before timing, after the compiled model already ran bare (as a user would): outputs
and stored tensors equal the eager ones (to float tolerance). A case that fails its check
is reported (``failures`` in the JSON, ``correct: false``) and left out of the timing.
The model is a shorter deep-narrow MLP (16 x (Linear(64, 64), ReLU), batch 32) so the
compile itself stays short. ``--quick`` uses dynamo's ``eager`` backend (no inductor) and
4 layers.

Run: ``python benchmarks/bench_compile.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import _common
import funhooks as fh

NAME = "compile"
DEPTH = 16
QUICK_DEPTH = 4
ATOL = 1e-5
MESSAGE_CHARS = 300
"""How much of a failing case's error message the result keeps."""


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.allclose(x, y, atol=ATOL) for x, y in zip(a, b))


def _check(name: str, call: Callable[[], Any], y_ref: torch.Tensor, ref: list, failures: dict[str, str]) -> bool:
    """Run one hooked case once; record why it fails (an exception or wrong values)."""
    try:
        y, rec = call()
        stored = rec.stored()
    except Exception as err:  # reported and left out of the timing, never hidden
        failures[name] = f"{type(err).__name__}: {str(err)[:MESSAGE_CHARS]}"
        return False
    if torch.allclose(y, y_ref, atol=ATOL) and _close(stored, ref):
        return True
    failures[name] = f"stored {len(stored)} of {len(ref)} module outputs, or values differ"
    return False


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    backend = "eager" if args.quick else "inductor"
    torch.manual_seed(0)
    model = _common.deep_narrow(depth=QUICK_DEPTH if args.quick else DEPTH).to(args.device)
    x = torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH, device=args.device)
    spec = fh.outputs("**")
    compiled = torch.compile(model, backend=backend)
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock,
              "sync": _common.synchronizer(args.device)}

    def hooked() -> tuple[Any, fh.Record]:
        with fh.with_hooks(compiled, spec) as run:
            y = compiled(x)
        return y, run.record

    results: dict[str, Any] = {}
    failures: dict[str, str] = {}
    with torch.no_grad():
        y_ref = model(x)
        with fh.with_hooks(model, spec) as run:
            model(x)
        ref = run.record.stored()
        other = _common.deep_narrow(depth=QUICK_DEPTH if args.quick else DEPTH).to(args.device)
        residue = {"before": _common.time_cases({"unrelated bare": lambda: other(x)}, baseline="unrelated bare", **timing)}
        # Phase 1, nothing else alive: the compiled model runs bare first, as a user's would.
        checks: dict[str, bool] = {"compiled bare": torch.allclose(compiled(x), y_ref, atol=ATOL)}
        checks["fh.with_hooks on compiled"] = _check("fh.with_hooks on compiled", hooked, y_ref, ref, failures)
        checks["bare after runs"] = torch.allclose(compiled(x), y_ref, atol=ATOL)
        fh.testing.assert_no_hooks(model)
        _common.check(checks["compiled bare"] and checks["bare after runs"], f"{checks}")
        cases: dict[str, Callable[[], Any]] = {"compiled bare": lambda: compiled(x), "eager bare": lambda: model(x)}
        if checks["fh.with_hooks on compiled"]:
            cases["fh.with_hooks on compiled"] = hooked
        results["with_hooks"] = _common.time_cases(cases, baseline="compiled bare", **timing)
        print(_common.format_table(f"deep-narrow {len(ref)} modules, backend {backend}", results["with_hooks"]))
        residue["after"] = _common.time_cases({"unrelated bare": lambda: other(x)}, baseline="unrelated bare", **timing)
        before, after = (residue[k]["unrelated bare"]["seconds"]["median"] for k in ("before", "after"))
        results["residue"] = {"unrelated bare, after / before": after / before}
        print(f"unrelated eager bare after the runs on the compiled model: {after / before:.3f}x its time before them")
        # Phase 2: a live capture function gets its own baseline, measured while it is alive.
        if hasattr(fh, "capture"):
            compiled_capture = torch.compile(fh.capture(model, spec), backend=backend)
            checks["compiled fh.capture"] = _check("compiled fh.capture", lambda: compiled_capture(x), y_ref, ref, failures)
            cases = {"compiled bare (capture alive)": lambda: compiled(x)}
            if checks["compiled fh.capture"]:
                cases["compiled fh.capture"] = lambda: compiled_capture(x)
            results["capture"] = _common.time_cases(cases, baseline="compiled bare (capture alive)", **timing)
            print(_common.format_table("compiled capture", results["capture"]))
            del compiled_capture
        # Phase 3: a copy of the model compiled in place, by `model.compile()`.
        in_place = copy.deepcopy(model)
        in_place.compile(backend=backend)

        def hooked_in_place() -> tuple[Any, fh.Record]:
            with fh.with_hooks(in_place, spec) as run:
                y = in_place(x)
            return y, run.record

        _common.check(torch.allclose(in_place(x), y_ref, atol=ATOL), "the model compiled in place computes otherwise")
        cases = {"compiled in place, bare": lambda: in_place(x)}
        if _check("fh.with_hooks on compiled in place", hooked_in_place, y_ref, ref, failures):
            cases["fh.with_hooks on compiled in place"] = hooked_in_place
        results["in place"] = _common.time_cases(cases, baseline="compiled in place, bare", **timing)
        print(_common.format_table("model.compile()", results["in place"]))
    for name, why in failures.items():
        print(f"bench_compile: {name!r} failed its check and was not timed: {why}")
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "backend": backend, "rounds": args.rounds,
        "warmup": args.warmup, "correct": not failures, "checks": checks, "failures": failures,
        "results": {"deep-narrow": {"modules_hooked": len(ref), "cases": {k: v for r in results.values() if isinstance(r, dict)
                                                                          for k, v in r.items() if isinstance(v, dict)}},
                    "residue": results["residue"]},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
