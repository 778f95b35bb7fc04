"""Figures for activation statistics (the optional ``plot`` extra: matplotlib).

matplotlib is imported only when a plot is drawn, never by ``import funhooks``. Figures are
built with ``matplotlib.figure.Figure`` rather than pyplot, so drawing keeps no global
figure state, needs no display, and ``fig.savefig("x.png")`` works anywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from funhooks import _torch
from funhooks.errors import ExtraError

from ._shared import HEALTHY_RATIO

if TYPE_CHECKING:
    import torch
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["color_dim", "figure", "plot_activation_stats", "plot_dead_units", "plot_gradient_stats", "plot_layer_stats",
           "plot_loss", "plot_update_ratio"]

_LAYER_STATS_TITLES = ("mean", "std", "% near zero")


# What each plot reads of its result (the results import this module, so it names none of them).

class _PerLayer(Protocol):
    """A result over recorded steps and layers."""

    @property
    def iterations(self) -> tuple[int, ...]: ...

    @property
    def paths(self) -> tuple[str, ...]: ...


class _ActivationStatsLike(_PerLayer, Protocol):
    """An :class:`~funhooks.ActivationStatsResult`."""

    def layer_stats(self, idx: int | str) -> tuple[list[float], list[float], list[float]]: ...

    def hist(self, idx: int | str) -> torch.Tensor: ...

    @property
    def stats(self) -> Sequence[Sequence[Mapping[str, Any] | None]]: ...


class _GradientStatsLike(_PerLayer, Protocol):
    """A :class:`~funhooks.GradientStatsResult`."""

    def layer_stats(self, idx: int | str) -> tuple[list[float], list[float], list[float], list[float]]: ...


class _UpdateRatioLike(_PerLayer, Protocol):
    """An :class:`~funhooks.UpdateRatioResult`."""

    def log10(self) -> list[list[float]]: ...


class _DeadUnitsLike(_PerLayer, Protocol):
    """A :class:`~funhooks.DeadUnitsResult`."""

    @property
    def dead(self) -> list[list[float]]: ...


class _LossCurveLike(Protocol):
    """A :class:`~funhooks.LossCurveResult`."""

    @property
    def iterations(self) -> tuple[int, ...]: ...

    @property
    def losses(self) -> list[float]: ...

    @property
    def ema(self) -> list[float]: ...

    def __len__(self) -> int: ...


def figure(caller: str, figsize: tuple[float, float], *, extra: str = "plot") -> Figure:
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


def plot_layer_stats(result: _ActivationStatsLike, idx: int | str, *,
                     figsize: tuple[float, float] = (12, 3)) -> Figure:
    """Plot the mean, std and near-zero share of module `idx` over the recorded steps.

    Args:
        result: an :class:`~funhooks.reducers.activation_stats.ActivationStatsResult`.
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
    axs = fig.subplots(1, len(_LAYER_STATS_TITLES))
    gaps = any(math.isnan(v) for v in series[0])
    for values, ax, title in zip(series, axs, _LAYER_STATS_TITLES):
        ax.plot(result.iterations, values, marker="." if gaps else None)
        ax.set_title(title)
        ax.set_xlabel("iteration")
    fig.tight_layout()
    return fig


def color_dim(result: _ActivationStatsLike, idx: int | str, *, ax: Axes | None = None,
              figsize: tuple[float, float] = (10, 5)) -> Axes:
    """Draw fastai's "colorful dimension" image of module `idx`: histograms over steps.

    Args:
        result: an :class:`~funhooks.reducers.activation_stats.ActivationStatsResult` folded with ``with_hist=True``.
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


# -- the per-layer reducers ----------------------------------------------------------------------

_MAX_LEGEND = 12
"""Layers named in a legend; more lines than this are left unnamed (colour only)."""

_GRADIENT_PANELS = (("norm", "gradient norm", True), ("mean", "mean", False), ("std", "std", True),
                    ("zeros", "% zeros", False))


def _labels(paths: tuple[str, ...], model: nn.Module | None) -> list[str]:
    """The legend entries: each layer's path and, given the model, its type (``0 Conv2d``)."""
    if model is None:
        return list(paths)
    kinds = {p: type(m).__name__ for p, m in _torch.named_modules(model, every_path=True)}
    return [f"{p} {kinds[p]}".strip() if p in kinds else p for p in paths]


