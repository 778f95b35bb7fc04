"""ActivationStats: fastai's results, as folds kept on the device."""

from __future__ import annotations

import itertools
import math
import pathlib
import subprocess
import sys

import hypothesis
import pytest
import reducer_kit as kit
import toolz
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh
from funhooks.reducers import activation_stats as fhstats

MSE = kit.MSE

ROOT = pathlib.Path(__file__).resolve().parents[2]


# -- fastai's documented tests, ported --------------------------------------------------------


@pytest.mark.parametrize("n_tr", [11, 12, 13])
@pytest.mark.parametrize("every", [4, 1])
def test_every_records_ceil_n_over_every(n_tr: int, every: int) -> None:
    """fastai's test_every: n_tr train batches with every=k give ceil(n_tr / k) stats."""
    model = nn.Linear(2, 1)
    res = fh.fit(model, kit.batches(n_tr, (4, 2), 1), MSE, torch.optim.SGD(model.parameters(), lr=0.01),
                 fh.ActivationStats(every=every))
    assert len(res.stats) == math.ceil(n_tr / every)
    assert res.iterations == tuple(range(0, n_tr, every))


@hypothesis.given(n=st.integers(1, 9), every=st.integers(1, 5), epochs=st.integers(1, 2))
def test_every_counts_train_iterations_only(n: int, every: int, epochs: int) -> None:
    """Evaluation steps never count; iterations run across epochs: ceil(n * epochs / every)."""
    model = nn.Linear(2, 1)
    batches = kit.batches(n, (4, 2), 1)
    stats = fh.ActivationStats(every=every)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = itertools.chain(fh.evaluate(model, batches, MSE, specs=stats.specs),
                            fh.train(model, batches, MSE, opt, specs=stats.specs, epochs=epochs),
                            fh.evaluate(model, batches, MSE, specs=stats.specs))
    assert len(fh.fold(stats, steps).stats) == math.ceil(n * epochs / every)


# -- values --------------------------------------------------------------------------------------


def _expected(o: torch.Tensor) -> dict[str, float]:
    o = o.float()
    return {"mean": o.mean().item(), "std": o.std().item(), "near_zero": (o <= 0.05).long().sum().item() / o.numel()}


@pytest.mark.parametrize("width", [4, 300])  # 6 x 300 x 40 > REDUCE_IN_HOOK_NUMEL: reduced in the hook
def test_stats_equal_hand_computed_values(device: torch.device, width: int) -> None:
    """mean, std (unbiased), near_zero (<= 0.05) and histc(40, 0, 10) as fastai defines them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, width), nn.ReLU(inplace=True), nn.Linear(width, 2)).to(device)
    batches = [(torch.randn(6, 40, 3, device=device) * 3, torch.randn(6, 40, 2, device=device)) for _ in range(3)]
    res = fh.fit(model, batches, MSE, kit.frozen_opt(model), fh.ActivationStats(with_hist=True))
    assert res.paths == ("0", "2")
    for step_stats, (x, _) in zip(res.stats, batches):
        with torch.no_grad():
            first = model[0](x)  # before the in-place ReLU changed it
            outs = [first, model[2](first.relu())]
        for got, o in zip(step_stats, outs):
            want = _expected(o)
            assert got["mean"] == pytest.approx(want["mean"], rel=1e-5, abs=1e-6)
            assert got["std"] == pytest.approx(want["std"], rel=1e-5)
            assert got["near_zero"] == want["near_zero"]
            assert torch.equal(got["hist"], o.float().histc(40, 0, 10).cpu())
    means, stds, near_zero = res.layer_stats("2")
    assert means == [s[1]["mean"] for s in res.stats] and len(stds) == len(near_zero) == 3
    hist = res.hist(0)
    assert hist.shape == (40, 3) and torch.equal(hist[:, 1], res.stats[1][0]["hist"].float().log1p())


def test_named_parameters_replace_fastai_constants() -> None:
    """near_zero and the histogram are parameters with fastai's values as defaults."""
    assert (fhstats.NEAR_ZERO, fhstats.HIST_BINS, fhstats.HIST_RANGE) == (0.05, 40, (0.0, 10.0))
    model = nn.Linear(3, 5)
    batches = kit.batches(2, out=5)
    res = fh.fit(model, batches, MSE, kit.frozen_opt(model),
                 fh.ActivationStats(with_hist=True, near_zero=0.0, hist_bins=4, hist_range=(-1, 1)))
    o = model(batches[0][0]).detach()
    assert res.stats[0][0]["near_zero"] == (o <= 0.0).sum().item() / o.numel()
    assert torch.equal(res.stats[0][0]["hist"], o.histc(4, -1, 1))


