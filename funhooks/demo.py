"""``funhooks demo``: train a small CNN on real data and look inside it, in one command.

The data are scikit-learn's handwritten digits (1,797 images of 8x8 pixels, shipped inside
the package: nothing is downloaded). The flow is the library's own: print the
:func:`~funhooks.module_summary`, then :func:`~funhooks.fit` folds
:class:`~funhooks.ActivationStats` (with histograms), :class:`~funhooks.GradientStats`,
:class:`~funhooks.UpdateRatio`, :class:`~funhooks.DeadUnits` and :class:`~funhooks.LossCurve`
over the training steps in one pass, and the results become six PNG files.

Cost: a few seconds of training on one CPU core for the default 8 epochs; scikit-learn and
matplotlib (the ``demo`` extra) are imported only here.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import attrs
import torch
from torch import nn

from funhooks import _frozen

from .errors import ExtraError
from .reducers import plot
from .reducers.activation_stats import ActivationStats, ActivationStatsResult
from .reducers.dead_units import DeadUnits, DeadUnitsResult
from .reducers.loss_curve import LossCurve
from .reducers.param_grads import GradientStats, GradientStatsResult
from .reducers.update_ratio import UpdateRatio, UpdateRatioResult
from .summary.utilities import ModuleSummary, module_summary
from .training.folds import Reducer, fit

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["digits", "digits_cnn", "run"]

_SEED = 0
_EPOCHS = 8
_FAST_EPOCHS = 1
_FAST_TRAIN_SIZE = 256  # training images in fast mode (the tests' mode)
_VALID_SIZE = 297  # the last images are held out: 1,500 train, 297 validation
_BATCH_SIZE = 64
_LR = 0.1
_MOMENTUM = 0.9
_PIXEL_MAX = 16.0  # digits' pixels are integers 0..16
_SMOOTHING = 0.9  # exponential moving average of the loss curve
_REPORT_WIDTH = 88  # columns of the printed report
_FILES = {
    "layer_stats": "layer_stats.png",
    "color_dim": "color_dim.png",
    "loss": "loss.png",
    "gradients": "gradients.png",
    "update_ratio": "update_ratio.png",
    "dead_units": "dead_units.png",
}
_WHAT = {
    "layer_stats": "mean, std and share of near-zero values of each layer's output at every step; "
    "std should not collapse to 0",
    "color_dim": "fastai's 'colorful dimension': the histogram of each layer's output over training "
    "(x: step, y: value 0-10, bright: many values); a bright floor means dead activations",
    "loss": "training loss at every step (thin) and its moving average (thick); dotted lines mark epochs",
    "gradients": "norm, mean, std and share of zeros of each layer's gradients at every optimizer step; "
    "norms should neither vanish nor explode",
    "update_ratio": "log10 of |update| / |weights| per layer at every step; about -3 (dashed) is the rule of "
    "thumb for a healthy learning rate",
    "dead_units": "share of each ReLU's channels that are zero on a whole batch; a rising line means units dying",
}


@_frozen.frozen
@attrs.frozen
class _DemoResult:
    """What :func:`run` produced: the PNG files, the losses, the statistics and the accuracy."""

    files: dict[str, Path]
    losses: list[float]
    stats: ActivationStatsResult
    accuracy: float
    summary: ModuleSummary
    gradients: GradientStatsResult
    update_ratio: UpdateRatioResult
    dead_units: DeadUnitsResult


def digits(*, train_size: int | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """scikit-learn's 8x8 digits as ``((x_train, y_train), (x_valid, y_valid))``, normalised.

    Args:
        train_size: keep only the first this many training images (None: all 1,500).

    Returns:
        Images ``(n, 1, 8, 8)`` float32 with the training set's mean 0 and std 1; labels int64.

    Raises:
        ExtraError: without scikit-learn (install ``funhooks[demo]``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ExtraError(
            "digits: the demo data ship with scikit-learn, got it not installed. "
            "Install the extra: pip install 'funhooks[demo]'."
        ) from None
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / _PIXEL_MAX
    y = torch.tensor(data.target, dtype=torch.int64)
    x_train, y_train, x_valid, y_valid = x[:-_VALID_SIZE], y[:-_VALID_SIZE], x[-_VALID_SIZE:], y[-_VALID_SIZE:]
    if train_size is not None:
        x_train, y_train = x_train[:train_size], y_train[:train_size]
    mean, std = x_train.mean(), x_train.std()
    return ((x_train - mean) / std, y_train), ((x_valid - mean) / std, y_valid)


def digits_cnn() -> nn.Sequential:
    """The demo's CNN: three conv + ReLU blocks (8x8 -> 4x4 -> 2x2), pooling and a linear head.

    Example:
        >>> import funhooks as fh
        >>> from funhooks.demo import digits_cnn
        >>> fh.model_sizes(digits_cnn(), size=(8, 8))[-1]
        (1, 10)
    """
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )


