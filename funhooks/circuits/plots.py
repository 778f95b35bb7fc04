"""Figures of circuits (the optional ``plot`` extra: matplotlib): an edge table as a writers x
readers heatmap and a faithfulness curve, drawn like ``fh.transformer``'s figures (matplotlib
imported only when drawn, figures on the Agg canvas, no pyplot state).

Cost: the tensors are copied to the host once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from funhooks.reducers.plot import figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["plot_curve", "plot_edges"]

_CMAP = "RdBu"
"""A diverging colormap: the score's sign is the colour, 0 is white."""
_MAX_TICKS = 60
"""Axes with more labels than this get none (they would overlap)."""


def plot_edges(table: torch.Tensor, writers: Sequence[str], readers: Sequence[str], *,
               edges: torch.Tensor | None = None, title: str = "EAP") -> Figure:
    """Edge scores as a writers (down) x readers (across) heatmap centred at 0 (``Edges.plot()``).

    Args:
        table: ``(writers, readers)`` scores.
        writers, readers: the row and column labels.
        edges: a bool mask of the same shape: where False (no edge) is left blank; None: all drawn.
        title: the Axes' title.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=1, n_embd=16, n_head=2, vocab_size=20, n_positions=8)).eval()
        >>> edges = fh.circuits.eap(model, lambda out: out.logits[:, -1, 3])(torch.tensor([[1, 2]]), torch.tensor([[4, 2]]))
        >>> ax = edges.plot().axes[0]
        >>> ax.get_xlabel(), len(ax.get_yticklabels())
        ('reader', 5)
    """
    values = table.detach().float().cpu()
    if edges is not None:
        values = values.masked_fill(~edges.cpu(), float("nan"))
    rows, cols = values.shape
    if (len(writers), len(readers)) != (rows, cols):
        raise ValueError(f"plot_edges: one label per row and column of the table, {(rows, cols)}, got "
                         f"{(len(writers), len(readers))}. Pass the table's writers and readers.")
    fig = figure("plot_edges", (min(3.0 + 0.25 * cols, 18.0), min(2.0 + 0.25 * rows, 14.0)))
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    bound = float(values.nan_to_num().abs().max()) or 1.0
    image = ax.imshow(values.numpy(), cmap=_CMAP, vmin=-bound, vmax=bound, aspect="auto", interpolation="nearest")
    if cols <= _MAX_TICKS:
        ax.set_xticks(range(cols), list(readers), rotation=90)
    if rows <= _MAX_TICKS:
        ax.set_yticks(range(rows), list(writers))
    ax.set_xlabel("reader")
    ax.set_ylabel("writer")
    ax.set_title(title)
    fig.colorbar(image, ax=ax).set_label("estimated change of the metric")
    return fig


def plot_curve(sizes: Sequence[int], recovered: torch.Tensor, *, title: str = "Faithfulness") -> Figure:
    """The metric recovered (y) against the number of edges kept (x) (``Curve.plot()``).

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).
    """
    fig = figure("plot_curve", (5.0, 3.5))
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    ax.plot(list(sizes), recovered.detach().float().cpu().tolist(), marker="o")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xlabel("edges kept")
    ax.set_ylabel("metric recovered")
    ax.set_title(title)
    return fig
