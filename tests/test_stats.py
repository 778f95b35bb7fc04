"""HookCallback and ActivationStats: fastai's results, as folds kept on the device."""

from __future__ import annotations

import itertools
import math
import pathlib
import subprocess
import sys
import warnings
from typing import Any

import hypothesis
import pytest
import toolz
import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh
from funhooks import stats as fhstats

MSE = nn.functional.mse_loss
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _batches(n: int, shape: tuple[int, ...] = (6, 3), out: int = 2, device: torch.device | str = "cpu") -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(*shape, generator=g).to(device), torch.randn(shape[0], out, generator=g).to(device))
            for _ in range(n)]


def _mlp(device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).to(device)


def _frozen_opt(model: nn.Module) -> torch.optim.Optimizer:
    """lr=0: the weights never change, so outputs can be recomputed after the fold."""
    return torch.optim.SGD(model.parameters(), lr=0.0)


# -- fastai's documented tests, ported --------------------------------------------------------


@pytest.mark.parametrize("n_tr", [11, 12, 13])
@pytest.mark.parametrize("every", [4, 1])
def test_every_records_ceil_n_over_every(n_tr: int, every: int) -> None:
    """fastai's test_every: n_tr train batches with every=k give ceil(n_tr / k) stats."""
    model = nn.Linear(2, 1)
    res = fh.fit(model, _batches(n_tr, (4, 2), 1), MSE, torch.optim.SGD(model.parameters(), lr=0.01),
                 fh.ActivationStats(every=every))
    assert len(res.stats) == math.ceil(n_tr / every)
    assert res.iterations == tuple(range(0, n_tr, every))


@hypothesis.given(n=st.integers(1, 9), every=st.integers(1, 5), epochs=st.integers(1, 2))
def test_every_counts_train_iterations_only(n: int, every: int, epochs: int) -> None:
    """Evaluation steps never count; iterations run across epochs: ceil(n * epochs / every)."""
    model = nn.Linear(2, 1)
    batches = _batches(n, (4, 2), 1)
    stats = fh.ActivationStats(every=every)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = itertools.chain(fh.evaluate(model, batches, MSE, specs=stats.specs),
                            fh.train(model, batches, MSE, opt, specs=stats.specs, epochs=epochs),
                            fh.evaluate(model, batches, MSE, specs=stats.specs))
    assert len(fh.fold(stats, steps).stats) == math.ceil(n * epochs / every)


def test_hook_callback_stores_the_output(device: torch.device) -> None:
    """fastai's first HookCallback example: hook returning `o` stores the model's prediction."""
    model = nn.Linear(3, 2).to(device)
    batches = _batches(5, device=device)
    stored = fh.fit(model, batches, MSE, _frozen_opt(model), fh.HookCallback(lambda m, i, o: o, cpu=False))
    assert len(stored) == 5
    for values, (x, _) in zip(stored, batches):
        assert torch.equal(values[0], model(x).detach())


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # PyTorch's note: the input needs no grad
def test_hook_callback_backward_gets_the_loss_gradient(device: torch.device) -> None:
    """fastai's second example: a backward hook's grad_output[0] is 2 (pred - y) / n under MSE."""
    model = nn.Linear(1, 1).to(device)
    batches = _batches(5, (8, 1), 1, device)
    stored = fh.fit(model, batches, MSE, _frozen_opt(model),
                    fh.HookCallback(lambda m, i, o: o, is_forward=False, cpu=False))
    for values, (x, y) in zip(stored, batches):
        pred = model(x).detach()
        torch.testing.assert_close(values[0][0], 2 * (pred - y) / pred.shape[0])


