"""Edge attribution patching: every edge of a GPT-2 scored in a few forward passes.

``fh.circuits.eap`` on a 12-layer, 12-head GPT-2 config (random weights; d_model 768 as GPT-2
small, a vocabulary of 8192 instead of 50257 to keep the unembedding from dominating; one
prompt of 16 tokens, the corrupted prompt differing in one token), against, in the same
interleaved rounds:

- ``bare forward (clean)``: ``model(clean)`` without gradients, the baseline of the ratios;
- ``floor: corrupted forward + clean forward + backward``: what any EAP needs, written by hand
  (a forward without gradients, a forward with, ``torch.autograd.grad`` of the metric with
  respect to the embeddings and the final norm's input, no weight gradients);
- ``fh.circuits.eap``: every edge scored (2 embeddings + 144 heads + 12 MLPs writing, 12 x (3 x 12
  + 1) + 1 readers).

The same three on a 4-layer model of the same width show that the cost in forward passes does
not grow with the number of edges (the ratio is the time over the bare forward of the same
model). The target: EAP within 3 forward-equivalents over the clean forward (ratio <= 4).

Checked before timing: the scores of the edges into the logits sum to the floor's
``(corrupt - clean) · d metric / d input`` at the final norm's input.

Run: ``python benchmarks/bench_circuits.py`` (``--quick`` for a smoke run, about two minutes in full
on one CPU thread).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

import _common
import funhooks as fh

NAME = "circuits"
FULL = {"layers": 12, "heads": 12, "width": 768, "vocab": 8192, "positions": 16}
SMALL = {**FULL, "layers": 4}
QUICK = {"layers": 2, "heads": 4, "width": 32, "vocab": 64, "positions": 6}
QUICK_SMALL = {**QUICK, "layers": 1}
TOKENS = (7, 8)


def gpt2(size: dict[str, int]) -> torch.nn.Module:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=size["layers"], n_head=size["heads"], n_embd=size["width"], vocab_size=size["vocab"],
        n_positions=size["positions"], attn_implementation="sdpa")).eval()


def logit_diff(out: Any) -> torch.Tensor:
    return out.logits[:, -1, TOKENS[0]] - out.logits[:, -1, TOKENS[1]]


def _floor(model: torch.nn.Module, clean: torch.Tensor, corrupt: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A corrupted forward, a clean forward and a backward to the embeddings, by hand: returns
    ``(corrupt - clean) · grad`` at the final norm's input."""
    norm = model.transformer.ln_f

    def call() -> torch.Tensor:
        seen: list[torch.Tensor] = []
        handle = norm.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
        try:
            with torch.no_grad():
                model(corrupt)
            with torch.enable_grad():
                embeds = model.transformer.wte(clean).detach().requires_grad_()
                metric = logit_diff(model(inputs_embeds=embeds)).sum()
                grad_x, _ = torch.autograd.grad(metric, [seen[1], embeds])
        finally:
            handle.remove()
        return ((seen[0] - seen[1].detach()) * grad_x).sum()

    return call


def cases(size: dict[str, int]) -> tuple[dict[str, Callable[[], Any]], dict[str, Any]]:
    model = gpt2(size)
    clean = torch.randint(0, size["vocab"], (1, size["positions"]))
    corrupt = clean.clone()
    middle = size["positions"] // 2
    corrupt[0, middle] = (corrupt[0, middle] + 1) % size["vocab"]
    eap = fh.circuits.eap(model, logit_diff)
    floor = _floor(model, clean, corrupt)
    edges = eap(clean, corrupt)
    into_logits = edges.table[:, -1].sum()
    by_hand = floor()
    ok = bool(torch.allclose(into_logits, by_hand, rtol=1e-3, atol=1e-5))
    _common.check(ok, f"the edges into the logits sum to {float(into_logits)}, the floor's estimate is {float(by_hand)}")

    def bare() -> None:
        with torch.no_grad():
            model(clean)

    info = {"model": size, "edges": edges.n_edges, "writers": len(edges.writers), "readers": len(edges.readers),
            "logits_edges_sum": float(into_logits), "floor_logits_estimate": float(by_hand)}
    return {"bare forward (clean)": bare, "floor: corrupted fwd + clean fwd + bwd": floor,
            "fh.circuits.eap": lambda: eap(clean, corrupt)}, info


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock}
    results: dict[str, Any] = {}
    for label, size in (("12 layers", QUICK if args.quick else FULL), ("4 layers", QUICK_SMALL if args.quick else SMALL)):
        made, info = cases(size)
        timed = _common.time_cases(made, baseline="bare forward (clean)", **timing)
        results[label] = {**info, "cases": timed}
        print(_common.format_table(f"{label}: {info['edges']} edges (ratio: time / bare clean forward)", timed))
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "correct": True, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
