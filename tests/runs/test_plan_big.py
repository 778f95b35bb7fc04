"""Plans of big models: made in time linear in the model, with the garbage collector paused
while they are made (and left as the user had it), selecting exactly what the selector says."""

from __future__ import annotations

import collections
import gc
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Callable, Iterator

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given
from torch import nn

import funhooks as fh

BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
NAMES = ("a", "b", "mlp", "0", "1")
LEAVES: tuple[Callable[[], nn.Module], ...] = (nn.Identity, nn.ReLU, nn.Tanh)


@pytest.fixture
def collector() -> Iterator[None]:
    """The test may turn the collector off; it is put back on afterwards."""
    was = gc.isenabled()
    try:
        yield
    finally:
        (gc.enable if was else gc.disable)()


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))


def test_the_collector_is_paused_while_a_plan_is_made_and_back_on_after(collector: None) -> None:
    """A predicate called while the plan is made sees the collector off; after the run it is on again."""
    seen: list[bool] = []

    def linear(path: str, module: nn.Module) -> bool:
        seen.append(gc.isenabled())
        return isinstance(module, nn.Linear)

    gc.enable()
    model = _model()
    with fh.with_hooks(model, fh.outputs(linear)) as run:
        model(torch.randn(1, 2))
    assert seen and not any(seen)
    assert gc.isenabled()
    assert list(run.record) == ["0", "2.0"]


def test_the_collector_is_back_on_after_a_selector_error(collector: None) -> None:
    """A plan that fails (no module matches) leaves the collector on, and the model unhooked."""
    gc.enable()
    model = _model()
    with pytest.raises(fh.SelectorError, match="matched no module"):
        fh.with_hooks(model, fh.outputs("head"))
    assert gc.isenabled()
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_the_collector_is_back_on_after_a_predicate_raises(collector: None) -> None:
    """A predicate raising while the plan is made: the error propagates, the collector is on."""
    def broken(path: str, module: nn.Module) -> bool:
        raise ValueError("broken predicate")

    gc.enable()
    with pytest.raises(ValueError, match="broken predicate"):
        fh.capture(_model(), fh.outputs(broken))
    assert gc.isenabled()


@pytest.mark.parametrize("fails", [False, True])
def test_a_collector_the_user_turned_off_stays_off(collector: None, fails: bool) -> None:
    """Making a plan never turns on a collector the user had off, whether it succeeds or fails."""
    gc.disable()
    model = _model()
    if fails:
        with pytest.raises(fh.SelectorError):
            fh.with_hooks(model, fh.outputs("head"))
    else:
        with fh.with_hooks(model, fh.outputs("**")):
            model(torch.randn(1, 2))
    assert not gc.isenabled()


def test_a_plan_on_20000_modules_records_every_path() -> None:
    """A model of 20,000 modules in 100 blocks: the run records every one of them, in module order."""
    model = nn.Sequential(*[nn.Sequential(*[nn.Identity() for _ in range(199)]) for _ in range(100)])
    with fh.with_hooks(model, fh.outputs("**")) as run:
        model(torch.zeros(1))
    expected = [p for p, _ in model.named_modules() if p]
    assert len(expected) == 20_000
    assert list(run.record) == expected


def test_hook_outputs_on_4000_modules_keeps_the_list_order() -> None:
    """fastai's `hook_outputs` over 4,000 modules given in reverse: `stored` follows the list."""
    layers = [nn.Linear(1, 1) for _ in range(4_000)]
    model = nn.Sequential(*layers)
    with fh.with_hooks(model, fh.hook_outputs(layers[::-1])) as run:
        y = model(torch.ones(1))
    assert len(run.stored) == 4_000
    assert torch.equal(run.stored[0], y) and run.stored[-1] is not run.stored[0]


# -- selection on random trees ------------------------------------------------------------


@st.composite
def trees(draw: st.DrawFn, depth: int = 3) -> nn.Module:
    """A random tree of Sequentials with named children, leaves of a few types, some shared."""
    made: list[nn.Module] = []

    def node(level: int) -> nn.Module:
        if level >= depth or draw(st.booleans()):
            if made and draw(st.integers(0, 4)) == 0:  # a module registered at a second path
                return draw(st.sampled_from(made))
            leaf = draw(st.sampled_from(LEAVES))()
            made.append(leaf)
            return leaf
        names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
        return nn.Sequential(collections.OrderedDict((n, node(level + 1)) for n in names))

    return nn.Sequential(collections.OrderedDict(
        (n, node(1)) for n in draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))))


def _segments_match(pattern: list[str], path: list[str]) -> bool:
    """The reference: `*` is one segment, `**` any number, anything else itself."""
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_segments_match(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and head in ("*", path[0]) and _segments_match(rest, path[1:])


patterns = st.lists(st.sampled_from(("*", "**", *NAMES)), min_size=1, max_size=4).map(".".join)


@given(trees(), st.one_of(patterns, st.sampled_from(LEAVES + (nn.Sequential,))), st.data())
def test_a_plan_selects_exactly_what_named_modules_and_the_selector_give(model: nn.Module, where: object,
                                                                        data: st.DataObject) -> None:
    """For random trees (shared modules included), the run records exactly the modules of
    `named_modules()` the selector names, in that order, and a list of modules in the list's order."""
    every = [(p, m) for p, m in model.named_modules() if p]
    if isinstance(where, str):  # a pattern never matches the root
        expected = [p for p, _ in every if _segments_match(where.split("."), p.split("."))]
    else:
        expected = [p for p, m in model.named_modules() if isinstance(m, where)]  # type: ignore[arg-type]
    x = torch.zeros(1)
    if not expected:
        with pytest.raises(fh.SelectorError):
            fh.with_hooks(model, fh.outputs(where))  # type: ignore[arg-type]
    else:
        with fh.with_hooks(model, fh.outputs(where)) as run:  # type: ignore[arg-type]
            model(x)
        assert list(run.record) == expected
    chosen = data.draw(st.lists(st.sampled_from(every), min_size=1, unique_by=lambda pm: id(pm[1])))
    with fh.with_hooks(model, fh.hook_outputs([m for _, m in chosen])) as run:
        model(x)
    assert list(run.record) == [p for p, m in every if any(m is c for _, c in chosen)]
    assert len(run.stored) == len(chosen)


def test_bench_plan_smoke(tmp_path: pathlib.Path) -> None:
    """bench_plan --quick runs every case at every size and writes its JSON (no timing claim)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bench_plan.py"), "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "plan.json").read_text())
    assert result["benchmark"] == "plan" and result["quick"] is True and result["correct"] is True
    assert set(result["results"]) == {"with_hooks", "capture", "hook_outputs", "again", "moe"}
    for case in result["results"].values():
        assert case["max_over_min"] >= 1.0
        assert all(s["us_per_module"]["median"] > 0 for s in case["sizes"].values())