def test_hook_callback_defaults_to_cpu_and_param_leaves(device: torch.device) -> None:
    """cpu=True (fastai's default) moves hook args to the CPU; default modules skip ReLU."""
    model = _mlp(device)
    res = fh.fit(model, _batches(2, device=device), MSE, _frozen_opt(model), fh.HookCallback(lambda m, i, o: o))
    assert [v.device.type for v in res[0]] == ["cpu", "cpu"]
    paramless = fh.HookCallback(lambda m, i, o: o.shape[1], include_paramless=True)
    assert fh.fit(model, _batches(1, device=device), MSE, _frozen_opt(model), paramless) == ([4, 4, 2],)


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
    res = fh.fit(model, batches, MSE, _frozen_opt(model), fh.ActivationStats(with_hist=True))
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
    batches = _batches(2, out=5)
    res = fh.fit(model, batches, MSE, _frozen_opt(model),
                 fh.ActivationStats(with_hist=True, near_zero=0.0, hist_bins=4, hist_range=(-1, 1)))
    o = model(batches[0][0]).detach()
    assert res.stats[0][0]["near_zero"] == (o <= 0.0).sum().item() / o.numel()
    assert torch.equal(res.stats[0][0]["hist"], o.histc(4, -1, 1))


def test_default_modules_and_selectors() -> None:
    """Default: leaves with parameters; include_paramless adds the other leaves; modules= selects."""
    model = _mlp()
    run = lambda r: fh.fit(model, _batches(1), MSE, _frozen_opt(model), r).paths  # noqa: E731
    assert run(fh.ActivationStats()) == ("0", "2")
    assert run(fh.ActivationStats(include_paramless=True)) == ("0", "1", "2")
    assert run(fh.ActivationStats(modules=nn.ReLU)) == ("1",)
    assert run(fh.ActivationStats(modules=[model[2]])) == ("2",)


# -- merging -------------------------------------------------------------------------------------


@hypothesis.given(cuts=st.lists(st.integers(0, 8), max_size=3), every=st.one_of(st.none(), st.integers(1, 3)),
                  with_hist=st.booleans())
