"""Capture every module's output on each call: what does it cost over the bare forward?

Cases (each returns the forward output and the captured outputs of every module below the
root, so all of them do the same work; checked equal before timing):

- ``bare``: ``model(x)``, nothing captured: the denominator of every ratio.
- ``fh.with_hooks``: ``with fh.with_hooks(model, fh.outputs("**")) as run: model(x)``,
  then ``run.record`` (building the Record is timed).
- ``fh.capture``: ``f(x)`` with ``f = fh.capture(model, fh.outputs("**"))`` built once
  (included when funhooks has ``capture``).
- ``hand hooks, registered once``: one forward hook per module storing ``out.detach()``
  in a dict keyed by module, registered before timing on a copy of the model; per call the
  dict is reset and read out as a list in module order (``named_modules`` order, like a Record).
- ``hand hooks, per call``: the same hooks registered and removed around each call.
- ``fastai hook_outputs, per call``: fastai's ``hook_outputs`` when fastai imports, else
  ``fastai-style Hooks emulation``: one hook object per module that stores its detached
  output through a recursive detach helper, used as a context manager per call.
- peers, each only when importable: ``nnsight`` (trace, save every module's output),
  ``torchlens`` (``log_forward_pass``, all layers).

Models: the deep-narrow MLP (48 x (Linear(64, 64), ReLU), batch 32) and a small
ResNet-like CNN (3 x 32 x 32, batch 32), both in eval mode, under ``torch.no_grad()``.

Run: ``python benchmarks/bench_capture.py`` (``--quick`` for a smoke run).
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _common
import funhooks as fh

NAME = "capture"
QUICK_DEPTH = 4


# -- hand-written baselines -----------------------------------------------------------------


def _hand_once(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """Hooks registered once on a private copy; a call resets the list and runs the model."""
    model = copy.deepcopy(model)
    modules = _common.hooked_modules(model)
    store: dict[nn.Module, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        store[module] = out.detach()

    for m in modules:
        m.register_forward_hook(hook)

    def call(x: torch.Tensor) -> tuple[Any, list]:
        store.clear()
        y = model(x)
        return y, [store[m] for m in modules]

    return call


def _hand_per_call(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, list]]:
    """Hooks registered before and removed after every call."""
    modules = _common.hooked_modules(model)

    def call(x: torch.Tensor) -> tuple[Any, list]:
        store: dict[nn.Module, torch.Tensor] = {}

        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            store[module] = out.detach()

        handles = [m.register_forward_hook(hook) for m in modules]
        try:
            y = model(x)
        finally:
            for h in handles:
                h.remove()
        return y, [store[m] for m in modules]

    return call


def _detached(value: Any) -> Any:
    """Detach every tensor in a nested structure (what fastai-style hooks do per value)."""
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


class _OneHook:
    """A registration object per module, keeping the last stored value (fastai's shape)."""

    def __init__(self, module: nn.Module) -> None:
        self.stored: Any = None
        self.handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: tuple, out: Any) -> None:
        self.stored = _detached(out)

    def remove(self) -> None:
        self.handle.remove()


