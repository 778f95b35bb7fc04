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

**Llama, against nnsight** (issue 36): the same estimate on a small Llama under SDPA, every
``resid_pre``, in bare forward passes of the corrupted prompt:

- ``hand-written hooks + autograd.grad``: the floor, plain forward hooks keeping each point's
  clean and corrupted values, ``torch.autograd.grad`` of the metric with respect to the
  corrupted ones (no weight gradients);
- ``fh attribution_patching, module paths``: the modules holding ``resid_pre`` (this case runs
  on every funhooks with attribution patching, so a checkout before and after a change can be
  compared);
- ``fh attribution_patching, pts.resid_pre``: the standard point (where the checkout has it);
- ``nnsight trace + backward``: nnsight's idiom (a trace of the clean prompt saving the
  outputs, a trace of the corrupted one saving them and, in ``with metric.backward():``, their
  gradients), where nnsight is installed.

Every table is checked against the floor's before anything is timed.

Run: ``python benchmarks/bench_atp.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import copy
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
import transformers

import _common
import bench_patch
import funhooks as fh

NAME = "atp"
LLAMA = {"layers": 4, "hidden": 128, "heads": 4, "kv_heads": 2, "intermediate": 256, "vocab": 512, "positions": 16}
LLAMA_QUICK = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "intermediate": 64, "vocab": 64, "positions": 5}
LLAMA_TOKENS = (7, 8)


def llama(size: dict[str, int]) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"], num_hidden_layers=size["layers"],
        intermediate_size=size["intermediate"], max_position_embeddings=64, attn_implementation="sdpa")).eval()


def llama_metric(out: Any) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return logits[..., -1, LLAMA_TOKENS[0]] - logits[..., -1, LLAMA_TOKENS[1]]


def _module(model: torch.nn.Module, path: str) -> Any:
    return functools.reduce(lambda m, name: m[int(name)] if name.isdigit() else getattr(m, name), path.split("."),
                            model)


def _hand_atp(model: torch.nn.Module, paths: list[str], clean: torch.Tensor,
              corrupt: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The floor: forward hooks keep each point's value; the clean run without gradients, the
    corrupted one with, ``torch.autograd.grad`` with respect to the corrupted values only."""
    modules = [model.get_submodule(p) for p in paths]

    def call() -> torch.Tensor:
        seen: list[torch.Tensor] = []

        def keep(module: torch.nn.Module, args: Any, output: Any) -> None:
            seen.append(output[0] if isinstance(output, tuple) else output)

        handles = [m.register_forward_hook(keep) for m in modules]
        try:
            with torch.no_grad():
                model(clean)
            clean_values, seen[:] = list(seen), []
            with torch.enable_grad():
                grads = torch.autograd.grad(llama_metric(model(corrupt)).sum(), seen)
        finally:
            for h in handles:
                h.remove()
        return torch.stack([((c - v.detach()) * g).sum((0, 2)) for c, v, g in zip(clean_values, seen, grads)])

    return call


def _nnsight_atp(model: torch.nn.Module, paths: list[str], clean: torch.Tensor,
                 corrupt: torch.Tensor) -> Callable[[], torch.Tensor]:
    """nnsight's attribution patching: two traces, the gradients read in a backward trace."""
    import nnsight

    # NNsight installs its own forwards on the model it wraps, for good: a copy keeps them off the other cases
    wrapped = nnsight.NNsight(copy.deepcopy(model))
    envoys = [_module(wrapped, p) for p in paths]

    def call() -> torch.Tensor:
        with torch.no_grad(), wrapped.trace(clean):
            clean_values = nnsight.save([])
            for envoy in envoys:
                clean_values.append(envoy.output)
        with torch.enable_grad(), wrapped.trace(corrupt):
            values = [envoy.output for envoy in envoys]
            corrupt_values, grads = nnsight.save([]), nnsight.save([])
            for value in values:
                corrupt_values.append(value)
            metric = llama_metric(wrapped.lm_head.output).sum()
            with metric.backward():
                for value in reversed(values):
                    grads.append(value.grad)
        return torch.stack([((c - v.detach()) * g).sum((0, 2))
                            for c, v, g in zip(clean_values, corrupt_values, reversed(grads))])

    return call


def llama_cases(model: torch.nn.Module, clean: torch.Tensor,
                corrupt: torch.Tensor) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """(the cases, each estimate's table checked against the floor; name -> why a case is left out)."""
    paths = [p for _, p in fh.transformer.points(model).resid_pre.paths]
    floor = _hand_atp(model, paths, clean, corrupt)
    by_path = fh.attribution_patching(model, paths, llama_metric)
    cases: dict[str, Callable[[], Any]] = {
        "bare forward (corrupted)": lambda: model(corrupt),
        "hand-written hooks + autograd.grad": floor,
        "fh attribution_patching, module paths": lambda: by_path(clean, corrupt).table,
    }
    left_out: dict[str, str] = {}
    try:
        by_point = fh.attribution_patching(model, fh.transformer.points(model).resid_pre, llama_metric)
        by_point(clean, corrupt)
        cases["fh attribution_patching, pts.resid_pre"] = lambda: by_point(clean, corrupt).table
    except (fh.SelectorError, fh.SpecError) as error:  # a checkout from before standard points were supported
        left_out["fh attribution_patching, pts.resid_pre"] = str(error)
    if importlib.util.find_spec("nnsight") is not None:
        cases["nnsight trace + backward"] = _nnsight_atp(model, paths, clean, corrupt)
    else:
        left_out["nnsight trace + backward"] = "nnsight is not installed"
    reference = floor()
    for name, case in cases.items():
        if name != "bare forward (corrupted)":
            _common.check(torch.allclose(case(), reference, atol=1e-6, rtol=1e-4),
                          f"{name}: the table differs from the hand-written floor's")
    return cases, left_out


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
        size_llama = LLAMA_QUICK if args.quick else LLAMA
        model_llama = llama(size_llama)
        clean_llama = torch.randint(0, size_llama["vocab"], (1, size_llama["positions"]))
        corrupt_llama = clean_llama.clone()
        middle = size_llama["positions"] // 2
        corrupt_llama[0, middle] = (corrupt_llama[0, middle] + 1) % size_llama["vocab"]
        cases_llama, left_out = llama_cases(model_llama, clean_llama, corrupt_llama)
        checks["llama tables == hand-written floor"] = True  # `llama_cases` stops the run otherwise
        on_llama = _common.time_cases(cases_llama, baseline="bare forward (corrupted)", **timing)
    patches = size["layers"] * size["positions"]
    print(_common.format_table(f"{patches} patches: sweep vs attribution patching (ratio: time / python loop)", swept))
    print(f"correlation of the estimate with the real table: {correlation:.4f}")
    print(_common.format_table("attribution patching in forward passes (ratio: time / bare forward)", passes))
    print(_common.format_table("Llama, every resid_pre: attribution patching in forward passes (ratio: time / bare "
                               "forward)", on_llama))
    for name, why in left_out.items():
        print(f"left out: {name}: {why}")
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "model": size, "correct": all(checks.values()), "checks": checks,
        "results": {"sweep": {"patches": patches, "cases": swept, "correlation": correlation},
                    "forward_passes": {"points": size["layers"] + 1, "cases": passes},
                    "llama": {"model": size_llama, "points": size_llama["layers"], "cases": on_llama,
                              "left_out": left_out}},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