def test_fold_over_chunks_merged_equals_one_pass(cuts: list[int], every: int | None, with_hist: bool) -> None:
    """Folding chunks of the steps separately and merging their states == one pass, exactly."""
    model = _mlp()
    stats, hooks = fh.ActivationStats(with_hist=with_hist, every=every), fh.HookCallback(lambda m, i, o: o, every=every)
    steps = list(fh.train(model, _batches(8), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
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
    model = _mlp()
    res = fh.fit(model, _batches(2), MSE, _frozen_opt(model), fh.ActivationStats())
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
    model = _mlp()
    steps = fh.train(model, _batches(1), MSE, _frozen_opt(model))
    with pytest.raises(fh.ReducerError) as err:
        fh.fold(fh.ActivationStats(), steps)
    assert str(err.value) == (
        "ActivationStats: a recorded train step holds the records of the reducer's specs, got 1 recorded steps and "
        "no 'activation_stats' in any of their records. Run the steps with `specs=reducer.specs` (fh.fit does), "
        "and select modules that run."
    )
    with pytest.raises(fh.ReducerError, match=r"holds the records of the reducer's specs, got a Step whose record"):
        fh.fold(fh.HookCallback(print), fh.train(model, _batches(1), MSE, _frozen_opt(model)))


# -- plots -------------------------------------------------------------------------------------


def test_plots_save_as_png(tmp_path: pathlib.Path) -> None:
    """plot_layer_stats returns a Figure, color_dim draws on Axes; both save as PNG."""
    model = _mlp()
    res = fh.fit(model, _batches(4), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
                 fh.ActivationStats(with_hist=True))
    fig = res.plot_layer_stats(0)
    fig.savefig(tmp_path / "stats.png")
    ax = res.color_dim(1)
    ax.figure.savefig(tmp_path / "color.png")
    assert (tmp_path / "stats.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "color.png").read_bytes()[:4] == b"\x89PNG"


def test_plots_of_a_sometimes_skipped_module_show_gaps() -> None:
    """A module absent on some steps plots NaN gaps with a dot per step, and zero columns."""
    model = StochasticDepth([(True, False), (True, True), (True, False)])
    res = fh.fit(model, _batches(3, (6, 4), 4), MSE, _frozen_opt(model), fh.ActivationStats(with_hist=True))
    line = res.plot_layer_stats("blocks.1").axes[0].lines[0]
    assert line.get_marker() == "." and [math.isnan(v) for v in line.get_ydata()] == [True, False, True]
    assert res.plot_layer_stats("blocks.0").axes[0].lines[0].get_marker() == "None"
    image = res.color_dim("blocks.1").images[0].get_array()
    assert image.shape == (40, 3) and not image[:, 0].any() and not image[:, 2].any()


def test_plotting_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib, plotting raises ExtraError naming `funhooks[plot]`."""
    model = _mlp()
    res = fh.fit(model, _batches(2), MSE, _frozen_opt(model), fh.ActivationStats())
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
    model = _mlp(device)
    batches = _batches(4, device=device)
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


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((3,), {}, "HookCallback: `hook` is a callable `hook(module, input, output)`, got 3. Pass a function."),
        ((print,), {"every": 0}, ("HookCallback: `every` is a positive int or None, got 0. "
                                  "Pass every=1 (or None) to record every train step, every=k for one in k.")),
        ((print,), {"is_forward": "backward"}, ("HookCallback: `is_forward` is a bool, got 'backward'. "
                                                "Pass True or False.")),
        ((print,), {"detach": None}, "HookCallback: `detach` is a bool, got None. Pass True or False."),
        ((print,), {"cpu": 0}, "HookCallback: `cpu` is a bool, got 0. Pass True or False."),
        ((print,), {"include_paramless": "no"}, ("HookCallback: `include_paramless` is a bool, got 'no'. "
                                                 "Pass True or False.")),
        ((print,), {"name": ""}, ("HookCallback: `name` is a non-empty str or None, got ''. "
                                  "Pass the record name, or None for the hook's __name__.")),
    ],
)
def test_hook_callback_arguments_are_checked(args: tuple, kwargs: dict, message: str) -> None:
    """A bad HookCallback argument is a one-line ReducerError naming it, at construction."""
    with pytest.raises(fh.ReducerError) as err:
        fh.HookCallback(*args, **kwargs)
    assert str(err.value) == message


def test_good_arguments_are_kept() -> None:
    """Numbers of any real kind are accepted for the thresholds; a list range becomes a tuple."""
    stats = fh.ActivationStats(near_zero=0, hist_bins=8, hist_range=[-1, 1.5])
    assert (stats.near_zero, stats.hist_bins, stats.hist_range) == (0, 8, (-1, 1.5))


LSTM_MESSAGE = (
    "ActivationStats: statistics need a tensor output, got tuple from a LSTM module. Select modules with tensor "
    "outputs with `modules=`, e.g. `modules=fh.select(fh.stats.LeafModules()) & ~fh.select(LSTM)`."
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
        fh.fit(model, batches, MSE, _frozen_opt(model), fh.ActivationStats())
    assert LSTM_MESSAGE in str(err.value)
    fixed = fh.ActivationStats(modules=fh.select(fhstats.LeafModules()) & ~fh.select(nn.LSTM))
    assert fh.fit(model, batches, MSE, _frozen_opt(model), fixed).paths == ("head",)


# -- statistics are keyed by module path (issue 9) ------------------------------------------------


class StochasticDepth(nn.Module):
    """Residual Linear blocks; call k runs the blocks that ``masks[k % len(masks)]`` keeps
    (stochastic depth, as in the issue: a module skipped on a step did not run there)."""

    def __init__(self, masks: list[tuple[bool, ...]], width: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(len(masks[0])))
        self.gain = nn.Parameter(torch.ones(()))  # the root's own: a step that skips every block still trains
        self.masks = masks
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = self.masks[self.calls % len(self.masks)]
        self.calls += 1
        for block, keep in zip(self.blocks, mask):
            if keep:
                x = x + block(x)
        return x * self.gain

    def outputs(self, x: torch.Tensor, mask: tuple[bool, ...]) -> dict[str, torch.Tensor]:
        """Each kept block's output on `x` under `mask`, by path (no hooks, no call counted)."""
        out = {}
        with torch.no_grad():
            for i, (block, keep) in enumerate(zip(self.blocks, mask)):
                if keep:
                    out[f"blocks.{i}"] = block(x)
                    x = x + out[f"blocks.{i}"]
        return out


def _stats_of(o: torch.Tensor) -> tuple[float, float, float]:
    o = o.float()
    return o.mean().item(), o.std().item(), (o <= 0.05).long().sum().item() / o.numel()


def test_skipped_module_keeps_its_own_statistics(device: torch.device) -> None:
    """A module skipped on a step is absent there: `paths` lists every module that ran in any step
    (module order, though `blocks.1` first runs at step 1), `stats` has None at its position, and
    `layer_stats` / `hist` of each path are that module's own, NaN / zero where it did not run."""
    masks = [(True, False, True), (True, True, True), (False, True, True)]
    model = StochasticDepth(masks).to(device)
    batches = _batches(3, (6, 4), 4, device)
    res = fh.fit(model, batches, MSE, _frozen_opt(model), fh.ActivationStats(with_hist=True))
    assert res.paths == ("blocks.0", "blocks.1", "blocks.2")
    assert [[s is None for s in step] for step in res.stats] == [[False, True, False], [False] * 3, [True, False, False]]
    for path in res.paths:
        means, stds, near_zero = res.layer_stats(path)
        for k, ((x, _), mask) in enumerate(zip(batches, masks)):
            o = model.outputs(x, mask).get(path)
            if o is None:
                assert math.isnan(means[k]) and math.isnan(stds[k]) and math.isnan(near_zero[k])
                assert not res.hist(path)[:, k].any()
            else:
                want = _stats_of(o)
                assert means[k] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
                assert stds[k] == pytest.approx(want[1], rel=1e-5)
                assert near_zero[k] == want[2]
                assert torch.equal(res.hist(path)[:, k], o.histc(40, 0, 10).log1p().cpu())
    assert res.layer_stats(1) == res.layer_stats("blocks.1")


def test_every_step_without_the_module_reads_as_absent() -> None:
    """A module that never runs on a recorded step is not in `paths`; one that stops running is NaN."""
    masks = [(True, True, False), (True, False, False), (False, False, False)]
    model = StochasticDepth(masks)
    res = fh.fit(model, _batches(4, (6, 4), 4), MSE, _frozen_opt(model), fh.ActivationStats(with_hist=True))
    assert res.paths == ("blocks.0", "blocks.1")
    means, _, _ = res.layer_stats("blocks.1")
    assert [math.isnan(m) for m in means] == [False, True, True, False]
    assert res.stats[2] == [None, None]
    assert res.hist("blocks.0")[:, 2].sum() == 0 and res.hist("blocks.0")[:, 3].sum() > 0


def _masks(depth: int) -> st.SearchStrategy[list[tuple[bool, ...]]]:
    return st.lists(st.tuples(*[st.booleans()] * depth).filter(any), min_size=1, max_size=8)


@hypothesis.given(data=st.data(), depth=st.integers(1, 4), with_hist=st.booleans(),
                  every=st.one_of(st.none(), st.integers(1, 3)))
def test_fold_of_chunks_equals_one_pass_with_skipped_modules(data: st.DataObject, depth: int, with_hist: bool,
                                                             every: int | None) -> None:
    """With modules skipped at random, folding chunks and merging (in any order) == one pass, exactly."""
    masks = data.draw(_masks(depth), label="masks")
    model = StochasticDepth(masks)
    stats = fh.ActivationStats(with_hist=with_hist, every=every)
    steps = list(fh.train(model, _batches(8, (6, 4), 4), MSE, torch.optim.SGD(model.parameters(), lr=0.1),
                          specs=stats.specs))
    cuts = data.draw(st.lists(st.integers(0, len(steps)), max_size=3), label="cuts")
    bounds = [0, *sorted(cuts), len(steps)]
    states = [toolz.reduce(stats.step, steps[a:b], stats.init()) for a, b in itertools.pairwise(bounds)]
    order = data.draw(st.permutations(range(len(states))), label="merge order")
    merged = stats.result(toolz.reduce(stats.merge, [states[i] for i in order]))
    whole = fh.fold(stats, steps)
    assert merged.paths == whole.paths
    assert merged.iterations == whole.iterations
    assert _plain(merged) == _plain(whole)


def _plain(res: fhstats.ActivationStatsResult) -> list:
    """The stats with histograms as lists, so results compare with ==."""
    return [[_plain_one(s) for s in step] for step in res.stats]


def _plain_one(s: dict | None) -> dict | None:
    return None if s is None else {k: (v.tolist() if k == "hist" else v) for k, v in s.items()}


@hypothesis.given(data=st.data(), depth=st.integers(1, 4))
def test_merge_of_ranks_with_skipped_modules(data: st.DataObject, depth: int) -> None:
    """Two ranks that skipped different modules on the same iteration merge by path: a module that
    ran on one rank has that rank's statistics exactly, one that ran on both those of the joint batch."""
    mask_a, mask_b = (data.draw(st.tuples(*[st.booleans()] * depth)) for _ in range(2))
    hypothesis.assume(any(mask_a) or any(mask_b))
    split = data.draw(st.integers(1, 11))
    model = StochasticDepth([mask_a])
    x = torch.randn(12, 4)
    stats = fh.ActivationStats(with_hist=True)

    def state(xs: torch.Tensor, mask: tuple[bool, ...]) -> tuple:
        model.masks = [mask]
        with fh.with_hooks(model, stats.specs) as run:
            model(xs)
        return stats.step(stats.init(), fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record,
                                                training=True))

    a, b = state(x[:split], mask_a), state(x[split:], mask_b)
    merged = stats.result(stats.merge(a, b))
    assert _plain(merged) == _plain(stats.result(stats.merge(b, a)))  # merging is symmetric
    outs_a, outs_b = model.outputs(x[:split], mask_a), model.outputs(x[split:], mask_b)
    assert merged.paths == tuple(p for p in (f"blocks.{i}" for i in range(depth)) if p in outs_a or p in outs_b)
    for path, got in zip(merged.paths, merged.stats[0]):
        if path not in outs_b:
            alone = stats.result(a)
            assert _plain_one(got) == _plain_one(alone.stats[0][alone.paths.index(path)])
        elif path not in outs_a:
            alone = stats.result(b)
            assert _plain_one(got) == _plain_one(alone.stats[0][alone.paths.index(path)])
        else:
            joint = torch.cat([outs_a[path], outs_b[path]]).double()
            assert got["mean"] == pytest.approx(joint.mean().item(), rel=1e-5, abs=1e-6)
            assert got["std"] == pytest.approx(joint.std().item(), rel=1e-5)
            assert got["near_zero"] == (joint <= torch.tensor(0.05).float()).sum().item() / joint.numel()
            assert torch.equal(got["hist"], joint.float().histc(40, 0, 10))


# -- empty batches (issue 10) -------------------------------------------------------------------


@pytest.mark.parametrize("width", [4, 300])  # 300 x 40 x 6 > REDUCE_IN_HOOK_NUMEL: the hook reduces it
def test_an_empty_batch_gives_nan_statistics(device: torch.device, width: int) -> None:
    """A zero-element activation reads as NaN mean / std / near_zero and zero histogram counts;
    the other steps are unaffected and the result stays readable."""
    model = nn.Sequential(nn.Linear(3, width), nn.ReLU(), nn.Linear(width, 2)).to(device)
    batches = [(torch.randn(n, 40, 3, device=device), torch.randn(n, 40, 2, device=device)) for n in (6, 0, 6)]
    with torch.autograd.set_detect_anomaly(False):
        res = fh.fit(model, batches, lambda p, y: (p - y).square().sum(), _frozen_opt(model),
                     fh.ActivationStats(with_hist=True))
    empty = res.stats[1]
    assert [math.isnan(s[k]) for s in empty for k in ("mean", "std", "near_zero")] == [True] * 6
    assert all(torch.equal(s["hist"], torch.zeros(40)) for s in empty)
    assert all(not math.isnan(s["mean"]) for step in (res.stats[0], res.stats[2]) for s in step)
    means, stds, near_zero = res.layer_stats(0)
    assert math.isnan(means[1]) and math.isnan(stds[1]) and math.isnan(near_zero[1])
    assert not res.hist(0)[:, 1].any()


def test_an_empty_part_merges_as_nothing() -> None:
    """A rank that saw an empty batch adds nothing: the merge is the other rank's statistics."""
    model = _mlp()
    stats = fh.ActivationStats(with_hist=True)

    def state(xs: torch.Tensor) -> tuple:
        with fh.with_hooks(model, stats.specs) as run:
            model(xs)
        return stats.step(stats.init(), fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record,
                                                training=True))

    full = state(torch.randn(5, 3))
    merged = stats.result(stats.merge(state(torch.randn(0, 3)), full))
    assert _plain(merged) == _plain(stats.result(full))


# -- fastai's numbers to the bit (issue 12) ---------------------------------------------------------


class Emit(nn.Module):
    """Returns its input: its output is whatever tensor the test feeds it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Parts(nn.Module):
    """One Emit per input tensor, so one step can hold activations of any shapes."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.parts = nn.ModuleList(Emit() for _ in range(k))

    def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [part(x) for part, x in zip(self.parts, xs)]


def _fastai(o: torch.Tensor, bins: int = 40, lo: float = 0.0, hi: float = 10.0) -> dict:
    """fastai's ActivationStats.hook, verbatim (std of one value is NaN, without the warning)."""
    o = o.float()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {"mean": o.mean().item(), "std": o.std().item(),
                "near_zero": (o <= 0.05).long().sum().item() / o.numel(), "hist": o.histc(bins, lo, hi).cpu()}


def _same_float(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _check_step(xs: list[torch.Tensor], **kwargs: Any) -> None:
    model = Parts(len(xs))
    stats = fh.ActivationStats(modules=Emit, with_hist=True, **kwargs)
    with fh.with_hooks(model, stats.specs) as run:
        model(xs)
    step = fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record, training=True)
    got = stats.result(stats.step(stats.init(), step)).stats[0]
    for g, x in zip(got, xs):
        want = _fastai(x, stats.hist_bins, *stats.hist_range)
        assert all(_same_float(g[k], want[k]) for k in ("mean", "std", "near_zero")), (x.shape, g, want)
        assert torch.equal(g["hist"], want["hist"])


SIZES = [1, 2, 3, 7, 8, 16, 31, 64, 127, 1000, 2048, 4095, 5000, 10_000, 32_767, 32_768, 40_000, 65_537, 131_072]


@pytest.mark.parametrize("n", SIZES)
def test_stats_equal_fastais_to_the_bit(device: torch.device, n: int) -> None:
    """mean and std are torch's `o.mean().item()` / `o.std().item()` exactly (fastai's own test uses
    exact equality), near_zero and the histogram too, for every size, batched or reduced in the hook."""
    g = torch.Generator().manual_seed(n)
    xs = [(torch.randn(3, n, generator=g) * 10 ** k + off).to(device)
          for k, off in ((-2, 0.0), (0, 1.0), (2, -5.0), (4, 100.0))]
    _check_step([x[i] for x in xs for i in range(3)] + [xs[1].relu().reshape(-1)[:n], xs[2].t()])


@hypothesis.given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 1100)), min_size=1, max_size=5),
    scale=st.floats(1e-3, 1e3), offset=st.sampled_from([0.0, 0.05, 1.0, -3.0, 250.0]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.float64, torch.bfloat16]),
    layout=st.sampled_from(["contiguous", "transposed", "relu"]),
    hist_range=st.sampled_from([(0.0, 10.0), (-1.0, 1.0), (0.1, 0.7), (-3.3, 1e-3)]),
    hist_bins=st.integers(1, 50), near_zero=st.sampled_from([0.05, 0.0, 0.1, -1.0]),
)
def test_stats_equal_fastais_to_the_bit_for_any_activation(
    shapes: list[tuple[int, int]], scale: float, offset: float, dtype: torch.dtype, layout: str,
    hist_range: tuple[float, float], hist_bins: int, near_zero: float,
) -> None:
    """Any mix of shapes, dtypes, layouts (transposed outputs are not contiguous), histogram ranges
    and thresholds: every statistic is what fastai's hook computes, bit for bit."""
    g = torch.Generator().manual_seed(len(shapes))
    xs = [(torch.randn(r, c, generator=g) * scale + offset).to(dtype) for r, c in shapes]
    if layout == "transposed":
        xs = [x.t() for x in xs]
    elif layout == "relu":
        xs = [x.relu() for x in xs]
    model = Parts(len(xs))
    stats = fh.ActivationStats(modules=Emit, with_hist=True, near_zero=near_zero, hist_bins=hist_bins,
                               hist_range=hist_range)
    with fh.with_hooks(model, stats.specs) as run:
        model(xs)
    step = fh.Step(epoch=0, iteration=0, loss=torch.zeros(()), record=run.record, training=True)
    for got, x in zip(stats.result(stats.step(stats.init(), step)).stats[0], xs):
        o = x.float()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = (o.mean().item(), o.std().item(), (o <= near_zero).long().sum().item() / o.numel()
                    if o.numel() else math.nan)
        assert all(_same_float(a, b) for a, b in zip((got["mean"], got["std"], got["near_zero"]), want))
        assert torch.equal(got["hist"], o.histc(hist_bins, *hist_range))