class _ManyHooks:
    """A context manager over one ``_OneHook`` per module, removed on exit."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.hooks = [_OneHook(m) for m in modules]

    @property
    def stored(self) -> list[Any]:
        return [h.stored for h in self.hooks]

    def __enter__(self) -> _ManyHooks:
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.hooks:
            h.remove()


def _fastai_per_call(model: nn.Module) -> tuple[str, Callable[[torch.Tensor], tuple[Any, list]]]:
    modules = _common.hooked_modules(model)
    if importlib.util.find_spec("fastai") is not None:
        try:
            from fastai.callback.hook import hook_outputs
        except Exception:  # fastai installed but broken beside this torch build
            hook_outputs = None
        if hook_outputs is not None:

            def call_fastai(x: torch.Tensor) -> tuple[Any, list]:
                with hook_outputs(modules) as hooks:
                    y = model(x)
                return y, hooks.stored

            return "fastai hook_outputs, per call", call_fastai

    def call(x: torch.Tensor) -> tuple[Any, list]:
        with _ManyHooks(modules) as hooks:
            y = model(x)
        return y, hooks.stored

    return "fastai-style Hooks emulation", call


# -- peers, only when importable --------------------------------------------------------------


def _peers(model: nn.Module) -> dict[str, Callable[[torch.Tensor], tuple[Any, list]]]:
    peers: dict[str, Callable[[torch.Tensor], tuple[Any, list]]] = {}
    if importlib.util.find_spec("nnsight") is not None:
        try:
            import nnsight

            wrapped = nnsight.NNsight(model)
            paths = [n for n, _ in model.named_modules() if n]

            def envoy(path: str) -> Any:
                node = wrapped
                for part in path.split("."):
                    node = getattr(node, part)
                return node

            envoys = [envoy(p) for p in paths]

            def call_nnsight(x: torch.Tensor) -> tuple[Any, list]:
                with wrapped.trace(x):
                    saved = [e.output.save() for e in envoys]
                    out = wrapped.output.save()
                return _value(out), [_value(s) for s in saved]

            peers["nnsight trace + save"] = call_nnsight
        except Exception as err:  # a peer that imports but does not work here is reported, not fatal
            print(f"nnsight skipped: {type(err).__name__}: {err}")
    if importlib.util.find_spec("torchlens") is not None:
        try:
            import torchlens

            def call_torchlens(x: torch.Tensor) -> tuple[Any, None]:
                log = torchlens.log_forward_pass(model, x, layers_to_save="all", vis_opt="none")
                return model(x), log  # torchlens logs ops, not modules: compared on the output only

            peers["torchlens log_forward_pass"] = call_torchlens
        except Exception as err:
            print(f"torchlens skipped: {type(err).__name__}: {err}")
    return peers


def _value(saved: Any) -> Any:
    return getattr(saved, "value", saved)


# -- the benchmark --------------------------------------------------------------------------


def cases_for(model: nn.Module) -> dict[str, Callable[[torch.Tensor], tuple[Any, Any]]]:
    """Every case for `model`: name -> ``f(x) -> (output, captured outputs)``."""
    spec = fh.outputs("**")

    def bare(x: torch.Tensor) -> tuple[Any, None]:
        return model(x), None

    def with_hooks(x: torch.Tensor) -> tuple[Any, Any]:
        with fh.with_hooks(model, spec) as run:
            y = model(x)
        return y, run.record

    cases: dict[str, Callable[[torch.Tensor], tuple[Any, Any]]] = {"bare": bare, "fh.with_hooks": with_hooks}
    if hasattr(fh, "capture"):
        cases["fh.capture"] = fh.capture(model, spec)
    cases["hand hooks, registered once"] = _hand_once(model)
    cases["hand hooks, per call"] = _hand_per_call(model)
    name, fastai_call = _fastai_per_call(model)
    cases[name] = fastai_call
    cases.update(_peers(model))
    return cases


def _as_list(captured: Any) -> list[torch.Tensor] | None:
    if captured is None:
        return None
    if isinstance(captured, fh.Record):
        return captured.stored()
    if isinstance(captured, list):
        return captured
    return None  # a peer's own log: only its output is compared


def check_cases(cases: dict[str, Callable], x: torch.Tensor) -> dict[str, bool]:
    """Every case's output equals the bare output, and its captured list the hand-written one."""
    y_ref, _ = cases["bare"](x)
    _, ref = cases["hand hooks, per call"](x)
    ok = {}
    for name, fn in cases.items():
        y, captured = fn(x)
        got = _as_list(captured)
        ok[name] = torch.equal(y, y_ref) and (got is None or _common.tensors_equal(got, ref))
    return ok


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0])
    conditions = _common.setup()
    torch.manual_seed(0)
    if args.quick:
        models = {"deep-narrow": (_common.deep_narrow(depth=QUICK_DEPTH), torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)),
                  "cnn": (_common.small_cnn(widths=(4, 8)), torch.randn(2, *_common.IMAGE))}
    else:
        models = {"deep-narrow": (_common.deep_narrow(), torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)),
                  "cnn": (_common.small_cnn(), torch.randn(_common.BATCH, *_common.IMAGE))}
    results, checks = {}, {}
    with torch.no_grad():
        for label, (model, x) in models.items():
            cases = cases_for(model)
            checks[label] = check_cases(cases, x)
            _common.check(all(checks[label].values()), f"{label}: {checks[label]}")
            timed = {name: (lambda fn=fn: fn(x)) for name, fn in cases.items()}
            results[label] = {
                "modules_hooked": len(_common.hooked_modules(model)),
                "batch": x.shape[0],
                "cases": _common.time_cases(timed, baseline="bare", rounds=args.rounds, warmup=args.warmup, inner=args.inner),
            }
            print(_common.format_table(f"{label} ({results[label]['modules_hooked']} modules hooked)", results[label]["cases"]))
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "correct": all(all(c.values()) for c in checks.values()), "checks": checks, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
