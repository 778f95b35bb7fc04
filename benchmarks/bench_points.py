"""Standard points cost what the module paths cost: each point against the path spec doing the same job.

Issue 28's check, on its model: GPT-2 from a config (random weights, n_embd 64, 4 layers, 4
heads, vocabulary 100), a batch of 8 x 12 tokens, eval mode, ``torch.no_grad()``. Cases, all
against the bare forward of the same round:

- ``bare``: the forward alone, the baseline of the ratios;
- a module point: ``fh.capture(model, fh.outputs("transformer.h.*"))`` (the paths) vs
  ``fh.capture(model, fh.outputs(pts.resid_post))`` (the point, ``pts =
  fh.transformer.points(model)``). A module point makes the very spec its path makes, so the
  target is points / paths <= 1.02;
- a view point: ``fh.capture(model, fh.inputs("transformer.h.*.attn.c_proj"))`` (the paths:
  the output projections' inputs, the honest hand-written spec doing the same job) vs
  ``fh.capture(model, fh.outputs(pts.z))``. The point additionally reshapes each value to heads,
  ``(batch, position, head, d_head)`` (a view, no copy), so its ratio is reported, not held to
  the 1.02 target.

Each pair's Records are checked equal before timing (the z pair after reshaping the paths'
values to heads). The ``points / paths`` ratio of a pair is the point's median ratio to the bare
forward over the paths' (each ratio taken within its round).

Attention patterns (issue 36 item 23), timed apart in the same run against the same bare (SDPA,
Hugging Face's default) forward: ``bare eager`` (a copy of the model switched to
``attn_implementation="eager"``, what an nnsight user does to read patterns), and every layer's
``pts.pattern`` recorded under SDPA and under eager. The goal: the pattern under SDPA costs at
most the bare eager forward + 5% (``pattern_sdpa_to_bare_eager`` <= 1.05). The patterns are
checked equal under both before timing, and the outputs: under eager equal to the bare eager
forward's; under SDPA, where a recorded attention call runs as eager attention, equal to the
bare eager forward's too (and to the bare SDPA one's to float rounding). The same pattern cases
again on a longer sequence (``LONGER``: n_embd 256, 8 heads, 6 layers, batch 4 x 128, 15
rounds; the smoke run keeps issue 28's model there), where the capture's fixed per-call cost
matters less.

Run: ``python benchmarks/bench_points.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

import _common
import funhooks as fh

NAME = "points"
MODEL = {"layers": 4, "width": 64, "heads": 4, "vocab": 100, "positions": 32, "batch": 8, "length": 12}
"""Issue 28's model and batch (the smoke run uses it too: it is small)."""
TARGET = 1.02
"""Issue 28: a module point costs at most this times its module path."""
BLOCKS = "transformer.h.*"
C_PROJ = "transformer.h.*.attn.c_proj"
RESID_PATHS = "fh.capture outputs(transformer.h.*)"
RESID_POINTS = "fh.capture outputs(pts.resid_post)"
Z_PATHS = "fh.capture inputs(h.*.attn.c_proj)"
Z_POINTS = "fh.capture outputs(pts.z)"
PAIRS = {"resid_post": (RESID_POINTS, RESID_PATHS), "z": (Z_POINTS, Z_PATHS)}
"""Pair name -> (the point's case, the paths' case)."""
BARE_EAGER = "bare eager"
PATTERN_SDPA = "fh.capture outputs(pts.pattern), SDPA"
PATTERN_EAGER = "fh.capture outputs(pts.pattern), eager"
PATTERN_GOAL = 1.05
"""Issue 36 item 23: every layer's pattern under SDPA costs at most this times the bare eager forward."""
LONGER = {"layers": 6, "width": 256, "heads": 8, "vocab": 1000, "positions": 256, "batch": 4, "length": 128}
"""A longer sequence for the pattern cases (not in the smoke run)."""
LONGER_ROUNDS = 15


