"""Optimizer watches: read around each optimizer update, attached only while a step runs."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 3, generator=g), torch.randn(5, 2, generator=g)) for _ in range(n)]


def _no_optimizer_hooks(*opts: torch.optim.Optimizer) -> bool:
    return all(not o._optimizer_step_pre_hooks and not o._optimizer_step_post_hooks for o in opts)


def _weights(layers: fh.training.Layers) -> dict[str, torch.Tensor]:
    return {p: ps[0].detach().clone() for p, ps in zip(layers.paths, layers.params)}


def test_before_sees_old_parameters_and_after_new_ones() -> None:
    """`before` runs before the update (its value is the carry), `after` after it; the
    stored value is `after`'s, one call per optimizer step, in the step's Record."""

    def moved(layers: fh.training.Layers, before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {p: (ps[0] - before[p]).abs().sum() for p, ps in zip(layers.paths, layers.params)}

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = fh.OptimizerWatch(nn.Linear, _weights, moved, name="moved")
    steps = list(fh.train(model, _batches(2), MSE, opt, watches=watch))
    assert list(steps[0].record) == ["0", "2"]
    assert all(float(s.record["0"]["moved"]) > 0 for s in steps)
    assert _no_optimizer_hooks(opt)
    fh.testing.assert_no_hooks(model)


def test_each_optimizer_sees_the_layers_it_updates() -> None:
    """With two optimizers (one per Linear), each step's record holds each layer once, read
    when its own optimizer stepped."""
    model = _model()
    opts = [torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)]
    seen = []

    def norms(layers: fh.training.Layers) -> dict[str, torch.Tensor]:
        seen.append(layers.paths)
        return {p: ps[0].grad.norm() for p, ps in zip(layers.paths, layers.params)}

    def step(m: nn.Module, batch: Any) -> torch.Tensor:
        for o in opts:
            o.zero_grad()
        loss = MSE(m(batch[0]), batch[1])
        loss.backward()
        for o in opts:
            o.step()
        return loss

    steps = list(fh.train(model, _batches(2), step=step, opt=opts, watches=fh.OptimizerWatch("*", norms, name="n")))
    assert seen == [("0",), ("2",), ("0",), ("2",)]
    assert [len(s.record.calls("2", "n")) for s in steps] == [1, 1]
    assert _no_optimizer_hooks(*opts)


class Wrapped:
    """An optimizer wrapper like accelerate's: `.optimizer` is the torch optimizer it steps."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def step(self) -> None:
        self.optimizer.step()


def test_wrapped_optimizers_are_watched_through_their_optimizer() -> None:
    """A wrapper with `.optimizer` is looked through; the statistics are read as without it."""
    model = _model()
    opt = Wrapped(torch.optim.SGD(model.parameters(), lr=0.1))
    res = fh.fit(model, _batches(2), MSE, opt, fh.GradientStats())
    assert res.paths == ("0", "2") and len(res) == 2
    assert _no_optimizer_hooks(opt.optimizer)


def test_a_watch_that_raises_is_a_hook_error_and_leaves_nothing() -> None:
    """An exception in a watch function surfaces as HookError; the optimizer's hooks are removed."""

    def boom(layers: fh.training.Layers) -> dict:
        raise ValueError("bad watch")

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fh.HookError, match=r"raised ValueError at an optimizer step: bad watch") as err:
        list(fh.train(model, _batches(2), MSE, opt, specs=fh.outputs("0"),
                      watches=fh.OptimizerWatch(nn.Linear, boom, name="boom")))
    assert isinstance(err.value.__cause__, ValueError)
    assert _no_optimizer_hooks(opt)
    fh.testing.assert_no_hooks(model)


