"""Scope: a run sees only the calls of the context that entered it (its thread, its asyncio
task); pure functions are safe from many threads; nothing of funhooks stays in the process
after its runs and capture functions are gone (issue 12)."""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
import threading
from collections.abc import Callable

import hypothesis
import pytest
import torch
from helpers import RECORDS_IN_COMPILE
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_module_registration_hooks",
                 "_global_buffer_registration_hooks", "_global_parameter_registration_hooks")


def _global_hooks() -> dict[str, int]:
    import torch.nn.modules.module as module_hooks

    return {name: len(getattr(module_hooks, name)) for name in _GLOBAL_HOOKS}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _in_threads(work: Callable[[int], None], n: int) -> list[BaseException]:
    """Run `work(i)` in `n` threads at once; the exceptions they raised."""
    errors: list[BaseException] = []
    start = threading.Barrier(n)

    def target(i: int) -> None:
        start.wait()
        try:
            work(i)
        except BaseException as err:  # reported to the test
            errors.append(err)

    threads = [threading.Thread(target=target, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.fixture(autouse=True)
def _switch_often() -> None:
    """Make threads interleave inside module calls, not only between them."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(interval)


def test_a_serving_thread_runs_untouched_beside_an_inspecting_one() -> None:
    """One thread keeps opening runs (recording, and zeroing a layer) while another serves
    plain calls of the same model: the server never errs and always gets the plain output;
    each run's Record holds exactly its own calls."""
    model = _model()
    x_serve, x_inspect = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        plain = model(x_serve)
    stop = threading.Event()
    bad: list[str] = []

    def work(i: int) -> None:
        if i == 0:  # inspecting
            try:
                for _ in range(300):
                    specs = [fh.outputs("**"), fh.inputs("2"), fh.edit("3", lambda m, a, o: torch.zeros_like(o))]
                    with torch.no_grad(), fh.with_hooks(model, specs) as run:
                        y = model(x_inspect)
                    rec = run.record
                    if len(rec) != 5 or any(len(rec.calls(p, "output")) != 1 for p in rec):
                        bad.append(f"inspecting run recorded {[len(rec.calls(p, 'output')) for p in rec]}")
                    if not torch.equal(rec["0"]["output"], model[0](x_inspect).detach()):
                        bad.append("inspecting run stored the server's input")
                    if not torch.equal(y, model[4].bias.expand(4, 4)):
                        bad.append("inspecting run's editor did not apply")
            finally:
                stop.set()
        else:  # serving
            while not stop.is_set():
                with torch.no_grad():
                    if not torch.equal(model(x_serve), plain):
                        bad.append("the server's output was edited")

    assert _in_threads(work, 2) == []
    assert bad == []
    fh.testing.assert_no_hooks(model)


def test_two_threads_with_runs_on_one_model_each_see_their_calls() -> None:
    """Runs in two threads on one model, entered and exited concurrently: each Record holds
    exactly the calls of its own thread, and the model ends as it began."""
    model = _model()
    xs = [torch.randn(2, 8), torch.randn(3, 8)]
    bad: list[str] = []

    def work(i: int) -> None:
        for _ in range(200):
            with torch.no_grad(), fh.with_hooks(model, [fh.outputs(["0", "4"]), fh.inputs("0")]) as run:
                model(xs[i])
                model(xs[i])
            rec = run.record
            if [x[0][0].shape[0] for x in rec.calls("0", "input")] != [len(xs[i])] * 2:
                bad.append(f"thread {i} saw calls {[x[0][0].shape for x in rec.calls('0', 'input')]}")

    assert _in_threads(work, 2) == []
    assert bad == []
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_capture_functions_are_safe_to_call_from_many_threads() -> None:
    """One capture function called from 4 threads: every call's Record holds exactly its own
    call of every selected module, equal to that call's values."""
    model = _model()
    f = fh.capture(model, [fh.outputs("**"), fh.inputs("0")])
    bad: list[str] = []

    def work(i: int) -> None:
        x = torch.full((i + 1, 8), float(i))
        for _ in range(150):
            with torch.no_grad():
                y, rec = f(x)
            if len(rec) != 5 or any(len(rec.calls(p, "output")) != 1 for p in rec):
                bad.append(f"thread {i}: {[len(rec.calls(p, 'output')) for p in rec]} calls")
            elif not (torch.equal(rec["4"]["output"], y) and torch.equal(rec["0"]["input"][0][0], x)):
                bad.append(f"thread {i}: another call's values")

    assert _in_threads(work, 4) == []
    assert bad == []


def test_an_editor_in_one_thread_never_changes_another_threads_results() -> None:
    """Per-request interventions in a threaded server: each thread's editor applies to its
    own calls only."""
    model = _model()
    x = torch.randn(2, 8)
    with torch.no_grad():
        plain = model(x)
    results: dict[int, list[torch.Tensor]] = {0: [], 1: [], 2: []}

    def work(i: int) -> None:
        edit = fh.edit("4", lambda m, a, o, k=i: o + k)
        for _ in range(100):
            with torch.no_grad(), fh.with_hooks(model, edit):
                results[i].append(model(x))

    assert _in_threads(work, 3) == []
    for i, outs in results.items():
        assert all(torch.equal(y, plain + i) for y in outs), i


def test_asyncio_tasks_each_see_their_own_calls() -> None:
    """Two asyncio tasks interleaving their calls inside their own blocks: each Record holds
    only its task's calls."""
    model = _model()

    async def task(x: torch.Tensor) -> fh.Record:
        with fh.with_hooks(model, fh.inputs("0")) as run:
            for _ in range(5):
                model(x)
                await asyncio.sleep(0)
        return run.record

    async def both() -> list[fh.Record]:
        return await asyncio.gather(task(torch.ones(1, 8)), task(torch.zeros(2, 8)))

    first, second = asyncio.run(both())
    assert [a[0][0].shape[0] for a in first.calls("0", "input")] == [1] * 5
    assert [a[0][0].shape[0] for a in second.calls("0", "input")] == [2] * 5


@hypothesis.settings(max_examples=10, deadline=None)
@given(fh.testing.models_and_inputs(), st.integers(2, 3))
def test_concurrent_runs_on_random_models_each_see_only_their_calls(model_x: tuple[nn.Module, torch.Tensor],
                                                                     threads: int) -> None:
    """For random models, runs in several threads at once each record as many calls per
    module as the same run alone, and leave every module's `__dict__` as it was."""
    model, x = model_x
    model.eval()
    before = {p: dict(m.__dict__) for p, m in model.named_modules()}
    with torch.no_grad(), fh.with_hooks(model, fh.outputs("**", clone=True)) as alone:
        model(x)
    expected = {p: len(alone.record.calls(p, "output")) for p in alone.record}
    seen: list[dict[str, int]] = []

    def work(i: int) -> None:
        for _ in range(10):
            with torch.no_grad(), fh.with_hooks(model, fh.outputs("**", clone=True)) as run:
                model(x)
            seen.append({p: len(run.record.calls(p, "output")) for p in run.record})

    assert _in_threads(work, threads) == []
    assert all(counts == expected for counts in seen)
    assert {p: dict(m.__dict__) for p, m in model.named_modules()} == before


# -- no residue --------------------------------------------------------------------------------


@pytest.mark.usefixtures("frozen_heap")
@RECORDS_IN_COMPILE
@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
def test_runs_on_compiled_models_and_capture_functions_leave_nothing_in_the_process() -> None:
    """After a run on a model compiled before it and after a capture function is gone: no
    global hook anywhere, and code compiled earlier is not compiled again (funhooks never
    drops the user's compiled code)."""
    from torch._dynamo.utils import counters

    before = _global_hooks()
    double = torch.compile(lambda t: t * 2 + 1, backend="eager")
    double(torch.ones(3))
    model = _model()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(2, 8)
    compiled(x)
    frames = counters["stats"]["unique_graphs"]
    with fh.with_hooks(compiled, fh.outputs("**")) as run:
        compiled(x)
    assert list(run.record) == ["0", "1", "2", "3", "4"]
    f = fh.capture(model, fh.outputs("0"))
    f(x)
    assert _global_hooks() == before
    del f
    gc.collect()
    double(torch.ones(3))
    compiled(x)
    assert counters["stats"]["unique_graphs"] == frames + 1  # the run's recorder, once; nothing else recompiled
    assert _global_hooks() == before
    fh.testing.assert_no_hooks(model)


def test_importing_funhooks_changes_nothing_global() -> None:
    """`import funhooks` installs no global module hook and no warnings filter."""
    probe = (
        "import warnings, torch, torch.nn.modules.module as m\n"
        f"names = {_GLOBAL_HOOKS!r}\n"
        "state = lambda: ([len(getattr(m, n)) for n in names], list(warnings.filters))\n"
        "before = state()\n"
        "import funhooks\n"
        "assert state() == before, (before, state())\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
