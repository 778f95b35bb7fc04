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
- ``floor: one-line wrappers + exact reduction``: what any design that wraps each module's
  forward and gives fastai's statistics to the bit must pay, with none of funhooks' run,
  Record or fold: each Linear's forward wrapped for the step by a one-line Python function
  keeping its output, then the step's outputs stacked and reduced by the exact batched
  reduction ``ActivationStats`` uses (``funhooks.reducers._exact._row_stats``); checked equal to
  ``ActivationStats``' numbers.
- ``floor: + the contract's work``: the floor above plus, written by hand, what the contract
  asks of ``fit + ActivationStats()`` (issue 31): wrappers installed once per call and taken
  off at its end, each reading a ``ContextVar`` (scope to the context) and a paused flag;
  each kept output an alias with its version noted, compared at the end of the step (in-place
  safety); per step the children tables compared with copies (a module added mid-training),
  every module's train flag read, the outputs keyed by path (the step's Record) and the
  rows read to the host with ``.tolist()`` (the state, issue 26); checked equal to
  ``ActivationStats``' numbers.
- ``floor: + checks for any model``: the contract floor above plus what keeps its numbers
  right on a model other than this one, as ``ActivationStats``' hook and step must: per
  output, whether it may be kept without a copy (a tensor, not inside a compiled graph, of a
  module whose output no later op changed on an earlier step, looked up by module in a dict
  as a spec function shared by every module must, small enough to hold until the
  end of the step, on the CPU, contiguous so that the batched reduction sums it in torch's
  order, owning its storage so that it holds nothing larger alive), a copy on a module's first
  step that learns whether a later op changes its output in place; per step, the shapes and
  dtypes compared before one stack (a model of several shapes stacks each apart); checked
  equal to ``ActivationStats``' numbers.
- ``floor: gradient + update kernels``: the kernels ``GradientStats`` and ``UpdateRatio`` run
  per step (stack each shape's gradients and sum / sum of squares / zero count them; copy the
  parameters before the update, subtract after it, two norms), written into the loop by hand;
  checked close to their results.
