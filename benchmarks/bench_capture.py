"""Capture every module's output on each call: what does it cost over the bare forward?

Cases (each returns the forward output and the captured outputs of every module below the
root, so all of them do the same work; checked equal before timing):

- ``bare``: ``model(x)``, nothing captured: the denominator of every ratio.
- ``fh.with_hooks``: ``with fh.with_hooks(model, fh.outputs("**")) as run: model(x)``,
  then ``run.record`` (building the Record is timed).
- ``fh.capture``: ``f(x)`` with ``f = fh.capture(model, fh.outputs("**"))`` built once
  per round, untimed, and dropped after its turn (included when funhooks has ``capture``;
  older funhooks versions kept global hooks installed while a capture function lived).
- ``floor: one-line forward wrappers``: on a copy of the model, each module's ``forward``
  replaced once (before timing) by a one-line wrapper appending ``(path, out.detach())`` to
  a list: the leanest forward wrapper doing the same job, the floor of funhooks' design
  (which wraps forwards and registers no hook).
- ``floor with the contract's work``: the same wrappers set in each module's ``__dict__``
  (with ``__reduce_ex__``), reached through weak references under a lock, and removed around
  every call, after the model's structure is compared with a copy (a model edited between
  runs); per module call a context-variable read (scope), the ``torch.func`` level and
  backward-pass id reads (refusing calls inside transforms, storing nothing on checkpoint
  recomputation), a detach when the output requires grad and a version read; the versions
  checked while a ``{path: {"output": (t,)}}`` tree is built: the least any run doing what
  the contract promises can cost (``_baselines.wrappers_with_contract`` lists each step).
- ``bare, beside a live fh.capture``: the bare forward while a capture function of an
  unrelated model exists: what holding one costs everything else in the process.
- ``floor: a no-op global forward hook``: the bare forward with one global forward hook
  that does nothing (installed for its turn only): PyTorch's hooked call path, which every
  hooking case pays; what a case costs above it is its own.
- ``hand hooks, registered once``: one forward hook per module storing ``out.detach()``
  in a dict keyed by module, registered before timing on a copy of the model; per call the
  dict is reset and read out as a list in module order (``named_modules`` order, like a Record).
- ``hand hooks, per call``: the same hooks registered and removed around each call.
- ``fastai hook_outputs, per call``: fastai's ``hook_outputs`` when fastai imports, else
  ``fastai-style Hooks emulation``: one hook object per module that stores its detached
  output through a recursive detach helper, used as a context manager per call.
- peers, each only when importable (``pip install funhooks[bench]``): nnsight (one trace
  saving every module's output), TransformerLens (``run_with_cache`` on a copy with a
  ``HookPoint`` after every module), torchlens (``trace``, every layer; it logs
  ops rather than modules, so only its output is compared).

Apart, hooking a few modules (``SPARSE_PATHS``, 3 of the deep-narrow MLP's 97 modules):
``bare``; ``fh.with_hooks`` (the hooked modules' forwards wrapped); ``fh.capture``;
hand-written hooks registered and removed per call.

Apart, patching one module (``PATCH_PATH``, the deep-narrow MLP's middle Linear, its output
replaced by zeros): ``bare`` (nothing patched; the denominator); ``fh.with_hooks, one patch spec
reused`` (``with fh.with_hooks(model, spec): model(x)`` with the same ``fh.patch`` spec object
every call, as a sweep's loop holds it: its plan is made once, issue 37); ``hand hook, per
call`` (a forward hook returning the zeros, registered and removed around each call); the
two patched cases are checked equal.

Models: the deep-narrow MLP (48 x (Linear(64, 64), ReLU), batch 32) and a small
ResNet-like CNN (3 x 32 x 32, batch 32), both in eval mode, under ``torch.no_grad()``.

Run: ``python benchmarks/bench_capture.py`` (``--quick`` for a smoke run;
``--profile 'fh.with_hooks'`` prints a cProfile of one case instead of timing;
``--breakdown`` splits a ``with_hooks`` call into set-up, forward and Record by subtraction).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _baselines
import _common
import funhooks as fh

NAME = "capture"
QUICK_DEPTH = 4


# -- the benchmark --------------------------------------------------------------------------


def _bare(model: nn.Module) -> Callable[[torch.Tensor], tuple[Any, None]]:
    def bare(x: torch.Tensor) -> tuple[Any, None]:
        return model(x), None

    return bare


def _in_run(model: nn.Module, spec: fh.Spec) -> Callable[[torch.Tensor], tuple[Any, Any]]:
    """One ``with_hooks`` block per call, then ``run.record``."""

    def call(x: torch.Tensor) -> tuple[Any, Any]:
        with fh.with_hooks(model, spec) as run:
            y = model(x)
        return y, run.record

    return call


def cases_for(model: nn.Module, x: torch.Tensor) -> dict[str, Callable[[torch.Tensor], tuple[Any, Any]]]:
    """Every case for `model`: name -> ``f(x) -> (output, captured outputs)``."""
    spec = fh.outputs("**")
    cases: dict[str, Callable[[torch.Tensor], tuple[Any, Any]]] = {"bare": _bare(model), "fh.with_hooks": _in_run(model, spec)}
    if hasattr(fh, "capture"):
        cases["fh.capture"] = _common.PerRound(lambda: fh.capture(model, spec))
        other = nn.Linear(1, 1)

        def bare_beside_capture() -> Callable[[torch.Tensor], tuple[Any, None]]:
            alive = fh.capture(other, fh.outputs(""))  # of an unrelated model, never called

            def call(x: torch.Tensor) -> tuple[Any, None]:
                return model(x), None

            call.keep_alive = alive  # type: ignore[attr-defined]
            return call

        cases["bare, beside a live fh.capture"] = _common.PerRound(bare_beside_capture)
    cases["floor: one-line forward wrappers"] = _baselines.wrappers_once(model)
    cases["floor with the contract's work"] = _baselines.wrappers_with_contract(model)
    cases["floor: a no-op global forward hook"] = _common.PerRound(lambda: _baselines.NoOpGlobalHook(model))
    cases["hand hooks, registered once"] = _baselines.hand_once(model)
    cases["hand hooks, per call"] = _baselines.hand_per_call(model)
    name, fastai_call = _baselines.fastai_per_call(model)
    cases[name] = fastai_call
    cases.update(_baselines.peers(model, x))
    return cases


SPARSE_PATHS = ("10", "50", "90")
QUICK_SPARSE_PATHS = ("1", "3", "5")


def sparse_cases(model: nn.Module, paths: tuple[str, ...]) -> dict[str, Callable[[torch.Tensor], tuple[Any, Any]]]:
    """Hooking `paths` only: name -> ``f(x) -> (output, captured outputs)``."""
    spec = fh.outputs(list(paths))
    modules = [model.get_submodule(p) for p in paths]
    return {"bare": _bare(model), "fh.with_hooks": _in_run(model, spec),
            "fh.capture": _common.PerRound(lambda: fh.capture(model, spec)),
            "hand hooks, per call": _baselines.hand_per_call(model, modules)}


PATCH_PATH = "48"
QUICK_PATCH_PATH = "4"


def patch_cases(model: nn.Module, path: str, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """Patching the output of the module at `path` with zeros, one reused spec: name -> ``f()``."""
    module = model.get_submodule(path)
    zeros = torch.zeros_like(module(torch.zeros(x.shape[0], module.in_features)))
    spec = fh.patch(path, zeros)

    def reused() -> Any:
        with fh.with_hooks(model, spec):
            return model(x)

    def hand() -> Any:
        handle = module.register_forward_hook(lambda m, args, out: zeros)
        try:
            return model(x)
        finally:
            handle.remove()

    return {"bare": lambda: model(x), "fh.with_hooks, one patch spec reused": reused, "hand hook, per call": hand}


def _as_list(captured: Any, paths: list[str]) -> list[torch.Tensor] | None:
    if captured is None:
        return None
    if isinstance(captured, fh.Record):
        return captured.stored()
    if isinstance(captured, dict):  # {path: {"output": (value,)}}
        return [captured[p]["output"][0] for p in paths if p in captured]
    if isinstance(captured, list) and captured and isinstance(captured[0], tuple):  # (path, value) in call order
        by_path = dict(captured)
        return [by_path[p] for p in paths if p in by_path]
    if isinstance(captured, list):
        return captured
    return None  # a peer's own log: only its output is compared


class _Bound:
    """``f(x)`` as a call of no arguments, closing `f` when it is closed."""

    def __init__(self, f: Any, x: torch.Tensor) -> None:
        self.f, self.x = f, x

    def __call__(self) -> Any:
        return self.f(self.x)

    def close(self) -> None:
        _drop(self.f)


def _bind(case: Any, x: torch.Tensor) -> Any:
    if isinstance(case, _common.PerRound):
        def make() -> Any:
            f = case.factory()
            call = _Bound(f, x)
            return call

        return _common.PerRound(make)
    return lambda: case(x)


def _drop(fn: Any) -> None:
    close = getattr(fn, "close", None)
    if close is not None:
        close()


def check_cases(cases: dict[str, Callable], x: torch.Tensor, paths: list[str]) -> dict[str, bool]:
    """Every case's output equals the bare output, and its captured list (in the module order
    of `paths`) the hand-written one."""
    y_ref, _ = cases["bare"](x)
    _, ref = cases["hand hooks, per call"](x)
    ok = {}
    for name, case in cases.items():
        fn = case.factory() if isinstance(case, _common.PerRound) else case
        y, captured = fn(x)
        _drop(fn)
        got = _as_list(captured, paths)
        ok[name] = torch.equal(y, y_ref) and (got is None or _common.tensors_equal(got, ref))
    return ok


PROFILE_CALLS = 2000
PROFILE_TOP = 25


def _add_arguments(parser: Any) -> None:
    parser.add_argument("--profile", default="", metavar="CASE",
                        help="instead of timing, cProfile CASE (e.g. 'fh.with_hooks') on the deep-narrow MLP")
    parser.add_argument("--breakdown", action="store_true",
                        help="instead of the comparison, split a with_hooks call's time into its parts")


def profile(case: str, calls: int = PROFILE_CALLS) -> None:
    """Print where one case's time goes (cProfile, by own time) on the deep-narrow MLP."""
    import cProfile
    import pstats

    torch.manual_seed(0)
    model, x = _common.deep_narrow(), torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)
    with torch.no_grad():
        fn = cases_for(model, x)[case]
        fn = fn.factory() if isinstance(fn, _common.PerRound) else fn
        for _ in range(_common.DEFAULT_WARMUP):
            fn(x)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(calls):
            fn(x)
        profiler.disable()
        _drop(fn)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(PROFILE_TOP)


