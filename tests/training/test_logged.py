"""Statistics sent to a logger as they are computed (issue 30): every library reducer's
``scalars``, ``fh.Logged`` writing them every few steps, read back from TensorBoard files."""

from __future__ import annotations

import math
import pathlib
import threading
from typing import Any

import pytest
import torch
from torch import nn

import funhooks as fh

MSE = nn.functional.mse_loss
STEPS = 5


class ListWriter:
    """A writer keeping what it is given: ``(step, tag, value)`` rows."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, str, float]] = []

    def add_scalar(self, tag: str, value: float, global_step: int | None = None) -> None:
        self.rows.append((int(global_step or 0), tag, value))

    def at(self, step: int) -> dict[str, float]:
        return {tag: value for s, tag, value in self.rows if s == step}


def _model(device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1)).to(device)


def _batches(device: torch.device | str = "cpu", n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 3, generator=g).to(device), torch.randn(8, 1, generator=g).to(device)) for _ in range(n)]


def _reducers() -> dict[str, Any]:
    return {"activations": fh.ActivationStats(include_paramless=True), "grads": fh.GradientStats(),
            "update": fh.UpdateRatio(), "dead": fh.DeadUnits(), "loss": fh.LossCurve()}


def expected(res: dict[str, Any], k: int) -> dict[str, float]:
    """What a logger gets at recorded step `k` of every reducer, read off the results."""
    out: dict[str, float] = {}
    acts, grads = res["activations"], res["grads"]
    for path, s in zip(acts.paths, acts.stats[k]):
        out.update({f"funhooks/activations/{path}/{name}": s[name] for name in ("mean", "std", "near_zero")})
    for path, s in zip(grads.paths, grads.stats[k]):
        out.update({f"funhooks/grads/{path}/{name}": s[name] for name in ("norm", "mean", "std", "zeros")})
    out.update({f"funhooks/update/{p}/ratio": r for p, r in zip(res["update"].paths, res["update"].ratios[k])})
    out.update({f"funhooks/dead/{p}/dead": d for p, d in zip(res["dead"].paths, res["dead"].dead[k])})
    out.update({"funhooks/loss/loss": res["loss"].losses[k], "funhooks/loss/ema": res["loss"].ema[k]})
    return out


def test_logged_writes_each_reducers_numbers_of_the_step_as_its_result_gives_them(device: torch.device) -> None:
    """Every `every` steps, the scalars written are the numbers the results hold for that step, exactly."""
    writer = ListWriter()
    model = _model(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    res = fh.fit(model, _batches(device), MSE, opt, fh.Logged(_reducers(), writer, every=2), progress=False)
    assert sorted({s for s, _, _ in writer.rows}) == [0, 2, 4]
    for k in (0, 2, 4):
        assert writer.at(k) == expected(res, k)
    assert "funhooks/activations/1/std" in writer.at(0)  # the ReLU, a layer named by its path


def test_scalars_are_the_newest_steps_since_and_nothing_older() -> None:
    """`scalars(state, since=i)` gives the newest recorded step when its iteration is `i` or later, else {}."""
    stats = fh.GradientStats(every=2)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = fh.train(model, _batches(), MSE, opt, watches=stats.watches)
    state = stats.init()
    for step in steps:
        state = stats.step(state, step)
    res = stats.result(state)
    assert res.iterations == (0, 2, 4)
    assert stats.scalars(state) == stats.scalars(state, since=4)
    assert stats.scalars(state, since=4) == {f"{p}/{n}": v for p, row in zip(res.paths, res.stats[-1]) for n, v in row.items()}
    assert stats.scalars(state, since=5) == {}
    assert stats.scalars(stats.init()) == {}


def test_every_library_reducer_has_scalars() -> None:
    """One protocol: every library reducer is a `fh.Scalars`, and its empty state gives {}."""
    reducers = [*_reducers().values(), fh.HookCallback(lambda m, i, o: o.mean()), fh.OutputMeans(nn.Linear)]
    for reducer in reducers:
        assert isinstance(reducer, fh.Scalars)
        assert reducer.scalars(reducer.init(), since=0) == {}


def test_hook_callback_scalars_are_its_number_values() -> None:
    """HookCallback gives the hook values that are numbers, by module index and record name."""
    cb = fh.HookCallback(lambda m, i, o: o.mean(), name="mean")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = ListWriter()
    res = fh.fit(model, _batches(n=1), MSE, opt, fh.Logged([cb], writer, every=1), progress=False)
    assert writer.at(0) == {f"funhooks/HookCallback/{i}/mean": v.item() for i, v in enumerate(res[0][0])}


class Counting:
    """A user's reducer counting the steps and how often a logger reads it."""

    specs = ()

    def __init__(self) -> None:
        self.reads: list[int] = []

    def init(self) -> int:
        return 0

    def step(self, state: int, step: fh.Step) -> int:
        return state + 1

    def result(self, state: int) -> int:
        return state

    def scalars(self, state: int, *, since: int = 0) -> dict[str, float]:
        self.reads.append(since)
        return {"steps": float(state)}


def test_logged_reads_only_at_the_interval() -> None:
    """The reducers are read on every `every`-th step only (ceil(n / every) reads), each for that step."""
    counting, writer = Counting(), ListWriter()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert fh.fit(model, _batches(n=7), MSE, opt, {"n": fh.Logged({"count": counting}, writer, every=3)},
                  progress=False) == {"n": {"count": 7}}
    assert counting.reads == [0, 3, 6]
    assert writer.rows == [(0, "funhooks/count/steps", 1.0), (3, "funhooks/count/steps", 4.0),
                           (6, "funhooks/count/steps", 7.0)]