def _lines(ax: Axes, iterations: tuple[int, ...], series: list[tuple[str, list[float]]], *, log: bool = False) -> None:
    """One line per layer over the iterations (a dot per step where gaps would hide it)."""
    for i, (label, values) in enumerate(series):
        gaps = any(math.isnan(v) for v in values)
        ax.plot(iterations, values, color=f"C{i % 10}", marker="." if gaps else None, linewidth=1.2, label=label)
    if log and any(v > 0 for _, values in series for v in values):
        ax.set_yscale("log")
    ax.set_xlabel("iteration")
    if 1 < len(series) <= _MAX_LEGEND:
        ax.legend(fontsize=7, ncol=2)


def plot_gradient_stats(result: _GradientStatsLike, *, model: nn.Module | None = None, figsize: tuple[float, float] = (12, 7)) -> Figure:
    """Gradient norm, mean, std and share of zeros of every layer over the recorded steps.

    Args:
        result: a :class:`~funhooks.GradientStatsResult`.
        model: the model the result was folded on: legend entries read ``0 Conv2d`` (path and
            type), not ``0``.
        figsize: the figure size in inches.

    Returns:
        A matplotlib Figure with four Axes, one line per layer (norm and std on a log scale).

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, [(torch.randn(8, 2), torch.randn(8, 1))] * 3, nn.functional.mse_loss, opt,
        ...              fh.GradientStats())
        >>> [ax.get_title() for ax in fh.plot.plot_gradient_stats(res).axes]
        ['gradient norm', 'mean', 'std', '% zeros']
    """
    fig = figure("plot_gradient_stats", figsize)
    axes = fig.subplots(2, 2).flatten()
    columns = [result.layer_stats(i) for i in range(len(result.paths))]
    labels = _labels(result.paths, model)
    for k, (ax, (_, title, log)) in enumerate(zip(axes, _GRADIENT_PANELS)):
        scale = 100.0 if k == 3 else 1.0
        _lines(ax, result.iterations, [(p, [scale * v for v in c[k]]) for p, c in zip(labels, columns)], log=log)
        ax.set_title(title)
    fig.suptitle("Gradients per layer, at each optimizer step")
    fig.tight_layout()
    return fig


def plot_update_ratio(result: _UpdateRatioLike, *, model: nn.Module | None = None, figsize: tuple[float, float] = (8, 4)) -> Figure:
    """log10 of every layer's update-to-parameter ratio over the steps, with the 1e-3 line.

    Args:
        result: an :class:`~funhooks.UpdateRatioResult`.
        model: the model, to name each layer's type in the legend (``0 Conv2d``).
        figsize: the figure size in inches.

    Returns:
        A matplotlib Figure with one Axes.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, [(torch.randn(8, 2), torch.randn(8, 1))] * 3, nn.functional.mse_loss, opt,
        ...              fh.UpdateRatio())
        >>> fh.plot.plot_update_ratio(res).axes[0].get_ylabel()
        'log10(|update| / |param|)'
    """

    fig = figure("plot_update_ratio", figsize)
    ax = fig.subplots()
    logs = result.log10()
    _lines(ax, result.iterations, [(p, [row[i] for row in logs]) for i, p in enumerate(_labels(result.paths, model))])
    ax.axhline(math.log10(HEALTHY_RATIO), color="grey", linestyle="--", linewidth=1)
    ax.set_ylabel("log10(|update| / |param|)")
    ax.set_title("Update-to-parameter ratio per layer (dashed: 1e-3)")
    fig.tight_layout()
    return fig


