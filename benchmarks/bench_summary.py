"""The module summary: ``fh.module_summary`` vs torchinfo's ``summary`` on BERT and GPT-2.

Issue 36 item 24: ``fh.module_summary`` took 17-18x a bare forward on BERT and GPT-2 (its pass
ran on the meta device, whose kernels are mostly Python reference code), torchinfo 2.8-5.4x.
Goal: no slower than torchinfo, with funhooks' numbers kept (each tied weight counted once;
FLOPs as ``torch.utils.flop_counter`` counts them, attention included).

Models: a Hugging Face ``BertModel`` and a ``GPT2LMHeadModel`` (tied embeddings) built from
small configs (random weights, no download, SDPA attention, the default), called with
``input_ids`` and an all-ones ``attention_mask``. Cases, each a whole summary from the inputs:

- ``bare forward``: the model under ``torch.no_grad()``, the baseline of the ratios;
- ``fh.module_summary``: the full summary (every module's shapes, parameters, FLOPs);
- ``torchinfo.summary``: ``verbose=0`` (only where torchinfo imports);
- both again with ``input_ids`` alone (``, no mask``): before issue 36 the two took different
  passes (a meta pass without the mask, a real one with it).

Checked before timing: funhooks' total is the model's parameters, each once; its FLOPs equal
``FlopCounterMode``'s on a real pass (told to count the CPU's fused attention kernel, which it
leaves at 0, as it counts the CUDA ones); torchinfo's totals and MACs are recorded beside them
(it counts GPT-2's tied weight twice, and its MACs differ).

Run: ``python benchmarks/bench_summary.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

import _common
import funhooks as fh

NAME = "summary"
SIZE = {"layers": 4, "width": 128, "heads": 4, "vocab": 512, "batch": 8, "length": 32}
QUICK = {"layers": 2, "width": 16, "heads": 2, "vocab": 64, "batch": 2, "length": 5}


def bert(size: dict[str, int]) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(vocab_size=size["vocab"], hidden_size=size["width"],
                                     num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
                                     intermediate_size=4 * size["width"], max_position_embeddings=64)
    return transformers.BertModel(config).eval()


def gpt2(size: dict[str, int]) -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=size["layers"], n_embd=size["width"], n_head=size["heads"],
                                     vocab_size=size["vocab"], n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def torch_flops(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> int:
    """``FlopCounterMode`` on a real pass, told to count the CPU's fused attention kernel."""
    aten = torch.ops.aten
    counter = FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu:
            lambda q, k, v, *args, out_shape=None, **kwargs: sdpa_flop_count(q, k, v)})
    with torch.no_grad(), counter:
        model(**inputs)
    return counter.get_total_flops()


def cases(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> dict[str, Callable[[], Any]]:
    def bare() -> Any:
        with torch.no_grad():
            return model(**inputs)

    ids = {"input_ids": inputs["input_ids"]}
    found = {"bare forward": bare, "fh.module_summary": lambda: fh.module_summary(model, **inputs),
             "fh.module_summary, no mask": lambda: fh.module_summary(model, **ids)}
    try:
        import torchinfo
    except ImportError:
        return found
    found["torchinfo.summary"] = lambda: torchinfo.summary(model, input_data=inputs, verbose=0)
    found["torchinfo.summary, no mask"] = lambda: torchinfo.summary(model, input_data=ids, verbose=0)
    return found


def numbers(model: torch.nn.Module, inputs: dict[str, torch.Tensor],
            timed: dict[str, Callable[[], Any]]) -> tuple[dict[str, Any], dict[str, bool]]:
    """Each summary's totals, and the checks of funhooks' against the model and torch's counter."""
    ours = timed["fh.module_summary"]()
    unique = sum(p.numel() for p in model.parameters())
    found: dict[str, Any] = {"parameters": unique, "torch_flops": torch_flops(model, inputs),
                             "fh": {"total": ours.total, "flops": ours.flops, "macs": ours.macs}}
    if "torchinfo.summary" in timed:
        theirs = timed["torchinfo.summary"]()
        found["torchinfo"] = {"total": theirs.total_params, "macs": theirs.total_mult_adds}
    checks = {"fh total == parameters": ours.total == unique,
              "fh flops == FlopCounterMode (with CPU attention)": ours.flops == found["torch_flops"]}
    return found, checks


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup(args.clock)
    size = QUICK if args.quick else SIZE
    timing = {"rounds": args.rounds, "warmup": args.warmup, "inner": args.inner, "clock": args.clock}
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    correct = True
    for name, build in (("BERT", bert), ("GPT-2", gpt2)):
        model = build(size)
        ids = torch.randint(0, size["vocab"], (size["batch"], size["length"]))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        timed = cases(model, inputs)
        found, checks = numbers(model, inputs, timed)
        for what, ok in checks.items():
            _common.check(ok, f"{name}: {what}: {found}")
        correct = correct and all(checks.values())
        measured = _common.time_cases(timed, baseline="bare forward", **timing)
        print(_common.format_table(f"{name} (ratio: time / bare forward)", measured))
        print(f"  numbers: {found}")
        results[name] = {"cases": measured, "numbers": found, "checks": checks}
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "model": size, "correct": correct, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