def test_logged_list_groups_are_class_names() -> None:
    """In a list, a reducer's group is its class name, numbered when the class comes twice."""
    assert fh.training.logged.group_names([fh.LossCurve(), fh.GradientStats(), fh.GradientStats()]) == (
        "LossCurve", "GradientStats.1", "GradientStats.2")


def test_logged_refuses_a_bad_interval_and_a_bad_writer() -> None:
    """`every` must be a positive int; `to` a directory or a writer with `add_scalar`."""
    with pytest.raises(fh.LoopError) as err:
        fh.Logged({"loss": fh.LossCurve()}, ListWriter(), every=0)
    assert str(err.value) == ("Logged: `every` is a positive int (log every that many steps) or None (do not log), "
                              "got 0. Pass e.g. every=50.")
    with pytest.raises(fh.ReducerError) as err:
        fh.Logged({"loss": fh.LossCurve()}, 3)
    assert str(err.value) == ("Logged: `to` is a log directory or a writer with `add_scalar(tag, value, global_step)`, "
                              "got 3. Pass a path, or a torch.utils.tensorboard.SummaryWriter.")


def _events(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_event_files_hold_the_results(tmp_path: pathlib.Path) -> None:
    """Written to a log directory, TensorBoard's reader gives back the results' numbers (as float32)."""
    pytest.importorskip("tensorboard", reason="the `tensorboard` extra is not installed")

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = fh.Logged({"activations": fh.ActivationStats(every=2), "loss": fh.LossCurve()}, tmp_path, every=2)
    res = fh.fit(model, _batches(), MSE, opt, logged, progress=False)
    events = _events(tmp_path)
    assert events["funhooks/loss/ema"] == [(k, pytest.approx(res["loss"].ema[k], rel=1e-6)) for k in (0, 2, 4)]
    means, stds, near_zero = res["activations"].layer_stats("2")
    assert events["funhooks/activations/2/std"] == [(k, pytest.approx(s, rel=1e-6)) for k, s in zip((0, 2, 4), stds)]
    assert not any(math.isnan(v) for series in events.values() for _, v in series)


def test_a_point_logged_at_step_i_is_step_is_result_when_the_intervals_differ() -> None:
    """Issue 36 item 8: `GradientStats(every=2)` in `Logged(..., every=3)` wrote step 2's
    statistics at step 3 (the newest the reducer had). A point at step i is the result for step
    i: the logger writes a reducer only at steps it recorded, here 0 and 6 (the common steps)."""
    writer = ListWriter()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = fh.Logged({"grads": fh.GradientStats(every=2), "loss": fh.LossCurve()}, writer, every=3)
    res = fh.fit(model, _batches(n=8), MSE, opt, logged, progress=False)
    grads = res["grads"]
    assert grads.iterations == (0, 2, 4, 6)
    steps = sorted({s for s, tag, _ in writer.rows if tag.startswith("funhooks/grads/")})
    assert steps == [0, 6]
    for s in steps:
        k = grads.iterations.index(s)
        for path, stats in zip(grads.paths, grads.stats[k]):
            assert writer.at(s)[f"funhooks/grads/{path}/norm"] == stats["norm"]
    assert sorted({s for s, tag, _ in writer.rows if tag.startswith("funhooks/loss/")}) == [0, 3, 6]
    assert all(writer.at(s)["funhooks/loss/loss"] == res["loss"].losses[s] for s in (0, 3, 6))


def _threads() -> set:
    return set(threading.enumerate())


def test_a_log_directory_leaves_no_thread_behind(tmp_path: pathlib.Path) -> None:
    """Issue 36 item 4: each `Logged(reducers, logdir)` left a TensorBoard writer thread alive
    (5 fits: 5 threads). Nothing is left open after a run that ends, fails, or is abandoned
    (`fh.folding` closed mid-run), and every fit's points are in the directory."""
    pytest.importorskip("tensorboard", reason="the `tensorboard` extra is not installed")
    before = _threads()
    for i in range(5):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fh.fit(model, _batches(), MSE, opt, fh.Logged({"loss": fh.LossCurve()}, tmp_path / str(i), every=2),
               progress=False)
    assert _threads() - before == set()
    assert all(len(_events(tmp_path / str(i))["funhooks/loss/loss"]) == 3 for i in range(5))

    class Boom(Exception):
        pass

    def failing(model: nn.Module, batch: Any) -> torch.Tensor:
        raise Boom

    model = _model()
    with pytest.raises(Boom):
        fh.fit(model, _batches(), failing, torch.optim.SGD(model.parameters(), lr=0.1),
               fh.Logged({"loss": fh.LossCurve()}, tmp_path / "failed", every=1), progress=False)
    assert _threads() - before == set()

    model = _model()
    with fh.folding(model, fh.Logged({"acts": fh.ActivationStats()}, tmp_path / "folding", every=1)) as fold:
        for x, _ in _batches(n=2):
            model(x)
            fold.step()
    assert _threads() - before == set()
    assert len(_events(tmp_path / "folding")["funhooks/acts/0/std"]) == 2

    model = _model()
    logged = fh.Logged({"loss": fh.LossCurve()}, tmp_path / "running", every=1)
    live = fh.running(logged, fh.train(model, _batches(), MSE, torch.optim.SGD(model.parameters(), lr=0.1)))
    next(live), next(live)
    live.close()  # abandoned after two steps
    assert _threads() - before == set()
    assert len(_events(tmp_path / "running")["funhooks/loss/loss"]) == 2