def plot_dead_units(result: _DeadUnitsLike, *, model: nn.Module | None = None, figsize: tuple[float, float] = (8, 4)) -> Figure:
    """The share of dead units of every layer over the steps.

    Args:
        result: a :class:`~funhooks.DeadUnitsResult`.
        model: the model, to name each layer's type in the legend (``0 Conv2d``).
        figsize: the figure size in inches.

    Returns:
        A matplotlib Figure with one Axes.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, [(torch.randn(8, 2), torch.randn(8, 1))] * 3, nn.functional.mse_loss, opt,
        ...              fh.DeadUnits())
        >>> fh.plot.plot_dead_units(res).axes[0].get_ylabel()
        '% dead units'
    """
    fig = figure("plot_dead_units", figsize)
    ax = fig.subplots()
    dead = result.dead
    labels = _labels(result.paths, model)
    _lines(ax, result.iterations, [(p, [100 * row[i] for row in dead]) for i, p in enumerate(labels)])
    ax.set_ylim(-2, 102)
    ax.set_ylabel("% dead units")
    ax.set_title("Dead units per layer (zero on every example of the batch)")
    fig.tight_layout()
    return fig


def plot_loss(result: _LossCurveLike, *, epoch_len: int | None = None,
              figsize: tuple[float, float] = (8, 4)) -> Figure:
    """The loss at every step, its moving average and, given `epoch_len`, the epoch boundaries.

    Args:
        result: a :class:`~funhooks.LossCurveResult`.
        epoch_len: steps per epoch (dotted lines between epochs); None: none.
        figsize: the figure size in inches.

    Returns:
        A matplotlib Figure with one Axes.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, [(torch.randn(8, 2), torch.randn(8, 1))] * 4, nn.functional.mse_loss, opt,
        ...              fh.LossCurve())
        >>> [line.get_label() for line in fh.plot.plot_loss(res, epoch_len=2).axes[0].lines[:2]]
        ['loss per step', 'moving average']
    """
    fig = figure("plot_loss", figsize)
    ax = fig.subplots()
    ax.plot(result.iterations, result.losses, color="C0", alpha=0.35, linewidth=1, label="loss per step")
    ax.plot(result.iterations, result.ema, color="C0", linewidth=2.5, label="moving average")
    if epoch_len:
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        for boundary in range(epoch_len, len(result), epoch_len):
            ax.axvline(boundary, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("iteration")
    ax.set_ylabel("loss")
    ax.set_title("Training loss")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_activation_stats(result: _ActivationStatsLike, *, figsize: tuple[float, float] = (12, 3.5)) -> Figure:
    """Mean, std and % near zero of every module over the recorded steps, one line per module
    (:func:`plot_layer_stats` draws one module): the picture under an
    :class:`~funhooks.ActivationStatsResult`'s notebook display.

    Args:
        result: an :class:`~funhooks.ActivationStatsResult`.
        figsize: the figure size in inches.

    Returns:
        A matplotlib Figure with three Axes; a step on which a module did not run leaves a gap.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, [(torch.randn(8, 2), torch.randn(8, 1))] * 3, nn.functional.mse_loss, opt,
        ...              fh.ActivationStats())
        >>> fig = fh.plot.plot_activation_stats(res)
        >>> [ax.get_title() for ax in fig.axes], [line.get_label() for line in fig.axes[0].lines]
        (['mean', 'std', '% near zero'], ['0', '2'])
    """
    fig = figure("plot_activation_stats", figsize)
    axes = fig.subplots(1, len(_LAYER_STATS_TITLES))
    stats = result.stats  # every step read once (layer_stats would read them once per module)
    for k, (ax, title, key) in enumerate(zip(axes, _LAYER_STATS_TITLES, ("mean", "std", "near_zero"))):
        scale = 100.0 if k == 2 else 1.0
        series = [(p, [math.nan if step[i] is None else scale * step[i][key] for step in stats])  # type: ignore[index]
                  for i, p in enumerate(result.paths)]
        _lines(ax, result.iterations, series)
        ax.set_title(title)
    fig.suptitle("Activations per module, at each recorded step")
    fig.tight_layout()
    return fig