def test_watch_arguments_and_name_clashes_are_refused() -> None:
    """Bad watches are SpecErrors at construction or before training; watches need an optimizer."""
    with pytest.raises(fh.SpecError) as err:
        fh.OptimizerWatch(nn.Linear, 3, name="x")
    assert str(err.value) == "OptimizerWatch: `before` is a callable, got 3. Pass a function."
    with pytest.raises(fh.SpecError, match=r"^OptimizerWatch: `name` is a non-empty str, got ''"):
        fh.OptimizerWatch(nn.Linear, _weights, name="")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fh.SpecError) as err:
        fh.train(model, _batches(1), MSE, opt, specs=fh.outputs("0"),
                 watches=fh.OptimizerWatch(nn.Linear, _weights, name="output"))
    assert str(err.value) == (
        "train: a watch and a spec store under one name, got 'output' for both. Give the OptimizerWatch another "
        "`name=`."
    )
    with pytest.raises(fh.LoopError) as err:
        fh.train(model, _batches(1), step=lambda m, b: None, watches=fh.OptimizerWatch(nn.Linear, _weights, name="w"))
    assert str(err.value) == (
        "train: `watches` read the optimizer step, got no optimizer. Pass `opt=` (the optimizer your `step` "
        "function calls)."
    )
    with pytest.raises(fh.SelectorError):
        fh.train(model, _batches(1), MSE, opt, watches=fh.OptimizerWatch(nn.Conv2d, _weights, name="w"))
    foreign = torch.optim.SGD(_model().parameters(), lr=0.1)
    with pytest.raises(fh.LoopError, match=r"^train: an optimizer watch reads the layers whose parameters the "
                                           r"optimizer updates, got optimizers holding none of those of"):
        fh.train(model, _batches(1), MSE, foreign, watches=fh.OptimizerWatch(nn.Linear, _weights, name="w"))
    with pytest.raises(fh.ReducerError, match=r"lacks `watches` as a tuple of OptimizerWatch"):
        fh.fit(model, _batches(1), MSE, opt, [type("Bad", (), {"specs": (), "watches": (3,), "init": lambda s: 0,
                                                               "step": lambda s, a, b: a, "result": lambda s, a: a})()])


def test_equal_watches_of_two_reducers_run_once() -> None:
    """Two equal GradientStats share one watch: the gradients are read once per step."""
    model = _model()
    a, b = fh.GradientStats(), fh.GradientStats(every=2)
    assert a.watches == b.watches
    res = fh.fit(model, _batches(3), MSE, torch.optim.SGD(model.parameters(), lr=0.1), [a, b])
    assert len(res[0]) == 3 and len(res[1]) == 2
    assert res[0].stats[2] == res[1].stats[1]


def _grad_paths(layers: fh.training.Layers) -> dict[str, torch.Tensor]:
    return {p: torch.stack([q.grad.norm() for q in ps]) for p, ps in zip(layers.paths, layers.params)}


def test_layers_follow_the_model_between_runs() -> None:
    """Watched layers are kept from run to run, and follow every edit of the model in
    between: a frozen layer, a replaced layer, an added one, a parameter given back."""
    model = _model()
    watch = fh.OptimizerWatch(nn.Linear, _grad_paths, name="g")

    def run() -> fh.Step:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)  # frozen ones too: the watch skips them
        return list(fh.train(model, _batches(1), MSE, opt, watches=watch))[-1]

    assert list(run().record) == ["0", "2"]
    model[0].weight.requires_grad_(False)
    assert run().record["0"]["g"].shape == (1,)  # the bias alone
    model[0].bias.requires_grad_(False)
    assert list(run().record) == ["2"]
    model[2] = nn.Linear(4, 2)
    step = run()
    assert torch.equal(step.record["2"]["g"], torch.stack([model[2].weight.grad.norm(), model[2].bias.grad.norm()]))
    model.append(nn.Linear(2, 2))
    assert list(run().record) == ["2", "3"]
    model[3].bias = None
    assert run().record["3"]["g"].shape == (1,)


def test_gradient_statistics_follow_parameters_resized_in_place() -> None:
    """Parameters given other shapes through ``.data`` between runs (the same Parameter
    objects) are stacked by their new shapes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    batches = [(torch.randn(5, 4), torch.randn(5, 4))]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fh.fit(model, batches, MSE, opt, fh.GradientStats())
    model[0].weight.data, model[0].bias.data = torch.randn(6, 4), torch.randn(6)
    model[2].weight.data = torch.randn(4, 6)
    res = fh.fit(model, batches, MSE, opt, [fh.GradientStats(), fh.UpdateRatio()])[0]
    grads = torch.cat([model[0].weight.grad.flatten(), model[0].bias.grad])
    assert abs(res.stats[0][0]["norm"] - grads.norm().item()) < 1e-5


@pytest.mark.usefixtures("frozen_heap")
def test_watched_models_and_optimizers_are_freed() -> None:
    """What the watches keep between runs keeps neither the model alive nor an optimizer the
    user dropped (a new optimizer per run, as notebooks do, must not pile up Adam states)."""
    import gc
    import weakref

    model = _model()
    reducers = [fh.GradientStats(), fh.UpdateRatio()]
    opt = torch.optim.Adam(model.parameters())
    fh.fit(model, _batches(2), MSE, opt, reducers)
    old = weakref.ref(opt)
    opt = torch.optim.Adam(model.parameters())
    fh.fit(model, _batches(2), MSE, opt, reducers)
    gc.collect()
    assert old() is None
    ref, last = weakref.ref(model), weakref.ref(opt)
    del model, opt
    gc.collect()
    assert ref() is None and last() is None