- ``floor: kernels + one value per layer``: the same kernels plus what the contract keeps per
  step (issue 31): each layer's sums in float64 (weight's and bias's added), one value per
  layer keyed by its path for each of the two statistics (what a step's Record holds under
  ``gradient_stats`` / ``update_ratio``), and each table read to the host with one
  ``.tolist()`` (what the reducers' states keep on the CPU).

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
import contextvars
import copy
import operator
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
FLOOR_STATS = "floor: one-line wrappers + exact reduction"
FLOOR_CONTRACT = "floor: + the contract's work"
FLOOR_GENERAL = "floor: + checks for any model"
FLOOR_PARAMS = "floor: gradient + update kernels"
FLOOR_KEPT = "floor: kernels + one value per layer"
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
            "near_zero": (o <= fh.reducers.activation_stats.NEAR_ZERO).long().sum().item() / o.numel(),
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


def _floor_stats(model: nn.Module, batches: list, opt: torch.optim.Optimizer) -> Callable[[], list]:
    """One-line forward wrappers keeping each Linear's output, and the exact batched reduction."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    rows: list[torch.Tensor] = []

    def call() -> list:
        rows.clear()
        for x, y in batches:
            kept: list[torch.Tensor] = []
            for m in linears:
                m.forward = _keeping(m.forward, kept)  # type: ignore[method-assign]
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            for m in linears:
                del m.forward
            rows.append(fh.reducers._exact._row_stats(torch.stack(kept).flatten(1), fh.reducers.activation_stats.NEAR_ZERO))
        return rows

    return call


def _floor_contract(model: nn.Module, batches: list, opt: torch.optim.Optimizer, *,
                    general: bool = False) -> Callable[[], list]:
    """The exact-reduction floor with the contract's work written in: see the module docstring.
    With `general`, also the checks that keep it right on any model (see the docstring)."""
    paths = {m: p for p, m in model.named_modules() if isinstance(m, nn.Linear)}
    modules = list(model.modules())
    active: contextvars.ContextVar[bool] = contextvars.ContextVar("floor", default=False)
    state = {"paused": True}
    kept: list[tuple[str, torch.Tensor, torch.Tensor | None, int, nn.Module | None]] = []
    rows: list[list] = []
    training = operator.attrgetter("training")
    changed: dict[nn.Module, bool] = {}  # held for the call (the benchmark's modules live on anyway)
    limit = fh.reducers.activation_stats.REDUCE_IN_HOOK_NUMEL
    compiling = torch.compiler.is_compiling

    def wrap(module: nn.Module) -> Callable[..., torch.Tensor]:
        forward, path = module.forward, paths[module]

        def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = forward(*args, **kwargs)
            if active.get() and not state["paused"]:
                kept.append((path, out.data, out, out._version, None))
            return out

        def checked(*args: Any, **kwargs: Any) -> torch.Tensor:
            out = forward(*args, **kwargs)
            if active.get() and not state["paused"]:
                if (type(out) is torch.Tensor and changed.get(module) is False and not compiling()
                        and 0 < out.numel() <= limit
                        and out.is_cpu and out.is_contiguous() and out.untyped_storage().nbytes() == out.nbytes):
                    kept.append((path, out.data, out, out._version, None))  # an alias: its version checked
                elif module in changed:  # a module whose output a later op changes: a copy
                    kept.append((path, out.detach().clone(), None, 0, None))
                else:  # a module not seen yet: a copy, and learn whether a later op changes its output
                    kept.append((path, out.detach().clone(), out, out._version, module))
            return out

        return checked if general else wrapped

    def call() -> list:
        rows.clear()
        tables = [m._modules for m in modules]
        copies = [dict(t) for t in tables]
        for m in paths:
            m.forward = wrap(m)  # type: ignore[method-assign]
        token = active.set(True)
        try:
            for x, y in batches:
                _common.check(tables == copies and all(map(training, modules)), "the model changed")
                kept.clear()
                state["paused"] = False
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                state["paused"] = True
                if general:
                    _learn_or_check(kept, changed)
                else:
                    _common.check(all(out._version == v for _, _, out, v, _ in kept), "an output changed in place")
                record = {p: (value,) for p, value, _, _, _ in kept}
                values = [v[0] for v in record.values()]
                if general:  # a model of several shapes would stack each shape apart
                    _common.check([v.shape for v in values].count(values[0].shape) == len(values)
                                  and [v.dtype for v in values].count(values[0].dtype) == len(values),
                                  "activations of several shapes")
                x = torch.stack(values).flatten(1)
                rows.append(fh.reducers._exact._row_stats(x, fh.reducers.activation_stats.NEAR_ZERO).tolist())
        finally:
            active.reset(token)
            for m in paths:
                del m.forward
        return rows

    return call


def _learn_or_check(kept: list, changed: dict[nn.Module, bool]) -> None:
    """The end of a step of the general floor: a first copy teaches whether a later op changed
    its module's output; an alias's output must not have changed."""
    for _, _, out, version, module in kept:
        if module is not None:
            changed[module] = out._version != version
        elif out is not None:
            _common.check(out._version == version, "an output changed in place")


def _keeping(forward: Callable[..., torch.Tensor], kept: list) -> Callable[..., torch.Tensor]:
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(*args, **kwargs)
        kept.append(out.detach())
        return out

    return wrapped


def _floor_params(model: nn.Module, batches: list, opt: torch.optim.Optimizer, *,
                  kept: bool = False) -> Callable[[], list]:
    """GradientStats' and UpdateRatio's kernels written into the loop: per shape, a stack of the
    gradients with sum, sum of squares and zero count; a stack of the parameters before the
    update, subtracted from one after it, and the two norms. With `kept`, also what the contract
    keeps per step: per-layer float64 sums, one value per layer by path, one ``.tolist()``."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    paths = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    groups = [[m.weight for m in linears], [m.bias for m in linears]]
    tables: list[list[torch.Tensor]] = []
    values: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = []
    host: list[list] = []

    def call() -> list:
        tables.clear()
        values.clear()
        host.clear()
        for x, y in batches:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            table = []
            for params in groups:
                g = torch.stack([p.grad for p in params]).flatten(1)
                table.append(torch.stack((g.sum(1), torch.linalg.vector_norm(g, dim=1).square_(), g.eq_(0).sum(1)), 1))
            before = [torch.stack(params).flatten(1) for params in groups]
            opt.step()
            for params, b in zip(groups, before):
                a = torch.stack(params).flatten(1)
                table.append(torch.stack((torch.linalg.vector_norm(a.sub_(b), dim=1), torch.linalg.vector_norm(b, dim=1)), 1))
            tables.append(table)
            if kept:
                w, b, dw, db = table
                sums = w.double().add_(b.double())
                moves = dw.double().square_().add_(db.double().square_())
                values.append((dict(zip(paths, sums.unbind(0))), dict(zip(paths, moves.unbind(0)))))
                host.append([torch.stack(list(v.values())).tolist() for v in values[-1]])
        return tables

    return call


def _check_floors(stats: Any, params: Any, floor_stats: list, contract: list, floor_params: list) -> None:
    """The floors compute what the reducers do: ActivationStats' rows to the bit, the gradient
    norms and update ratios to float tolerance (the reducers add in float64)."""
    _common.check(all(torch.equal(e.rows, r) for e, r in zip(stats.entries, floor_stats, strict=True)),
                  "the exact-reduction floor differs from ActivationStats")
    _common.check(all(e.rows.tolist() == r for e, r in zip(stats.entries, contract, strict=True)),
                  "the contract floor differs from ActivationStats")
    grads, updates = params
    for step, (w, b, dw, db) in enumerate(floor_params):
        norms = (w[:, 1].double() + b[:, 1].double()).sqrt()
        ratios = dw.double().square().add(db.double().square()).sqrt()
        want_norms = torch.tensor([s["norm"] for s in grads.stats[step]], dtype=torch.float64)
        want_ratios = torch.tensor(updates.ratios[step], dtype=torch.float64)
        _common.check(torch.allclose(norms, want_norms, rtol=1e-5)
                      and torch.allclose(ratios[:, 0] / ratios[:, 1], want_ratios, rtol=1e-4),
                      "the gradient + update floor differs from GradientStats / UpdateRatio")


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
        FLOOR_STATS: lambda m, o: _floor_stats(m, batches, o),
        FLOOR_CONTRACT: lambda m, o: _floor_contract(m, batches, o),
        FLOOR_GENERAL: lambda m, o: _floor_contract(m, batches, o, general=True),
        FLOOR_PARAMS: lambda m, o: _floor_params(m, batches, o),
        FLOOR_KEPT: lambda m, o: _floor_params(m, batches, o, kept=True),
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
    params, floor_stats, contract = cases[PARAMS_CASE](), cases[FLOOR_STATS](), cases[FLOOR_CONTRACT]()
    _check_floors(res, params, floor_stats, contract, cases[FLOOR_PARAMS]())
    _check_floors(res, params, floor_stats, cases[FLOOR_GENERAL](), cases[FLOOR_KEPT]())

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
