"""Memory: how many bytes does a Record hold, and how many of them are copies?

For each spec variant of ``fh.outputs("**")`` the script runs one forward in which a
hand-written hook also keeps every module output (the activations), then compares storages:

- ``activation_bytes``: the bytes of the distinct storages of every module's output;
- ``stored_bytes``: the bytes of the distinct storages the Record's tensors use;
- ``copied_bytes``: stored bytes in storages that are not an activation's storage (copies);
- ``shared_bytes``: stored bytes that are the activations themselves (views, no copy).

The contract checked before anything is written: ``detach=True`` (the default) copies
nothing, ``clone=True`` copies every stored byte, ``cpu=True`` copies only when the
activations are not already on the CPU.

Run: ``python benchmarks/bench_memory.py`` (``--quick`` for a smoke run; ``--device cuda``
on a GPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import _common
import funhooks as fh

NAME = "memory"
QUICK_DEPTH = 4


def _storages(tensors: list[torch.Tensor]) -> dict[tuple[str, int], int]:
    """Distinct storages (device, data pointer) -> their size in bytes."""
    out: dict[tuple[str, int], int] = {}
    for t in tensors:
        s = t.untyped_storage()
        out[(str(t.device), s.data_ptr())] = s.nbytes()
    return out


def measure(model: nn.Module, x: torch.Tensor, spec: fh.Spec) -> dict[str, Any]:
    """One forward with both a reference hook and `spec`; the byte accounting of its Record."""
    modules = _common.hooked_modules(model)
    by_module: dict[nn.Module, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, a, o: by_module.__setitem__(m, o)) for m in modules]
    try:
        with fh.with_hooks(model, spec) as run:
            model(x)
        stored = run.record.stored()
    finally:
        for h in handles:
            h.remove()
    activations = [by_module[m] for m in modules]
    acts, kept = _storages(activations), _storages(stored)
    copied = sum(n for key, n in kept.items() if key not in acts)
    return {
        "activation_bytes": sum(acts.values()),
        "stored_bytes": sum(kept.values()),
        "copied_bytes": copied,
        "shared_bytes": sum(kept.values()) - copied,
        "stored_tensors": len(stored),
        "values_equal": _common.tensors_equal([t.to(x.device) for t in stored], activations),
    }


def expected(label: str, r: dict[str, Any], on_cpu: bool) -> bool:
    """The contract: copies only where `clone` (or `cpu` off the CPU) asked for them."""
    if label == "clone=True" or (label == "cpu=True" and not on_cpu):
        return r["copied_bytes"] == r["stored_bytes"] and r["shared_bytes"] == 0
    return r["copied_bytes"] == 0


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    device = torch.device(args.device)
    conditions = _common.setup(args.clock)
    torch.manual_seed(0)
    batch = _common.QUICK_BATCH if args.quick else _common.BATCH
    models = {
        "deep-narrow": (_common.deep_narrow(depth=QUICK_DEPTH if args.quick else _common.DEEP_NARROW_DEPTH),
                        torch.randn(batch, _common.DEEP_NARROW_WIDTH)),
        "cnn": (_common.small_cnn(widths=_common.QUICK_CNN_WIDTHS if args.quick else _common.CNN_WIDTHS), torch.randn(batch, *_common.IMAGE)),
    }
    variants = {
        "detach=True (default)": fh.outputs("**"),
        "clone=True": fh.outputs("**", clone=True),
        "cpu=True": fh.outputs("**", cpu=True),
    }
    results: dict[str, dict[str, Any]] = {}
    checks: dict[str, dict[str, bool]] = {}
    with torch.no_grad():
        for label, (model, x) in models.items():
            model, x = model.to(device), x.to(device)
            results[label], checks[label] = {}, {}
            for vlabel, spec in variants.items():
                r = measure(model, x, spec)
                results[label][vlabel] = r
                checks[label][vlabel] = r["values_equal"] and expected(vlabel, r, device.type == "cpu")
            _common.check(all(checks[label].values()), f"{label}: {checks[label]} {results[label]}")
            print(f"{label}:")
            for vlabel, r in results[label].items():
                print(f"  {vlabel:<24} activations {r['activation_bytes'] / 1024:9.1f} KiB  stored "
                      f"{r['stored_bytes'] / 1024:9.1f} KiB  copied {r['copied_bytes'] / 1024:9.1f} KiB")
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "device": str(device),
        "correct": all(all(c.values()) for c in checks.values()), "checks": checks, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
