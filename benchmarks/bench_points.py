"""A standard point costs what the module path costs: ``fh.capture(model,
fh.outputs(pts.resid_post))`` against ``fh.outputs`` of the blocks' paths, and against the bare
forward, on GPT-2 (n_embd=64, 4 layers, 4 heads, batch 8 x 12 tokens, eval, no_grad). Target
(issue 28): points <= 1.02x paths. Ratios come from one run, medians of interleaved rounds;
the Records of both are checked equal before timing.

Run: ``python benchmarks/bench_points.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

import funhooks as fh

transformers.logging.set_verbosity_error()


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_embd=64, n_head=4, n_layer=4, n_positions=32)
    return transformers.GPT2LMHeadModel(config).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few rounds")
    quick = parser.parse_args().quick
    model, ids = _model(), torch.randint(0, 100, (8, 12))
    pts = fh.transformer.points(model)
    cases = {
        "bare": lambda: model(ids, use_cache=False),
        "fh.outputs(module paths)": fh.capture(model, fh.outputs("transformer.h.*")),
        "fh.outputs(pts.resid_post)": fh.capture(model, fh.outputs(pts.resid_post)),
    }
    with torch.no_grad():
        _, by_path = cases["fh.outputs(module paths)"](ids, use_cache=False)
        _, by_point = cases["fh.outputs(pts.resid_post)"](ids, use_cache=False)
        assert all(torch.equal(by_path[f"transformer.h.{L}"]["output"], by_point[f"blocks.{L}.resid_post"]["output"])
                   for L in range(4))
        rounds, calls = (5, 5) if quick else (31, 50)
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, f in cases.items():
                start = time.perf_counter()
                for _ in range(calls):
                    f(ids, use_cache=False) if name != "bare" else f()
                times[name].append((time.perf_counter() - start) / calls)
    bare = statistics.median(times["bare"])
    for name, ts in times.items():
        print(f"{name:28s} {statistics.median(ts) * 1e6:9.1f} us  {statistics.median(ts) / bare:5.2f}x bare")
    ratio = statistics.median(times["fh.outputs(pts.resid_post)"]) / statistics.median(times["fh.outputs(module paths)"])
    print(f"points / paths: {ratio:.3f}x (target <= 1.02x)")


if __name__ == "__main__":
    main()
