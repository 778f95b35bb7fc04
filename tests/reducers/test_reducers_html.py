"""The reducer results' notebook displays: a table of each layer's numbers at the last recorded
step (rounded as shown, the steps it has values on), the result's own plot under it as a PNG,
a note instead without matplotlib; short plain reprs; no figure left behind; only the last
step's numbers read for the table."""

from __future__ import annotations

import base64
import io
import math
import re
import sys
import warnings
from collections.abc import Callable

import pytest
import reducer_kit as kit
import torch
from html_kit import assert_self_contained, seen
from torch import nn

import funhooks as fh
from funhooks._html import MAX_ROWS

MSE = kit.MSE
_IMAGE = re.compile(r'<img alt="([^"]*)" style="[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)">')


def _shown(v: float, scale: float = 1.0) -> str:
    return f"{scale * v:.4g}"


def _picture(markup: str) -> bytes:
    """The one PNG a display holds, checked to be a PNG and the display self-contained."""
    [(_, data)] = _IMAGE.findall(markup)
    png = base64.b64decode(data)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert_self_contained(_IMAGE.sub("", markup))  # nothing but the image's own bytes
    return png


def _size(png: bytes) -> tuple[int, int]:
    """(width, height) in pixels, from the PNG's header."""
    return int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")


def _drawn(figure: object) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # type: ignore[attr-defined]
    return buffer.getvalue()


def _fit(*reducers: object, model: nn.Module | None = None, steps: int = 4) -> tuple:
    model = kit.mlp() if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    return fh.fit(model, kit.batches(steps), MSE, opt, reducers)


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """matplotlib not installed: every import of it fails."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


def test_activation_stats_shows_each_modules_last_step_and_every_module_plotted() -> None:
    (res,) = _fit(fh.ActivationStats())
    markup = res._repr_html_()
    shown = seen(markup)
    assert shown.caption == "ActivationStats: 4 recorded step(s), 2 module(s); values at the last (iteration 3)"
    assert shown.texts()[0] == ["module", "steps", "mean", "std", "% near zero"]
    assert shown.texts()[1:] == [[p, "4", _shown(s["mean"]), _shown(s["std"]), _shown(s["near_zero"], 100.0)]
                                 for p, s in zip(res.paths, res.stats[-1])]
    assert float(shown.rows[1][2].title) == pytest.approx(res.stats[-1][0]["mean"])  # the exact value on hover
    png = _picture(markup)
    assert png == _drawn(fh.plot.plot_activation_stats(res))  # the reducer's own figure
    assert _size(png) == (1200, 350)


def test_a_module_absent_from_the_last_step_shows_a_dash_and_its_step_count() -> None:
    model = kit.StochasticDepth([(True, True), (True, False), (True, True), (True, False)])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    (res,) = fh.fit(model, kit.batches(4, (6, 4), 4), MSE, opt, (fh.ActivationStats(),))
    rows = {r[0]: r for r in seen(res._repr_html_()).texts()[1:]}
    assert rows["blocks.0"][1] == "4" and rows["blocks.1"][1] == "2"
    assert rows["blocks.1"][2:] == ["—", "—", "—"]
    [cell] = [row[2] for row in seen(res._repr_html_()).rows if row[0].text == "blocks.1"]
    assert cell.title == "no value at iteration 3"


def test_gradient_stats_and_update_ratio_show_the_last_steps_numbers_and_their_plots() -> None:
    grads, ratio = _fit(fh.GradientStats(), fh.UpdateRatio(), steps=3)
    shown = seen(grads._repr_html_())
    assert shown.texts()[0] == ["layer", "steps", "norm", "mean", "std", "% zeros"]
    assert shown.texts()[1:] == [[p, "3", _shown(s["norm"]), _shown(s["mean"]), _shown(s["std"]), _shown(s["zeros"], 100)]
                                 for p, s in zip(grads.paths, grads.stats[-1])]
    png = _picture(grads._repr_html_())
    assert png == _drawn(grads.plot()) and _size(png) == (1200, 700)

    shown = seen(ratio._repr_html_())
    assert shown.caption.startswith("UpdateRatio: 3 recorded step(s), 2 layer(s); values at the last (iteration 2)")
    assert shown.texts()[1:] == [[p, "3", _shown(r), _shown(math.log10(r))] for p, r in zip(ratio.paths, ratio.ratios[-1])]
    assert _picture(ratio._repr_html_()) == _drawn(ratio.plot())


def test_dead_units_show_the_last_steps_share_and_the_share_dead_throughout() -> None:
    model = kit.mlp()
    with torch.no_grad():
        model[0].bias.copy_(torch.tensor([-100.0, -100.0, 100.0, 0.0]))
    (res,) = _fit(fh.DeadUnits(), model=model, steps=3)
    shown = seen(res._repr_html_())
    assert shown.texts() == [["layer", "steps", "% dead", "% dead throughout"],
                             ["1", "3", _shown(res.dead[-1][0], 100), _shown(res.dead_throughout()["1"], 100)]]
    assert shown.texts()[1][3] == "50"
    assert _picture(res._repr_html_()) == _drawn(res.plot())


def test_the_loss_curve_shows_the_last_loss_its_average_and_the_lowest() -> None:
    (res,) = _fit(fh.LossCurve(), steps=5)
    shown = seen(res._repr_html_())
    low = min(range(5), key=lambda i: res.losses[i])
    assert shown.caption == "LossCurve: 5 step(s), iterations 0–4, beta 0.98"
    assert shown.texts()[1:] == [["last loss", _shown(res.losses[-1])], ["moving average", _shown(res.ema[-1])],
                                 [f"lowest loss (iteration {low})", _shown(res.losses[low])]]
    assert _picture(res._repr_html_()) == _drawn(res.plot())


def test_without_matplotlib_the_table_comes_alone_with_a_note(no_matplotlib: None) -> None:
    for res in _fit(fh.ActivationStats(), fh.GradientStats(), fh.UpdateRatio(), fh.DeadUnits(), fh.LossCurve()):
        markup = res._repr_html_()
        assert "<img" not in markup and len(seen(markup).texts()) > 1
        assert markup.endswith("No plot: it needs matplotlib. Install the extra: pip install &#x27;funhooks[plot]&#x27;.</p></div>")
        assert_self_contained(markup)


def test_a_display_leaves_no_figure_behind() -> None:
    """The figures are drawn off pyplot and dropped: pyplot's list of open figures is unchanged
    (a user's own figure stays open)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mine = plt.figure()
    try:
        for res in _fit(fh.ActivationStats(), fh.GradientStats(), fh.UpdateRatio(), fh.DeadUnits(), fh.LossCurve()):
            assert "<img" in res._repr_html_()
            assert plt.get_fignums() == [mine.number]
    finally:
        plt.close(mine)


def test_results_without_steps_show_an_empty_table_and_no_plot() -> None:
    for reducer in (fh.ActivationStats(), fh.GradientStats(), fh.UpdateRatio(), fh.DeadUnits(), fh.LossCurve()):
        res = fh.fold(reducer, [])
        markup = res._repr_html_()
        assert "<img" not in markup and len(seen(markup).texts()) == 1
        assert re.match(r"\w+: no (recorded )?steps", seen(markup).caption)


def test_many_layers_are_cut_to_the_row_cap_and_the_plain_reprs_stay_short(no_matplotlib: None) -> None:
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(MAX_ROWS + 30)])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(3, 2), torch.randn(3, 2))] * 2
    results = fh.fit(model, batches, MSE, opt, (fh.ActivationStats(), fh.GradientStats(), fh.UpdateRatio(),
                                                fh.DeadUnits(modules=nn.Linear), fh.LossCurve()))
    for res in results[:4]:
        rows = seen(res._repr_html_()).texts()
        assert len(rows) == 1 + MAX_ROWS + 1 and rows[-1] == ["… 30 more not shown"]
        assert rows[1][0] == "0" and rows[MAX_ROWS][0] == str(MAX_ROWS - 1)
    for res in results:
        text = repr(res)
        assert "\n" not in text and len(text) < 160, text


