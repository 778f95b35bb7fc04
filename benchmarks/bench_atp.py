"""Attribution patching: every patch of a sweep estimated in about 3 forward passes.

The sweep of ``bench_patch.py`` (``resid_pre`` of a small HF GPT-2 at each layer and position,
``LAYERS x POSITIONS = 32`` patches, the logit difference of two tokens) against
``fh.attribution_patching`` on the same points, which estimates all of them from one clean
forward and one corrupted forward + backward. Cases, each returning a ``(layer, position)``
table:

- ``python loop``: one ``fh.capture`` call per patch, the baseline of the ratios;
- ``fh vmap``: ``torch.func.vmap`` over the 32 patches, one call;
- ``fh per-row patch (one batched forward)``: the 32 patches as the rows of one batch (``per_row=True``);
- ``fh attribution_patching``: the estimate of the same table (minus the corrupted metric).

Checked before timing: the loop and vmap tables are equal; the estimate's Pearson correlation
with the real table is reported (and must be positive, a sanity bound only).

**Forward passes.** The same AtP call against the bare corrupted forward, with all
``1 + LAYERS`` points and with one point: the ratio is the cost in forward passes, which
should stay near 3 (a forward without gradients, a forward and a backward) whatever the
number of points.

Run: ``python benchmarks/bench_atp.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import _common
import bench_patch
import funhooks as fh

NAME = "atp"


def atp_cases(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor,
              layers: int) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, Callable[[], Any]]]:
    """(the table cases beside the sweep's, the forward-pass cases)."""
    def metric(out: Any) -> torch.Tensor:
        return bench_patch.logit_diff(out.logits)

    every = fh.attribution_patching(model, bench_patch.RESID_PRE, metric)
    one = fh.attribution_patching(model, "transformer.drop", metric)

    def estimate() -> torch.Tensor:
        return every(clean, corrupt, use_cache=False).table[:layers]

    forward = {"bare forward (corrupted)": lambda: model(corrupt, use_cache=False),
               f"fh attribution_patching, {layers + 1} points": estimate,
               "fh attribution_patching, 1 point": lambda: one(clean, corrupt, use_cache=False)}
    return {"fh attribution_patching": estimate}, forward


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    q = bench_patch.QUICK
    size = ({"layers": q["layers"], "width": q["width"], "heads": q["heads"], "positions": q["positions"]} if args.quick
            else {"layers": bench_patch.LAYERS, "width": bench_patch.WIDTH, "heads": bench_patch.HEADS,
                  "positions": bench_patch.POSITIONS})
    torch.manual_seed(0)
    model = bench_patch.gpt2(size["layers"], size["width"], size["heads"])
    clean = torch.randint(0, bench_patch.VOCAB, (1, size["positions"]))
    corrupt = clean.clone()
    corrupt[0, size["positions"] // 2] = (corrupt[0, size["positions"] // 2] + 1) % bench_patch.VOCAB
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock}
    with torch.no_grad():
        sweeps = bench_patch.sweep_cases(model, clean, corrupt, size["layers"], size["positions"], peers=False)
        reference = sweeps["python loop"]()
        checks = {"vmap == loop": bool(torch.allclose(sweeps["fh vmap"](), reference, atol=bench_patch.ATOL))}
        _common.check(checks["vmap == loop"], "the vmapped sweep differs from the loop")
        estimates, forward = atp_cases(model, clean, corrupt, size["layers"])
        corrupt_metric = bench_patch.logit_diff(model(corrupt, use_cache=False).logits[0])
        real = (reference - corrupt_metric).flatten()
        correlation = float(torch.corrcoef(torch.stack([real, estimates["fh attribution_patching"]().flatten()]))[0, 1])
        checks["correlation > 0"] = correlation > 0
        _common.check(checks["correlation > 0"], f"the estimate does not correlate with the sweep: {correlation}")
        swept = _common.time_cases({**sweeps, **estimates}, baseline="python loop", **timing)
        passes = _common.time_cases(forward, baseline="bare forward (corrupted)", **timing)
    patches = size["layers"] * size["positions"]
    print(_common.format_table(f"{patches} patches: sweep vs attribution patching (ratio: time / python loop)", swept))
    print(f"correlation of the estimate with the real table: {correlation:.4f}")
    print(_common.format_table("attribution patching in forward passes (ratio: time / bare forward)", passes))
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "model": size, "correct": all(checks.values()), "checks": checks,
        "results": {"sweep": {"patches": patches, "cases": swept, "correlation": correlation},
                    "forward_passes": {"points": size["layers"] + 1, "cases": passes}},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
