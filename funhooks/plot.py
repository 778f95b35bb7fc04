"""Figures for activation statistics (the optional ``plot`` extra: matplotlib).

matplotlib is imported only when a plot is drawn, never by ``import funhooks``. Figures are
built with ``matplotlib.figure.Figure`` rather than pyplot, so drawing keeps no global
figure state, needs no display, and ``fig.savefig("x.png")`` works anywhere.
"""

from __future__ import annotations

import math
from typing import Any

from .errors import ExtraError

__all__ = ["color_dim", "plot_layer_stats"]

LAYER_STATS_TITLES = ("mean", "std", "% near zero")


def figure(caller: str, figsize: tuple[float, float], *, extra: str = "plot") -> Any:
    """A matplotlib Figure on the Agg canvas, without touching pyplot's global state.

    Raises:
        ExtraError: without matplotlib, naming `extra` to install.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ExtraError(
            f"{caller}: plotting needs matplotlib, got it not installed. "
            f"Install the extra: pip install 'funhooks[{extra}]'."
        ) from None
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def plot_layer_stats(result: Any, idx: int | str, *, figsize: tuple[float, float] = (12, 3)) -> Any:
    """Plot the mean, std and near-zero share of module `idx` over the recorded steps.

    Args:
        result: an :class:`~funhooks.stats.ActivationStatsResult`.
        idx: a module index or path.
        figsize: the figure size in inches.

    Returns:
        A matplotlib Figure with three Axes. Steps on which the module did not run (NaN)
        leave a gap; the lines of such a module get a dot per step, so a step between two
        gaps still shows.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).
        ReducerError: for an index out of range.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> batches = [(torch.randn(8, 2), torch.randn(8, 1)) for _ in range(4)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.ActivationStats())
        >>> fig = fh.plot.plot_layer_stats(res, 0)
        >>> [ax.get_title() for ax in fig.axes]
        ['mean', 'std', '% near zero']
    """
    fig = figure("plot_layer_stats", figsize)
    series = result.layer_stats(idx)
    axs = fig.subplots(1, len(LAYER_STATS_TITLES))
    gaps = any(math.isnan(v) for v in series[0])
    for values, ax, title in zip(series, axs, LAYER_STATS_TITLES):
        ax.plot(result.iterations, values, marker="." if gaps else None)
        ax.set_title(title)
        ax.set_xlabel("iteration")
    fig.tight_layout()
    return fig


def color_dim(result: Any, idx: int | str, *, ax: Any = None, figsize: tuple[float, float] = (10, 5)) -> Any:
    """Draw fastai's "colorful dimension" image of module `idx`: histograms over steps.

    Args:
        result: an :class:`~funhooks.stats.ActivationStatsResult` folded with ``with_hist=True``.
        idx: a module index or path.
        ax: the matplotlib Axes to draw on; None: a new figure's.
        figsize: the size of a new figure, in inches.

    Returns:
        The Axes drawn on (``ax.figure.savefig("x.png")`` writes it); a step on which the
        module did not run is an empty (zero) column.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).
        ReducerError: for an index out of range or a result without histograms.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> batches = [(torch.randn(8, 2), torch.randn(8, 1)) for _ in range(4)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.ActivationStats(with_hist=True))
        >>> ax = fh.plot.color_dim(res, "0")
        >>> ax.images[0].get_array().shape
        (40, 4)
    """
    image = result.hist(idx)
    if ax is None:
        ax = figure("color_dim", figsize).subplots()
    ax.imshow(image.numpy(), origin="lower", aspect="auto")
    ax.axis("off")
    return ax