def gpt2(size: dict[str, int]) -> torch.nn.Module:
    """The small GPT-2 of issue 28: random weights from a config, no download, eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=size["vocab"], n_embd=size["width"], n_head=size["heads"],
                                     n_layer=size["layers"], n_positions=size["positions"])
    return transformers.GPT2LMHeadModel(config).eval()


def _bound(f: Callable[..., Any], x: torch.Tensor) -> Callable[[], Any]:
    return lambda: f(x, use_cache=False)


def _first(value: Any) -> torch.Tensor:
    """A module's output as a tensor: element 0 of a tuple (a block's output, in some versions)."""
    return value[0] if isinstance(value, tuple) else value


def specs(model: torch.nn.Module) -> dict[str, fh.Spec]:
    """The four specs: case name -> spec."""
    pts = fh.transformer.points(model)
    return {RESID_PATHS: fh.outputs(BLOCKS), RESID_POINTS: fh.outputs(pts.resid_post),
            Z_PATHS: fh.inputs(C_PROJ), Z_POINTS: fh.outputs(pts.z)}


def cases(model: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """Name -> call: the bare forward and a ``fh.capture`` per spec (built per round)."""

    def captured(spec: fh.Spec) -> _common.PerRound:
        return _common.PerRound(lambda: _bound(fh.capture(model, spec), x))

    return {"bare": lambda: model(x, use_cache=False), **{name: captured(s) for name, s in specs(model).items()}}


def check_records(model: torch.nn.Module, x: torch.Tensor, layers: int, heads: int) -> dict[str, bool]:
    """Each pair records the same tensors: resid_post == the blocks' outputs; z == the output
    projections' first positional inputs (``fh.inputs`` stores ``(args, kwargs)``) split into heads. Every case's output equals the bare forward's."""
    bare = model(x, use_cache=False).logits
    out, rec = {}, {}
    for name, spec in specs(model).items():
        y, rec[name] = fh.capture(model, spec)(x, use_cache=False)
        out[name] = torch.equal(y.logits, bare)
    resid = [(_first(rec[RESID_PATHS][f"transformer.h.{L}"]["output"]), rec[RESID_POINTS][f"blocks.{L}.resid_post"]["output"])
             for L in range(layers)]
    z = [(rec[Z_PATHS][f"transformer.h.{L}.attn.c_proj"]["input"][0][0].unflatten(-1, (heads, -1)),
          rec[Z_POINTS][f"blocks.{L}.z"]["output"]) for L in range(layers)]
    return {
        "resid_post == outputs(transformer.h.*)": len(rec[RESID_POINTS]) == layers and _common.tensors_equal(*zip(*resid)),
        "z == inputs(c_proj) split into heads": len(rec[Z_POINTS]) == layers and _common.tensors_equal(*zip(*z)),
        "every case's output == the bare forward's": all(out.values()),
    }


def pattern_cases(model: torch.nn.Module, eager: torch.nn.Module, x: torch.Tensor) -> dict[str, Any]:
    """The bare (SDPA) and bare eager forwards, and every layer's pattern recorded under each."""

    def pattern(m: torch.nn.Module) -> _common.PerRound:
        return _common.PerRound(lambda: _bound(fh.capture(m, fh.outputs(fh.transformer.points(m).pattern)), x))

    return {"bare": lambda: model(x, use_cache=False), BARE_EAGER: lambda: eager(x, use_cache=False),
            PATTERN_SDPA: pattern(model), PATTERN_EAGER: pattern(eager)}