# -- plots -----------------------------------------------------------------------------------------


class _ByLayer(Protocol):
    """A result with one entry per layer path."""

    @property
    def paths(self) -> Sequence[str]: ...


def _label(stats: _ByLayer, i: int, model: nn.Module) -> str:
    path = stats.paths[i]
    return f"{path} ({type(model.get_submodule(path)).__name__})"


def _plot_layer_stats(stats: ActivationStatsResult, model: nn.Module, epoch_len: int) -> Figure:
    """One row per layer, columns mean / std / % near zero over the steps."""
    n = len(stats.paths)
    fig = plot.figure("demo", (12, 2.2 * n + 0.6), extra="demo")
    axes = fig.subplots(n, 3, squeeze=False, sharex=True)
    for i in range(n):
        for j, (values, title) in enumerate(zip(stats.layer_stats(i), ("mean", "std", "% near zero"))):
            ax = axes[i][j]
            ax.plot(stats.iterations, [100 * v for v in values] if j == 2 else values, color=f"C{i}")
            if i == 0:
                ax.set_title(title)
            if j == 0:
                ax.set_ylabel(_label(stats, i, model), fontsize=9)
            if i == n - 1:
                ax.set_xlabel("step")
            _epochs(ax, stats.iterations[-1] + 1, epoch_len)
    fig.suptitle("Activation statistics per layer")
    fig.tight_layout()
    return fig


def _plot_color_dim(stats: ActivationStatsResult, model: nn.Module) -> Figure:
    """fastai's colorful dimension of every layer, one panel each."""
    n = len(stats.paths)
    fig = plot.figure("demo", (10, 2.0 * n + 0.6), extra="demo")
    axes = fig.subplots(n, 1, squeeze=False)
    for i in range(n):
        ax = stats.color_dim(i, ax=axes[i][0])
        ax.set_title(_label(stats, i, model), fontsize=10)
    fig.suptitle("Histograms of activations over training (x: step, y: value 0-10, log scale)")
    fig.tight_layout()
    return fig


def _epochs(ax: Axes, steps: int, epoch_len: int) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    for boundary in range(epoch_len, steps, epoch_len):
        ax.axvline(boundary, color="grey", linestyle=":", linewidth=1)


# -- the flow ------------------------------------------------------------------------------------------