def test_the_table_reads_only_the_last_steps_numbers(no_matplotlib: None) -> None:
    """Earlier steps whose numbers cannot be read (meta tensors: reading one raises, as a CUDA
    tensor would sync) do not stop the table: it copies the last step's rows alone."""
    acts, grads, ratio = _fit(fh.ActivationStats(), fh.GradientStats(), fh.UpdateRatio(), steps=3)

    def unreadable(rows: object) -> torch.Tensor:
        return torch.empty(torch.as_tensor(rows).shape, dtype=torch.float64, device="meta")

    for res in (grads, ratio):
        entries = res.table.entries
        blind = [e._replace(rows=unreadable(e.rows)) for e in entries[:-1]]
        last = entries[-1]._replace(rows=torch.tensor(entries[-1].rows, dtype=torch.float64))
        partly = type(res)(type(res.table)([*blind, last], res.table.finish))
        with pytest.raises(NotImplementedError):
            partly.stats if isinstance(partly, fh.GradientStatsResult) else partly.ratios  # noqa: B018
        assert seen(partly._repr_html_()).texts() == seen(res._repr_html_()).texts()

    entries = acts.entries
    blind = [e._replace(rows=torch.empty_like(e.rows, device="meta")) for e in entries[:-1]]
    partly_acts = type(acts)((*blind, entries[-1]), False)
    with pytest.raises((NotImplementedError, RuntimeError)):  # stacked with the last: not on one device
        partly_acts.stats  # noqa: B018
    assert seen(partly_acts._repr_html_()).texts() == seen(acts._repr_html_()).texts()


def _syncs(show: Callable[[], str]) -> int:
    """How many times `show` waits for the GPU (each copy of a value to the host does)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            show()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def test_on_a_gpu_the_table_copies_the_last_step_alone_whatever_the_steps(device: torch.device,
                                                                           no_matplotlib: None) -> None:
    """The tables of 2 and 8 recorded steps wait for the GPU the same number of times (the last
    step's numbers, one copy each), and show the numbers the result gives."""
    if device.type != "cuda":
        pytest.skip("host syncs are a CUDA notion")
    counts = []
    for steps in (2, 8):
        model = kit.mlp(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        results = fh.fit(model, kit.batches(steps, device=device), MSE, opt,
                         (fh.ActivationStats(), fh.GradientStats(), fh.UpdateRatio(), fh.DeadUnits()), progress=False)
        counts.append([_syncs(res._repr_html_) for res in results])
        acts = results[0]
        assert seen(acts._repr_html_()).texts()[1][2] == _shown(acts.stats[-1][0]["mean"])
    assert counts[0] == counts[1] and all(n >= 1 for n in counts[0]), counts