def breakdown(rounds: int, warmup: int, *, depth: int = _common.DEEP_NARROW_DEPTH) -> dict[str, Any]:
    """Where a ``with_hooks`` capture-all call's time goes on deep-narrow, by subtraction of
    cases timed in the same interleaved rounds (public API only)."""
    torch.manual_seed(0)
    model, x = _common.deep_narrow(depth=depth), torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)
    n = len(_common.hooked_modules(model))
    spec = fh.outputs("**")

    def enter_exit() -> None:
        with fh.with_hooks(model, spec):
            pass

    def no_record() -> None:
        with fh.with_hooks(model, spec):
            model(x)

    def full() -> fh.Record:
        with fh.with_hooks(model, spec) as run:
            model(x)
        return run.record

    cases = {"bare": lambda: model(x), "enter + exit": enter_exit, "enter + call + exit": no_record,
             "enter + call + exit + record": full}
    with torch.no_grad():
        res = _common.time_cases(cases, baseline="bare", rounds=rounds, warmup=warmup)
    med = {name: r["seconds"]["median"] for name, r in res.items()}
    parts = {
        "the bare forward": med["bare"],
        f"wrapping and restoring {n} forwards (run set-up and tear-down)": med["enter + exit"],
        "wrapped calls and entries during the forward": med["enter + call + exit"] - med["enter + exit"] - med["bare"],
        "building the Record": med["enter + call + exit + record"] - med["enter + call + exit"],
    }
    print("deep-narrow, fh.with_hooks capture-all: where a call's time goes (medians, by subtraction)")
    for what, sec in parts.items():
        print(f"  {what:62s} {sec * 1e6:8.1f} us  {sec / med['bare']:5.2f}x bare")
    return {"cases": res, "parts_seconds": parts}