def test_stats_are_exact_with_several_threads() -> None:
    """With more intra-op threads (PyTorch then splits large reductions) the numbers are still torch's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for n in (1000, 32_767, 32_768, 40_000, 70_000):
            g = torch.Generator().manual_seed(n)
            _check_step([torch.randn(n, generator=g) * 3 + 1 for _ in range(3)])
    finally:
        torch.set_num_threads(threads)


def test_fastai_exact_equality_test_passes() -> None:
    """fastai's test_eq(stats[-1]['std'], pred.std()) with ==, on a model's last layer each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.Linear(50, 1))
    batches = [(torch.randn(16, 1), torch.randn(16, 1)) for _ in range(5)]
    res = fh.fit(model, batches, MSE, _frozen_opt(model), fh.ActivationStats())
    for step, (x, _) in zip(res.stats, batches):
        pred = model(x).detach()
        assert step[-1]["mean"] == pred.mean().item() and step[-1]["std"] == pred.std().item()


def test_std_near_a_float32_rounding_boundary_is_still_torchs() -> None:
    """Rows whose std falls within the sum-order slack of a float32 rounding boundary (a few in
    this data, checked) get torch's own sequential sum: every row's std is `row.std()` exactly."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 64, generator=g) * 3 + 1
    d = x.double() - x.mean(1).double()[:, None]
    approx = torch.linalg.vector_norm(d, dim=1) / math.sqrt(63)
    near_boundary = (approx * (1 - fhstats._SUM_ORDER_SLACK)).float() != (approx * (1 + fhstats._SUM_ORDER_SLACK)).float()
    assert near_boundary.sum() >= 1
    rows = fhstats._row_stats(x, 0.05)
    assert torch.equal(rows[:, 1], torch.stack([row.std() for row in x]))
    assert torch.equal(rows[:, 0], torch.stack([row.mean() for row in x]))


class Routed(nn.Module):
    """A mixture of 12 experts where call k runs expert ``route[k % len(route)]`` only."""

    def __init__(self, route: list[int]) -> None:
        super().__init__()
        self.stem, self.experts = nn.Linear(4, 4), nn.ModuleList(nn.Linear(4, 4) for _ in range(12))
        self.route, self.calls = route, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        expert = self.experts[self.route[self.calls % len(self.route)]]
        self.calls += 1
        return expert(self.stem(x))


def test_modules_that_never_run_together_are_in_path_order() -> None:
    """Experts routed one per step: `paths` puts each after the stem (the steps say so) and the
    experts, which no step orders, by number; each expert's statistics are its own steps'."""
    model = Routed([10, 2, 0, 10])
    res = fh.fit(model, _batches(4, (6, 4), 4), MSE, _frozen_opt(model), fh.ActivationStats())
    assert res.paths == ("stem", "experts.0", "experts.2", "experts.10")
    means, _, _ = res.layer_stats("experts.10")
    assert [math.isnan(m) for m in means] == [False, True, True, False]