def check_patterns(model: torch.nn.Module, eager: torch.nn.Module, x: torch.Tensor, layers: int) -> dict[str, bool]:
    """The patterns under SDPA equal eager's (``output_attentions``); recording changes neither output."""
    bare, bare_eager = model(x, use_cache=False), eager(x, use_cache=False, output_attentions=True)
    out, rec = fh.capture(model, fh.outputs(fh.transformer.points(model).pattern))(x, use_cache=False)
    eager_out, eager_rec = fh.capture(eager, fh.outputs(fh.transformer.points(eager).pattern))(x, use_cache=False)
    got = [rec[f"blocks.{L}.pattern"]["output"] for L in range(layers)]
    want = [eager_rec[f"blocks.{L}.pattern"]["output"] for L in range(layers)]
    return {
        "pattern under SDPA == eager's": len(got) == layers and all(
            torch.allclose(g, w, atol=1e-6) for g, w in zip(got, want)),
        "pattern under eager == output_attentions": _common.tensors_equal(want, list(bare_eager.attentions)),
        "recording a pattern under eager changes no output": torch.equal(eager_out.logits, bare_eager.logits),
        "recording a pattern under SDPA gives the eager forward's output": torch.equal(out.logits, bare_eager.logits)
        and torch.allclose(out.logits, bare.logits, atol=1e-5),
    }


def ratios(timed: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Pair name -> points / paths: the ratio of the two cases' medians of their ratios to the bare forward."""
    return {pair: timed[point]["ratio"]["median"] / timed[path]["ratio"]["median"]
            for pair, (point, path) in PAIRS.items()}


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    size = MODEL
    model = gpt2(size)
    x = torch.randint(0, size["vocab"], (size["batch"], size["length"]))
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock}
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        checks = check_records(model, x, size["layers"], size["heads"])
        checks.update(check_patterns(model, eager, x, size["layers"]))
        _common.check(all(checks.values()), f"Records differ: {checks}")
        timed = _common.time_cases(cases(model, x), baseline="bare", **timing)
        patterns = _common.time_cases(pattern_cases(model, eager, x), baseline="bare", **timing)
        longer_size = size if args.quick else LONGER
        longer = gpt2(longer_size)
        longer_eager = copy.deepcopy(longer)
        longer_eager.set_attn_implementation("eager")
        lx = torch.randint(0, longer_size["vocab"], (longer_size["batch"], longer_size["length"]))
        longer_checks = check_patterns(longer, longer_eager, lx, longer_size["layers"])
        _common.check(all(longer_checks.values()), f"Records differ on the longer sequence: {longer_checks}")
        longer_timing = {**timing, "rounds": args.rounds if args.quick else LONGER_ROUNDS}
        longer_patterns = _common.time_cases(pattern_cases(longer, longer_eager, lx), baseline="bare", **longer_timing)
    per_pair = ratios(timed)
    to_eager = patterns[PATTERN_SDPA]["ratio"]["median"] / patterns[BARE_EAGER]["ratio"]["median"]
    longer_to_eager = (longer_patterns[PATTERN_SDPA]["ratio"]["median"]
                       / longer_patterns[BARE_EAGER]["ratio"]["median"])
    print(_common.format_table(f"issue 28's GPT-2, batch {tuple(x.shape)} (ratio: time / bare forward)", timed))
    print(f"points / paths, resid_post: {per_pair['resid_post']:.3f}x (target <= {TARGET})")
    print(f"points / paths, z (the point also reshapes to heads): {per_pair['z']:.3f}x")
    print(_common.format_table("attention patterns (ratio: time / bare SDPA forward)", patterns))
    print(f"pattern under SDPA / bare eager forward: {to_eager:.3f}x (goal <= {PATTERN_GOAL})")
    print(_common.format_table(f"attention patterns, batch {tuple(lx.shape)}, {longer_size['layers']} layers "
                               f"of width {longer_size['width']} (ratio: time / bare SDPA forward)", longer_patterns))
    print(f"longer sequence, pattern under SDPA / bare eager forward: {longer_to_eager:.3f}x")
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "model": size, "correct": all(checks.values()), "checks": checks,
        "results": {"batch": list(x.shape), "cases": timed, "points_to_paths": per_pair, "target": TARGET,
                    "patterns": patterns, "pattern_sdpa_to_bare_eager": to_eager, "pattern_goal": PATTERN_GOAL,
                    "longer": {"model": longer_size, "batch": list(lx.shape), "checks": longer_checks,
                               "patterns": longer_patterns, "pattern_sdpa_to_bare_eager": longer_to_eager}},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