def main() -> None:
    args = _common.parse_args(__doc__.splitlines()[0], add_arguments=_add_arguments)
    conditions = _common.setup(args.clock)
    if args.profile:
        profile(args.profile)
        return
    if args.breakdown:
        path = _common.write(f"{NAME}-breakdown", args.out, {"conditions": conditions, "rounds": args.rounds,
                                                             **breakdown(args.rounds, args.warmup,
                                                                         depth=QUICK_DEPTH if args.quick else _common.DEEP_NARROW_DEPTH)})
        print(f"wrote {path}")
        return
    torch.manual_seed(0)
    if args.quick:
        models = {"deep-narrow": (_common.deep_narrow(depth=QUICK_DEPTH), torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)),
                  "cnn": (_common.small_cnn(widths=_common.QUICK_CNN_WIDTHS), torch.randn(_common.QUICK_BATCH, *_common.IMAGE))}
    else:
        models = {"deep-narrow": (_common.deep_narrow(), torch.randn(_common.BATCH, _common.DEEP_NARROW_WIDTH)),
                  "cnn": (_common.small_cnn(), torch.randn(_common.BATCH, *_common.IMAGE))}
    results, checks = {}, {}
    with torch.no_grad():
        for label, (model, x) in models.items():
            model, x = model.to(args.device), x.to(args.device)
            cases = cases_for(model, x)
            checks[label] = check_cases(cases, x, [n for n, _ in model.named_modules() if n])
            _common.check(all(checks[label].values()), f"{label}: {checks[label]}")
            timed = {name: _bind(case, x) for name, case in cases.items()}
            results[label] = {
                "modules_hooked": len(_common.hooked_modules(model)),
                "batch": x.shape[0],
                "cases": _common.time_cases(timed, baseline="bare", rounds=args.rounds, warmup=args.warmup, inner=args.inner, clock=args.clock, sync=_common.synchronizer(args.device)),
            }
            print(_common.format_table(f"{label} ({results[label]['modules_hooked']} modules hooked)", results[label]["cases"]))
            if label == "deep-narrow":
                paths = QUICK_SPARSE_PATHS if args.quick else SPARSE_PATHS
                sparse = sparse_cases(model, paths)
                checks["deep-narrow, 3 modules"] = check_cases(sparse, x, list(paths))
                _common.check(all(checks["deep-narrow, 3 modules"].values()), f"sparse: {checks['deep-narrow, 3 modules']}")
                results["deep-narrow, 3 modules"] = {
                    "modules_hooked": len(paths),
                    "batch": x.shape[0],
                    "cases": _common.time_cases({n: _bind(c, x) for n, c in sparse.items()}, baseline="bare",
                                                rounds=args.rounds, warmup=args.warmup, inner=args.inner,
                                                clock=args.clock, sync=_common.synchronizer(args.device)),
                }
                print(_common.format_table("deep-narrow, 3 modules hooked", results["deep-narrow, 3 modules"]["cases"]))
                patch = patch_cases(model, QUICK_PATCH_PATH if args.quick else PATCH_PATH, x)
                same = torch.equal(patch["fh.with_hooks, one patch spec reused"](), patch["hand hook, per call"]())
                checks["deep-narrow, 1 module patched"] = {"fh.with_hooks, one patch spec reused": same}
                _common.check(same, "the patch spec's run differs from the hand hook's")
                results["deep-narrow, 1 module patched"] = {
                    "modules_hooked": 1,
                    "batch": x.shape[0],
                    "cases": _common.time_cases(patch, baseline="bare", rounds=args.rounds, warmup=args.warmup,
                                                inner=args.inner, clock=args.clock,
                                                sync=_common.synchronizer(args.device)),
                }
                print(_common.format_table("deep-narrow, 1 module patched", results["deep-narrow, 1 module patched"]["cases"]))
    path = _common.write(NAME, args.out, {
        "quick": args.quick, "conditions": conditions, "rounds": args.rounds, "warmup": args.warmup,
        "correct": all(all(c.values()) for c in checks.values()), "checks": checks, "results": results,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