def test_default_modules_and_selectors() -> None:
    """Default: leaves with parameters; include_paramless adds the other leaves; modules= selects."""
    model = kit.mlp()
    run = lambda r: fh.fit(model, kit.batches(1), MSE, kit.frozen_opt(model), r).paths  # noqa: E731
    assert run(fh.ActivationStats()) == ("0", "2")
    assert run(fh.ActivationStats(include_paramless=True)) == ("0", "1", "2")
    assert run(fh.ActivationStats(modules=nn.ReLU)) == ("1",)
    assert run(fh.ActivationStats(modules=[model[2]])) == ("2",)


# -- merging -------------------------------------------------------------------------------------


@hypothesis.given(cuts=st.lists(st.integers(0, 8), max_size=3), every=st.one_of(st.none(), st.integers(1, 3)),
                  with_hist=st.booleans())
def test_fold_over_chunks_merged_equals_one_pass(cuts: list[int], every: int | None, with_hist: bool) -> None:
    """Folding chunks of the steps separately and merging their states == one pass, exactly."""
    model = kit.mlp()
    stats, hooks = fh.ActivationStats(with_hist=with_hist, every=every), fh.HookCallback(lambda m, i, o: o, every=every)
    steps = list(fh.train(model, kit.batches(8), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
                          specs=stats.specs + hooks.specs))
    bounds = [0, *sorted(cuts), len(steps)]
    chunks = [steps[a:b] for a, b in zip(bounds, bounds[1:])]
    for reducer in (stats, hooks):
        states = [toolz.reduce(reducer.step, chunk, reducer.init()) for chunk in chunks]
        merged = reducer.result(toolz.reduce(reducer.merge, states[::-1]))  # order of merging does not matter
        whole = fh.fold(reducer, steps)
        if reducer is stats:
            assert merged.iterations == whole.iterations
            for a, b in zip(merged.stats, whole.stats):
                assert [{k: v for k, v in d.items() if k != "hist"} for d in a] == \
                    [{k: v for k, v in d.items() if k != "hist"} for d in b]
        else:
            assert len(merged) == len(whole)
            assert all(torch.equal(x, y) for a, b in zip(merged, whole) for x, y in zip(a, b))


@hypothesis.given(split=st.integers(1, 11))
def test_merge_of_ranks_equals_the_whole_batch(split: int) -> None:
    """Two ranks' states of the same iteration combine (Chan) into the stats of the joint batch."""
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(12, 3)
    stats = fh.ActivationStats(with_hist=True)

    def state(xs: torch.Tensor) -> tuple:
        with fh.with_hooks(model, stats.specs) as run:
            model(xs)
        step = fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record, training=True)
        return stats.step(stats.init(), step)

    merged = stats.result(stats.merge(state(x[:split]), state(x[split:]))).stats[0]
    whole = stats.result(state(x)).stats[0]
    for a, b in zip(merged, whole):
        assert a["mean"] == pytest.approx(b["mean"], rel=1e-5, abs=1e-6)
        assert a["std"] == pytest.approx(b["std"], rel=1e-5)
        assert a["near_zero"] == pytest.approx(b["near_zero"])
        assert torch.equal(a["hist"], b["hist"])


# -- bad input -----------------------------------------------------------------------------------


def test_every_must_be_positive() -> None:
    """every <= 0 is a ReducerError at construction."""
    with pytest.raises(fh.ReducerError) as err:
        fh.ActivationStats(every=0)
    assert str(err.value) == (
        "ActivationStats: `every` is a positive int or None, got 0. "
        "Pass every=1 (or None) to record every train step, every=k for one in k."
    )
    with pytest.raises(fh.ReducerError, match=r"^HookCallback: `every` is a positive int or None, got -2"):
        fh.HookCallback(print, every=-2)


def test_layer_stats_out_of_range_says_how_many_modules() -> None:
    """Reading a module index out of range names the count and the paths."""
    model = kit.mlp()
    res = fh.fit(model, kit.batches(2), MSE, kit.frozen_opt(model), fh.ActivationStats())
    with pytest.raises(fh.ReducerError) as err:
        res.layer_stats(5)
    assert str(err.value) == (
        "layer_stats: `idx` is a module index in range(-2, 2) or a module path, got 5; there are 2 modules: "
        "['0', '2']. Pick one of those."
    )
    with pytest.raises(fh.ReducerError, match=r"^hist: histograms are kept by `ActivationStats\(with_hist=True\)`"):
        res.hist(0)


