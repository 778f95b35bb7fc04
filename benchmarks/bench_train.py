"""Training as a generator, and activation statistics as a fold: what do they cost over a
hand-written PyTorch loop?

Cases (one call = one epoch over the same batches, each case on its own copy of the model
and optimizer, all starting from the same weights; checked to end with equal weights before
timing):

- ``bare loop``: ``opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()`` per batch,
  the denominator of every ratio.
- ``fh.train``: ``for step in fh.train(model, batches, loss_fn, opt): pass``.
- ``fh.fit + ActivationStats()``: ``fh.fit(model, batches, loss_fn, opt, fh.ActivationStats())``,
  every Linear's mean / std / near-zero share per step, kept on the device.
- ``fh.fit + ActivationStats(every=4)``: the same, one step in four recorded.
- ``fh.fit + GradientStats() + UpdateRatio()``: every layer's gradient norm / mean / std / zeros
  and update-to-parameter ratio at every optimizer step, kept on the device.
- ``hand hooks, fastai-style stats``: forward hooks on every Linear computing the same
  statistics with ``.item()`` in the hook, as fastai's ``ActivationStats`` does (cpu=False);
  ``ActivationStats``' numbers are checked to equal these exactly before timing.

Model: the deep-narrow MLP (48 x (Linear(64, 64), ReLU)), batch 32, SGD, MSE loss,
one thread, flush-denormal on. Targets (issue 16): ``fh.train`` <= 1.05x,
``fit + ActivationStats()`` <= 1.20x, ``fit + GradientStats() + UpdateRatio()`` <= 1.15x.

Then, where lightning and transformers import, the same model trained by a
``lightning.Trainer`` and a ``transformers.Trainer``, bare and with ``FoldCallback`` running
each reducer set (see ``_frameworks.py`` for how steps inside a trainer are timed). Target:
the time a callback adds per step is at most 1.05x what the same reducers add to ``fh.fit``.

Run: ``python benchmarks/bench_train.py`` (``--quick`` for a smoke run, ``--no-frameworks``
to skip the trainers).
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _common
import _frameworks
import funhooks as fh

FRAMEWORK_STEPS = 40
QUICK_FRAMEWORK_STEPS = 6
FRAMEWORK_ROUNDS = 7
NAME = "train"
PARAMS_CASE = "fh.fit + GradientStats() + UpdateRatio()"
BATCHES_PER_CALL = 8
QUICK_DEPTH = 4
LR = 1e-3
EVERY = 4


def _bare(model: nn.Module, batches: list, opt: torch.optim.Optimizer) -> Callable[[], None]:
    loss_fn = nn.functional.mse_loss

    def call() -> None:
        for x, y in batches:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()

    return call


def _train(model: nn.Module, batches: list, opt: torch.optim.Optimizer) -> Callable[[], None]:
    def call() -> None:
        collections.deque(fh.train(model, batches, nn.functional.mse_loss, opt, progress=False), maxlen=0)

    return call


def _fit(model: nn.Module, batches: list, opt: torch.optim.Optimizer, every: int | None) -> Callable[[], Any]:
    stats = fh.ActivationStats(every=every)

    def call() -> Any:
        return fh.fit(model, batches, nn.functional.mse_loss, opt, stats, progress=False)

    return call


def _fit_params(model: nn.Module, batches: list, opt: torch.optim.Optimizer) -> Callable[[], Any]:
    reducers = [fh.GradientStats(), fh.UpdateRatio()]

    def call() -> Any:
        return fh.fit(model, batches, nn.functional.mse_loss, opt, reducers, progress=False)

    return call


def _fastai_style(model: nn.Module, batches: list, opt: torch.optim.Optimizer) -> Callable[[], list]:
    """Hooks registered once that compute fastai's statistics with ``.item()`` per layer."""
    stats: list[list[dict[str, float]]] = []
    current: list[dict[str, float]] = []

    def hook(module: nn.Module, args: tuple, o: torch.Tensor) -> None:
        o = o.detach().float()
        current.append({
            "mean": o.mean().item(), "std": o.std().item(),
            "near_zero": (o <= fh.stats.NEAR_ZERO).long().sum().item() / o.numel(),
        })

    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(hook)
    step = _bare(model, batches, opt)

    def call() -> list:
        stats.clear()
        for x, y in batches:
            current.clear()
            step_one(x, y)
            stats.append(list(current))
        return stats

    def step_one(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    del step
    return call


REDUCER_SETS: dict[str, tuple[str, Callable[[], Any]]] = {
    "ActivationStats()": ("fh.fit + ActivationStats()", lambda: fh.ActivationStats()),
    "GradientStats() + UpdateRatio()": (PARAMS_CASE, lambda: [fh.GradientStats(), fh.UpdateRatio()]),
}


def _time_frameworks(base: nn.Module, batches: list, results: dict[str, Any], args: Any) -> dict[str, Any]:
    """The Lightning and Hugging Face cases (those whose library imports), and per reducer set
    the time the callback adds per step against the time the reducers add to fh.fit."""
    steps = QUICK_FRAMEWORK_STEPS if args.quick else FRAMEWORK_STEPS
    cases: dict[str, Callable[[], float]] = {}
    baselines: dict[str, str] = {}
    for trainer, make in (("lightning.Trainer", _frameworks.lightning_case), ("transformers.Trainer", _frameworks.hf_case)):
        bare = make(base, batches, None, steps)
        if bare is None:
            continue
        cases[trainer] = bare
        for label, (_, reducers) in REDUCER_SETS.items():
            cases[f"{trainer} + FoldCallback({label})"] = make(base, batches, reducers(), steps)
            baselines[f"{trainer} + FoldCallback({label})"] = trainer
    if not cases:
        return {}
    rounds = 2 if args.quick else FRAMEWORK_ROUNDS
    out = _frameworks.time_frameworks(cases, baselines, rounds)
    print(f"\nin trainers: {steps} steps per fit, timed from step {_frameworks.WARM_STEPS}, {rounds} interleaved rounds")
    print(_frameworks.format_table(out))
    summary = {}
    bare_step = results["bare loop"]["seconds"]["median"] / BATCHES_PER_CALL
    for name, r in out.items():
        label = name.partition("FoldCallback(")[2][:-1]
        if not label:
            continue
        fit_case = REDUCER_SETS[label][0]
        fit_added = results[fit_case]["seconds"]["median"] / BATCHES_PER_CALL - bare_step
        cb_added = r["added_seconds_per_step"]["median"]
        summary[name] = {"added_us_per_step": cb_added * 1e6, "fit_added_us_per_step": fit_added * 1e6,
                         "added_over_fit": cb_added / fit_added if fit_added > 0 else None}
        print(f"  {name}: adds {cb_added * 1e6:.0f} us/step; the same reducers add {fit_added * 1e6:.0f} us/step "
              f"to fh.fit ({cb_added / fit_added:.2f}x)" if fit_added > 0 else f"  {name}: adds {cb_added * 1e6:.0f}")
    return {"steps": steps, "warm_steps": _frameworks.WARM_STEPS, "rounds": rounds, "results": out,
            "against_fit": summary}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _common.parse_args(__doc__.splitlines()[0], argv, add_arguments=lambda p: p.add_argument(
        "--no-frameworks", action="store_true", help="skip the Lightning and Hugging Face trainer cases"))
    conditions = _common.setup()
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    device = torch.device(args.device)
    depth = QUICK_DEPTH if args.quick else _common.DEEP_NARROW_DEPTH
    base = _common.deep_narrow(depth).train().to(device)
    width = _common.DEEP_NARROW_WIDTH
    batches = [(torch.randn(_common.BATCH, width, device=device), torch.randn(_common.BATCH, width, device=device))
               for _ in range(BATCHES_PER_CALL)]

    def copy_with_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = copy.deepcopy(base)
        return model, torch.optim.SGD(model.parameters(), lr=LR)

    builders: dict[str, Callable[[nn.Module, torch.optim.Optimizer], Callable[[], Any]]] = {
        "bare loop": lambda m, o: _bare(m, batches, o),
        "fh.train": lambda m, o: _train(m, batches, o),
        "fh.fit + ActivationStats()": lambda m, o: _fit(m, batches, o, None),
        f"fh.fit + ActivationStats(every={EVERY})": lambda m, o: _fit(m, batches, o, EVERY),
        PARAMS_CASE: lambda m, o: _fit_params(m, batches, o),
        "hand hooks, fastai-style stats": lambda m, o: _fastai_style(m, batches, o),
    }
    cases, models = {}, {}
    for name, build in builders.items():
        model, opt = copy_with_opt()
        cases[name], models[name] = build(model, opt), model
        cases[name]()  # one epoch each, from the same weights
    ref = list(models["bare loop"].parameters())
    for name, model in models.items():
        _common.check(_common.tensors_equal(ref, list(model.parameters())), f"{name} trains differently from the bare loop")
    res = cases["fh.fit + ActivationStats()"]()
    hand = cases["hand hooks, fastai-style stats"]()
    # fastai's own test compares with ==: every statistic must be the hooks' to the bit
    _common.check(res.stats == hand, "ActivationStats differs from the hand-written fastai-style hooks")

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    results = _common.time_cases(cases, baseline="bare loop", rounds=args.rounds, warmup=args.warmup,
                                 inner=args.inner, sync=sync)
    print(_common.format_table(f"deep-narrow {depth} x (Linear({width}, {width}), ReLU), batch {_common.BATCH}, "
                               f"{BATCHES_PER_CALL} steps per call, {device.type}", results))
    frameworks = {} if args.no_frameworks else _time_frameworks(base, batches, results, args)
    payload = {
        "conditions": {**conditions, "flush_denormal": True, "device": device.type, "quick": args.quick,
                       "rounds": args.rounds, "batches_per_call": BATCHES_PER_CALL, "depth": depth},
        "targets": {"fh.train": 1.05, "fh.fit + ActivationStats()": 1.20, PARAMS_CASE: 1.15,
                    "callback added time over the same reducers' in fh.fit": 1.05},
        "quick": args.quick,
        "results": results,
        "frameworks": frameworks,
    }
    path = _common.write(NAME, args.out, payload)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