def run(
    *,
    out: str | os.PathLike = "funhooks-demo",
    epochs: int | None = None,
    fast: bool = False,
    progress: bool | None = None,
    echo: Callable[[str], None] = print,
) -> _DemoResult:
    """Train :func:`digits_cnn` on the digits, fold statistics, write the plots into `out`.

    Seeds torch's global generator with :data:`_SEED`, so every run trains the same model.

    Args:
        out: the directory for the PNG files (created if missing).
        epochs: epochs to train (None: 8, or 1 with `fast`).
        fast: one epoch on the first 256 training images (for tests and CI).
        progress: the progress bar (None: in a terminal and not in CI).
        echo: where the report lines go.

    Returns:
        A :class:`_DemoResult`.

    Raises:
        ExtraError: without scikit-learn or matplotlib (install ``funhooks[demo]``).
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)  # fail before training, not after
    torch.manual_seed(_SEED)
    epochs = epochs or (_FAST_EPOCHS if fast else _EPOCHS)
    (x_train, y_train), (x_valid, y_valid) = digits(train_size=_FAST_TRAIN_SIZE if fast else None)
    batches = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x_train, y_train), batch_size=_BATCH_SIZE, shuffle=True,
        drop_last=True,  # equal batches: a short last batch would streak the histograms
        generator=torch.Generator().manual_seed(_SEED),
    )
    model = digits_cnn()
    summary = module_summary(model, x_train[:_BATCH_SIZE])
    echo(f"Training a small CNN on scikit-learn's digits: {len(x_train)} images of 8x8 for training, "
         f"{len(x_valid)} for validation, {epochs} epoch(s) of {len(batches)} steps.\n")
    echo(str(summary) + "\n")

    opt = torch.optim.SGD(model.parameters(), lr=_LR, momentum=_MOMENTUM)
    reducers: dict[str, Reducer] = {"stats": ActivationStats(with_hist=True), "loss": LossCurve(beta=_SMOOTHING),
                "gradients": GradientStats(), "update_ratio": UpdateRatio(), "dead_units": DeadUnits()}
    results = fit(model, batches, nn.functional.cross_entropy, opt, reducers, epochs=epochs, progress=progress)
    stats, curve = results["stats"], results["loss"]
    losses = curve.losses
    with torch.no_grad():
        accuracy = (model(x_valid).argmax(dim=1) == y_valid).float().mean().item()

    figures = {
        "layer_stats": _plot_layer_stats(stats, model, len(batches)),
        "color_dim": _plot_color_dim(stats, model),
        "loss": curve.plot(epoch_len=len(batches)),
        "gradients": plot.plot_gradient_stats(results["gradients"], model=model),
        "update_ratio": plot.plot_update_ratio(results["update_ratio"], model=model),
        "dead_units": plot.plot_dead_units(results["dead_units"], model=model),
    }
    files = {}
    for name, fig in figures.items():
        files[name] = (folder / _FILES[name]).resolve()
        fig.savefig(files[name])

    grads, update, dead = results["gradients"], results["update_ratio"], results["dead_units"]
    _report(echo, model, results, accuracy, folder, files)
    return _DemoResult(files=files, losses=losses, stats=stats, accuracy=accuracy, summary=summary,
                       gradients=grads, update_ratio=update, dead_units=dead)


def _report(echo: Callable[[str], None], model: nn.Module, results: dict, accuracy: float, folder: Path,
            files: dict[str, Path]) -> None:
    """The demo's closing lines: the loss, each layer's last statistics, where the plots went."""
    stats, losses = results["stats"], results["loss"].losses
    grads, update, dead = results["gradients"], results["update_ratio"], results["dead_units"]
    last = stats.stats[-1]
    echo(f"\nLoss: {losses[0]:.3f} at the first step, {losses[-1]:.3f} at the last. "
         f"Validation accuracy: {100 * accuracy:.1f}%.")
    echo("Last step, per layer (fh.ActivationStats):")
    for i, path in enumerate(stats.paths):
        s = last[i]
        echo(f"  {_label(stats, i, model):<18} mean {s['mean']:+.3f}  std {s['std']:.3f}  "
             f"near zero {100 * s['near_zero']:.0f}%")
    echo("Last step, per layer (fh.GradientStats, fh.UpdateRatio):")
    last_grads, last_update = grads.stats[-1], update.log10()[-1]
    for i, path in enumerate(grads.paths):
        g = last_grads[i]
        ratio = last_update[update.paths.index(path)] if path in update.paths else math.nan
        norm = f"{g['norm']:.3g}" if g else "-"
        echo(f"  {_label(grads, i, model):<18} grad norm {norm:<9} log10 update ratio {ratio:+.2f}")
    echo("Dead units, last step (fh.DeadUnits): " + ", ".join(
        f"{_label(dead, i, model)} {100 * share:.0f}%" for i, share in enumerate(dead.dead[-1])))
    echo(f"\nPlots written to {folder.resolve()}:")
    for name, path in files.items():
        lines = textwrap.wrap(_WHAT[name], width=_REPORT_WIDTH - 19)
        echo(f"  {path.name:<16} " + f"\n{' ' * 19}".join(lines))
