"""Plots name their layers: a legend entry is the layer's path and type (``0 Conv2d``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("matplotlib")


def model() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(2 * 4 * 4, 3))


@pytest.fixture(scope="module")
def fitted() -> tuple[nn.Module, dict[str, object]]:
    torch.manual_seed(0)
    m = model()
    batches = [(torch.randn(4, 1, 4, 4), torch.randint(0, 3, (4,))) for _ in range(3)]
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    reducers = {"gradients": fh.GradientStats(), "update_ratio": fh.UpdateRatio(), "dead_units": fh.DeadUnits()}
    return m, fh.fit(m, batches, nn.functional.cross_entropy, opt, reducers)


PLOTS = {"gradients": fh.plot.plot_gradient_stats, "update_ratio": fh.plot.plot_update_ratio,
         "dead_units": fh.plot.plot_dead_units}


@pytest.mark.parametrize("name", sorted(PLOTS))
def test_legends_name_path_and_type(fitted: tuple[nn.Module, dict[str, object]], name: str) -> None:
    """Given the model, every legend reads `0 Conv2d`, `2 Conv2d`, ...: path and type, in layer order."""
    m, results = fitted
    result = results[name]
    fig = PLOTS[name](result, model=m)
    expected = [f"{p} {type(m.get_submodule(p)).__name__}" for p in result.paths]
    assert expected[:2] == (["1 ReLU", "3 ReLU"] if name == "dead_units" else ["0 Conv2d", "2 Conv2d"])
    legend = fig.axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == expected


def test_legends_without_the_model_keep_paths(fitted: tuple[nn.Module, dict[str, object]]) -> None:
    """Without the model the legend has only the paths, as before; a wrapped model is looked through."""
    m, results = fitted
    fig = fh.plot.plot_dead_units(results["dead_units"])
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == list(results["dead_units"].paths)
    fig = fh.plot.plot_dead_units(results["dead_units"], model=nn.DataParallel(m))
    assert fig.axes[0].get_legend().get_texts()[0].get_text() == "1 ReLU"