def test_missing_records_are_explained() -> None:
    """Steps run without the reducer's specs say what to do."""
    model = kit.mlp()
    steps = fh.train(model, kit.batches(1), MSE, kit.frozen_opt(model))
    with pytest.raises(fh.ReducerError) as err:
        fh.fold(fh.ActivationStats(), steps)
    assert str(err.value) == (
        "ActivationStats: a recorded train step holds the records of the reducer's specs, got 1 recorded steps and "
        "no 'activation_stats' in any of their records. Run the steps with `specs=reducer.specs` (fh.fit does), "
        "and select modules that run."
    )
    with pytest.raises(fh.ReducerError, match=r"holds the records of the reducer's specs, got a Step whose record"):
        fh.fold(fh.HookCallback(print), fh.train(model, kit.batches(1), MSE, kit.frozen_opt(model)))


# -- plots -------------------------------------------------------------------------------------


def test_plots_save_as_png(tmp_path: pathlib.Path) -> None:
    """plot_layer_stats returns a Figure, color_dim draws on Axes; both save as PNG."""
    model = kit.mlp()
    res = fh.fit(model, kit.batches(4), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
                 fh.ActivationStats(with_hist=True))
    fig = res.plot_layer_stats(0)
    fig.savefig(tmp_path / "stats.png")
    ax = res.color_dim(1)
    ax.figure.savefig(tmp_path / "color.png")
    assert (tmp_path / "stats.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "color.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_of_a_sometimes_skipped_module_show_gaps() -> None:
    """A module absent on some steps plots NaN gaps with a dot per step, and zero columns."""
    model = kit.StochasticDepth([(True, False), (True, True), (True, False)])
    res = fh.fit(model, kit.batches(3, (6, 4), 4), MSE, kit.frozen_opt(model), fh.ActivationStats(with_hist=True))
    line = res.plot_layer_stats("blocks.1").axes[0].lines[0]
    assert line.get_marker() == "." and [math.isnan(v) for v in line.get_ydata()] == [True, False, True]
    assert res.plot_layer_stats("blocks.0").axes[0].lines[0].get_marker() == "None"
    image = res.color_dim("blocks.1").images[0].get_array()
    assert image.shape == (40, 3) and not image[:, 0].any() and not image[:, 2].any()


def test_plotting_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib, plotting raises ExtraError naming `funhooks[plot]`."""
    model = kit.mlp()
    res = fh.fit(model, kit.batches(2), MSE, kit.frozen_opt(model), fh.ActivationStats())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(fh.ExtraError) as err:
        res.plot_layer_stats(0)
    assert str(err.value) == (
        "plot_layer_stats: plotting needs matplotlib, got it not installed. Install the extra: pip install 'funhooks[plot]'."
    )


def test_importing_funhooks_does_not_import_matplotlib() -> None:
    """matplotlib is imported only when something is drawn."""
    code = "import sys, funhooks; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


# -- device ------------------------------------------------------------------------------------


def test_fit_with_activation_stats_never_syncs_the_gpu(device: torch.device) -> None:
    """Under torch.cuda.set_sync_debug_mode("error"), fit + ActivationStats runs: no host sync per batch."""
    if device.type != "cuda":
        pytest.skip("host syncs are a CUDA notion")
    model = kit.mlp(device)
    batches = kit.batches(4, device=device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.cuda.set_sync_debug_mode("error")
    try:
        res = fh.fit(model, batches, MSE, opt, fh.ActivationStats(with_hist=True, every=2), progress=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(res.stats) == 2 and res.entries[0].rows.device.type == "cuda"


def test_example_script_runs(tmp_path: pathlib.Path) -> None:
    """examples/activation_stats.py trains, prints layer stats and writes two PNGs."""
    script = ROOT / "examples" / "activation_stats.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                         check=True, timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": ""}).stdout
    assert "layer" in out
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["color_dim.png", "layer_stats.png"]


# -- arguments are checked at construction (issue 11) ---------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hist_bins": 0}, ("ActivationStats: `hist_bins` is a positive int, got 0. "
                            "Pass the number of histogram bins, e.g. hist_bins=40 (fastai's).")),
        ({"hist_bins": 2.5}, ("ActivationStats: `hist_bins` is a positive int, got 2.5. "
                              "Pass the number of histogram bins, e.g. hist_bins=40 (fastai's).")),
        ({"hist_bins": True}, ("ActivationStats: `hist_bins` is a positive int, got True. "
                               "Pass the number of histogram bins, e.g. hist_bins=40 (fastai's).")),
        ({"hist_range": 3}, ("ActivationStats: `hist_range` is a pair (low, high) of finite numbers with low < high, "
                             "got 3. Pass e.g. hist_range=(0, 10) (fastai's).")),
        ({"hist_range": (5, 5)}, ("ActivationStats: `hist_range` is a pair (low, high) of finite numbers with "
                                  "low < high, got (5, 5). Pass e.g. hist_range=(0, 10) (fastai's).")),
        ({"hist_range": (0, 1, 2)}, ("ActivationStats: `hist_range` is a pair (low, high) of finite numbers with "
                                     "low < high, got (0, 1, 2). Pass e.g. hist_range=(0, 10) (fastai's).")),
        ({"hist_range": (0, math.inf)}, ("ActivationStats: `hist_range` is a pair (low, high) of finite numbers with "
                                         "low < high, got (0, inf). Pass e.g. hist_range=(0, 10) (fastai's).")),
        ({"hist_range": "0-10"}, ("ActivationStats: `hist_range` is a pair (low, high) of finite numbers with "
                                  "low < high, got '0-10'. Pass e.g. hist_range=(0, 10) (fastai's).")),
        ({"near_zero": "0.05"}, ("ActivationStats: `near_zero` is a number (values `<= near_zero` count as near "
                                 "zero), got '0.05'. Pass e.g. near_zero=0.05 (fastai's).")),
        ({"near_zero": math.nan}, ("ActivationStats: `near_zero` is a number (values `<= near_zero` count as near "
                                   "zero), got nan. Pass e.g. near_zero=0.05 (fastai's).")),
        ({"near_zero": None}, ("ActivationStats: `near_zero` is a number (values `<= near_zero` count as near "
                               "zero), got None. Pass e.g. near_zero=0.05 (fastai's).")),
        ({"every": 0}, ("ActivationStats: `every` is a positive int or None, got 0. "
                        "Pass every=1 (or None) to record every train step, every=k for one in k.")),
        ({"with_hist": "yes"}, "ActivationStats: `with_hist` is a bool, got 'yes'. Pass True or False."),
        ({"include_paramless": 1}, "ActivationStats: `include_paramless` is a bool, got 1. Pass True or False."),
    ],
)
def test_activation_stats_arguments_are_checked(kwargs: dict, message: str) -> None:
    """A bad ActivationStats argument is a one-line ReducerError naming it, at construction."""
    with pytest.raises(fh.ReducerError) as err:
        fh.ActivationStats(**kwargs)
    assert str(err.value) == message


def test_good_arguments_are_kept() -> None:
    """Numbers of any real kind are accepted for the thresholds; a list range becomes a tuple."""
    stats = fh.ActivationStats(near_zero=0, hist_bins=8, hist_range=[-1, 1.5])
    assert (stats.near_zero, stats.hist_bins, stats.hist_range) == (0, 8, (-1, 1.5))


LSTM_MESSAGE = (
    "ActivationStats: statistics need a tensor output, got tuple from a LSTM module. Select modules with tensor "
    "outputs with `modules=`, e.g. `modules=fh.select(fh.reducers.LeafModules()) & ~fh.select(LSTM)`."
)


class Tagger(nn.Module):
    """An LSTM (tuple output) followed by a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(3, 4, batch_first=True), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


def test_non_tensor_output_says_which_modules_to_select() -> None:
    """The default spec meeting an LSTM raises a ReducerError naming the module and output types
    and the `modules=` fix; the fix it suggests works."""
    model = Tagger()
    batches = [(torch.randn(2, 5, 3), torch.randn(2, 5, 2))]
    with pytest.raises((fh.ReducerError, fh.HookError)) as err:
        fh.fit(model, batches, MSE, kit.frozen_opt(model), fh.ActivationStats())
    assert LSTM_MESSAGE in str(err.value)
    fixed = fh.ActivationStats(modules=fh.select(fh.reducers.LeafModules()) & ~fh.select(nn.LSTM))
    assert fh.fit(model, batches, MSE, kit.frozen_opt(model), fixed).paths == ("head",)

