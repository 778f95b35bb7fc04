"""A spliced SAE against the same matmuls written by hand in a forward hook.

An SAE (ReLU, ``d_sae = 8 x width``) at block 1's output (``pts.resid_post[1]``) of a small HF
GPT-2 (random weights from a config). Three pairs, each a funhooks case and its hand-written
floor, a ``register_forward_hook`` on the block doing the same encode / decode / error-term
matmuls and keeping the features in a list:

- ``record``: ``fh.sae.splice(pt, sae)``, the features recorded, the output untouched (one
  encode) / a hook storing ``sae.encode(x)``;
- ``ablate``: ``fh.sae.splice(pt, sae, edit=fh.sae.ablate(FEATURES))`` (one encode, two decodes,
  the error term) / a hook computing ``f = encode(x)``, ``g = f`` with the features zeroed,
  ``x + decode(g) - decode(f)``;
- ``reconstruction``: ``error=False`` (one encode, one decode) / a hook returning
  ``decode(encode(x))``;
- and for reference, no SAE: ``output``, ``fh.capture(fh.outputs(pt))`` / a hook keeping the
  block's output: what a capture costs over a hand hook by itself.

Each case's output and features are checked equal to its floor's before timing. The target
(issue 38): a spliced SAE costs its own matmuls plus at most 5% over the bare forward with the
same matmuls written by hand: per pair, ``funhooks / hand`` of the medians of the ratios to the
bare forward, all measured in the same interleaved rounds, is at most ``TARGET`` (reported too:
``funhooks - hand`` of those medians, the extra cost as a fraction of the bare forward).

Model: GPT-2 with 4 layers, width 128, 4 heads, vocabulary 512, a batch of 8 x 32 tokens;
eval mode, ``torch.no_grad()``.

Run: ``python benchmarks/bench_sae.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _common
import funhooks as fh

NAME = "sae"
MODEL = {"layers": 4, "width": 128, "heads": 4, "vocab": 512, "positions": 64, "batch": 8, "length": 32}
QUICK_MODEL = {**MODEL, "layers": 2, "width": 32, "batch": 2, "length": 8}
EXPANSION = 8
FEATURES = [3, 7, 11]
TARGET = 1.05
"""Issue 38: a spliced SAE costs at most this times the same matmuls written by hand."""
PAIRS = ("record", "ablate", "reconstruction")
REFERENCE = "output"
"""The reference pair, no SAE: ``fh.capture(fh.outputs(pt))`` / a hook keeping the block's output:
what a capture costs over a hand hook by itself."""


class SAE(nn.Module):
    """A ReLU SAE: ``W_enc (d_in, d_sae)``, ``W_dec (d_sae, d_in)``."""

    def __init__(self, d_in: int, d_sae: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W_enc = nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5)
        self.b_enc = nn.Parameter(torch.zeros(d_sae))
        self.W_dec = nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae ** 0.5)
        self.b_dec = nn.Parameter(torch.zeros(d_in))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu((x - self.b_dec) @ self.W_enc + self.b_enc)

    def decode(self, f: torch.Tensor) -> torch.Tensor:
        return f @ self.W_dec + self.b_dec


def gpt2(size: dict[str, int]) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=size["vocab"], n_embd=size["width"], n_head=size["heads"],
                                     n_layer=size["layers"], n_positions=size["positions"])
    return transformers.GPT2LMHeadModel(config).eval()


def _tensor(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _hand_edits(sae: SAE) -> dict[str, Callable[[torch.Tensor, list], torch.Tensor | None]]:
    """Pair -> the hand-written hook's work on the block's output `x`, storing the features."""

    def record(x: torch.Tensor, kept: list) -> None:
        kept.append(sae.encode(x))

    def ablate(x: torch.Tensor, kept: list) -> torch.Tensor:
        f = sae.encode(x)
        g = f.clone()
        g[..., FEATURES] = 0
        kept.append(g)
        return x + (sae.decode(g) - sae.decode(f))

    def reconstruction(x: torch.Tensor, kept: list) -> torch.Tensor:
        return sae.decode(sae.encode(x))

    def output(x: torch.Tensor, kept: list) -> None:
        kept.append(x)

    return {"record": record, "ablate": ablate, "reconstruction": reconstruction, REFERENCE: output}


class _Hooked:
    """The model with a hand-written forward hook on `block`, registered for each call (as a
    capture function is built per round), the features kept in a list per call."""

    def __init__(self, model: nn.Module, block: nn.Module, work: Callable[[torch.Tensor, list], Any]) -> None:
        self.model, self.block, self.work = model, block, work

    def __call__(self, x: torch.Tensor) -> tuple[Any, list]:
        kept: list = []

        def hook(module: nn.Module, args: tuple, out: Any) -> Any:
            new = self.work(_tensor(out), kept)
            return None if new is None else new if isinstance(out, torch.Tensor) else (new, *out[1:])

        handle = self.block.register_forward_hook(hook)
        try:
            return self.model(x, use_cache=False), kept
        finally:
            handle.remove()


def _specs(model: nn.Module, sae: SAE) -> dict[str, tuple[fh.Spec, ...]]:
    pt = fh.transformer.points(model).resid_post[1]
    return {"record": fh.sae.splice(pt, sae), "ablate": fh.sae.splice(pt, sae, edit=fh.sae.ablate(FEATURES)),
            "reconstruction": fh.sae.splice(pt, sae, error=False, record=False), REFERENCE: (fh.outputs(pt),)}


def cases(model: nn.Module, sae: SAE, x: torch.Tensor) -> dict[str, Any]:
    """Name -> call: the bare forward, and per pair the hand hook and ``fh.capture`` of the splice."""
    block = model.get_submodule("transformer.h.1")
    out: dict[str, Any] = {"bare": lambda: model(x, use_cache=False)}
    for pair, work in _hand_edits(sae).items():
        hooked = _Hooked(model, block, work)
        out[f"hand hook: {pair}"] = lambda hooked=hooked: hooked(x)
    for pair, specs in _specs(model, sae).items():
        out[f"funhooks: {pair}"] = _common.PerRound(_captured(model, specs, x))
    return out


def _captured(model: nn.Module, specs: tuple[fh.Spec, ...], x: torch.Tensor) -> Callable[[], Callable[[], Any]]:
    """Builds ``fh.capture(model, specs)`` (once per round) and its call on `x`."""

    def build() -> Callable[[], Any]:
        f = fh.capture(model, specs)
        return lambda: f(x, use_cache=False)

    return build


def check(model: nn.Module, sae: SAE, x: torch.Tensor) -> dict[str, bool]:
    """Each splice gives its hand hook's logits and features; recording alone, the bare logits."""
    block = model.get_submodule("transformer.h.1")
    checks = {}
    bare = model(x, use_cache=False).logits
    for pair, specs in _specs(model, sae).items():
        out, rec = fh.capture(model, specs)(x, use_cache=False)
        want, kept = _Hooked(model, block, _hand_edits(sae)[pair])(x)
        same = torch.allclose(out.logits, want.logits, rtol=0, atol=1e-6)
        if kept:
            key = ("blocks.1.resid_post", "output") if pair == REFERENCE else ("blocks.1.resid_post.sae", "features")
            same = same and torch.equal(rec[key[0]][key[1]], kept[0])
        checks[f"{pair}: funhooks == hand hook"] = bool(same)
    checks["record: logits == bare"] = torch.equal(fh.capture(model, _specs(model, sae)["record"])(
        x, use_cache=False)[0].logits, bare)
    return checks


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    size = QUICK_MODEL if args.quick else MODEL
    model = gpt2(size)
    sae = SAE(size["width"], EXPANSION * size["width"])
    x = torch.randint(0, size["vocab"], (size["batch"], size["length"]))
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock}
    with torch.no_grad():
        checks = check(model, sae, x)
        _common.check(all(checks.values()), f"outputs differ: {checks}")
        timed = _common.time_cases(cases(model, sae, x), baseline="bare", **timing)
    per_pair = {pair: timed[f"funhooks: {pair}"]["ratio"]["median"] / timed[f"hand hook: {pair}"]["ratio"]["median"]
                for pair in (*PAIRS, REFERENCE)}
    extra = {pair: timed[f"funhooks: {pair}"]["ratio"]["median"] - timed[f"hand hook: {pair}"]["ratio"]["median"]
             for pair in (*PAIRS, REFERENCE)}
    print(_common.format_table(f"GPT-2 {size}, SAE x{EXPANSION} at resid_post[1] (ratio: time / bare forward)",
                               timed))
    for pair, r in per_pair.items():  # the reference pair last
        print(f"{pair}: funhooks / hand hook {r:.3f}x (target <= {TARGET}); funhooks - hand hook = "
              f"{extra[pair]:+.3f} of the bare forward")
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "model": size, "expansion": EXPANSION, "correct": all(checks.values()), "checks": checks,
        "results": {"batch": list(x.shape), "cases": timed, "splice_to_hand": per_pair,
                    "splice_minus_hand_over_bare": extra, "target": TARGET},
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
