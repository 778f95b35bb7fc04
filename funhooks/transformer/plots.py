"""Figures of transformer analyses (the optional ``plot`` extra: matplotlib): a patching table
as a layer x position heatmap, a grid of attention patterns per head, and a token's probability
or rank through a logit lens.

Drawn like the training statistics' figures (``fh.plot``): matplotlib is imported only when a
plot is drawn, figures are ``matplotlib.figure.Figure`` objects on the Agg canvas (no pyplot
state, no display needed; ``fig.savefig("x.png")`` works anywhere). Cost: the tensors given
are copied to the host once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from funhooks.reducers.plot import figure

from .lens import LogitLens

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["plot_logit_lens", "plot_patching", "plot_patterns"]

_PATCHING_CMAP = "RdBu"
"""A diverging colormap: the table's sign is the colour, 0 is white."""
_PATTERN_CMAP = "Blues"
_RANK_MARGIN = 0.5
"""Room above rank 0 and below the worst rank drawn, in ranks."""
_MAX_TICKS = 40
"""Positions beyond this many get no tick label each (the labels would overlap)."""
_WIDE_LABELS = 30
"""Characters of x tick labels beyond which they are written upright."""


def _host(caller: str, name: str, value: object, ndims: tuple[int, ...], shape: str) -> torch.Tensor:
    """`value` as a float tensor on the host, checked to have one of `ndims` dimensions."""
    tensor = torch.as_tensor(value).detach() if not isinstance(value, torch.Tensor) else value.detach()
    if tensor.ndim not in ndims:
        raise ValueError(f"{caller}: `{name}` is {shape}, got shape {tuple(tensor.shape)}. Index or reshape it first.")
    return tensor.float().cpu()


def _labels(caller: str, name: str, labels: Sequence[object] | None, count: int) -> list[str]:
    """`labels` as strings, checked to be one per row or column; ``0, 1, ...`` for None."""
    if labels is None:
        return [str(i) for i in range(count)]
    if len(labels) != count:
        raise ValueError(f"{caller}: `{name}` has one label per entry ({count}), "
                         f"got {len(labels)}: {list(labels)!r:.120}. "
                         "Pass as many labels as the tensor has entries along that axis.")
    return [str(label) for label in labels]


def _ticks(ax: Axes, axis: Literal["x", "y"], labels: list[str]) -> None:
    """One tick label per entry (none past _MAX_TICKS); x labels turn upright when they would overlap."""
    if len(labels) > _MAX_TICKS:
        return
    if axis == "x":
        ax.set_xticks(range(len(labels)), labels, rotation=90 if sum(map(len, labels)) > _WIDE_LABELS else 0)
    else:
        ax.set_yticks(range(len(labels)), labels)


def plot_patching(table: torch.Tensor, *, tokens: Sequence[str] | None = None, layers: Sequence[object] | None = None,
                  title: str = "Activation patching", label: str | None = None,
                  figsize: tuple[float, float] | None = None) -> Figure:
    """A patching table as a layer x position heatmap, on a diverging colormap centred at 0.

    Args:
        table: ``(layers, positions)``: e.g. the logit difference after patching each layer's
            residual stream at each position (a ``vmap`` sweep, docs/interventions.md).
        tokens: the text of each position, written under the x axis; None: the indices.
        layers: the label of each row (e.g. ``["embed", 0, 1]``); None: ``0, 1, ...``.
        title: the Axes' title.
        label: the colorbar's label (what the values are), e.g. ``"logit difference"``.
        figsize: inches; None: grows with the table.

    Returns:
        A matplotlib Figure: the heatmap's Axes, then its colorbar's.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).
        ValueError: for a table that is not 2-D, or labels that do not match its shape.

    Example:
        >>> import torch, funhooks as fh
        >>> table = torch.tensor([[0.0, 1.0, -0.5], [0.2, 2.0, 0.0]])
        >>> fig = fh.transformer.plot_patching(table, tokens=["The", " cat", " sat"], label="logit difference")
        >>> ax = fig.axes[0]
        >>> [t.get_text() for t in ax.get_xticklabels()], ax.get_ylabel()
        (['The', ' cat', ' sat'], 'layer')
        >>> ax.images[0].get_clim()              # centred at 0
        (-2.0, 2.0)
    """
    values = _host("plot_patching", "table", table, (2,), "a `(layers, positions)` table")
    rows, cols = values.shape
    x_labels = _labels("plot_patching", "tokens", tokens, cols)
    y_labels = _labels("plot_patching", "layers", layers, rows)
    fig = figure("plot_patching", figsize or (min(2.5 + 0.5 * cols, 16.0), min(1.5 + 0.35 * rows, 12.0)))
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    bound = float(values.abs().max()) or 1.0
    image = ax.imshow(values.numpy(), cmap=_PATCHING_CMAP, vmin=-bound, vmax=bound, aspect="auto")
    _ticks(ax, "x", x_labels)
    _ticks(ax, "y", y_labels)
    ax.set_xlabel("position")
    ax.set_ylabel("layer")
    ax.set_title(title)
    colorbar = fig.colorbar(image, ax=ax)
    if label is not None:
        colorbar.set_label(label)
    return fig


def plot_patterns(pattern: torch.Tensor, *, tokens: Sequence[str] | None = None, heads: Sequence[int] | None = None,
                  example: int = 0, ncols: int = 4, title: str | None = None,
                  figsize: tuple[float, float] | None = None) -> Figure:
    """The attention pattern of each head of one example, in a grid (query down, key across).

    Args:
        pattern: ``(batch, head, query, key)`` (the standard ``pattern`` point, or HF's
            ``output_attentions``), or ``(head, query, key)``.
        tokens: the text of each position, on both axes; None: the indices.
        heads: which heads to draw, in this order; None: all.
        example: the batch row drawn.
        ncols: heads per row of the grid.
        title: the figure's title (e.g. ``"layer 3"``).
        figsize: inches; None: 2.2 per head.

    Returns:
        A matplotlib Figure: one Axes per head, titled ``head h``, with the colours of 0 to 1,
        then the shared colorbar's Axes.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).
        ValueError: for a pattern of another rank, or labels that do not match it.
        IndexError: for a head or example out of range.

    Example:
        >>> import torch, funhooks as fh
        >>> pattern = torch.tril(torch.ones(1, 4, 3, 3)) / torch.arange(1, 4).view(3, 1)
        >>> fig = fh.transformer.plot_patterns(pattern, tokens=["a", "b", "c"], heads=[0, 2])
        >>> [ax.get_title() for ax in fig.axes[:-1]]
        ['head 0', 'head 2']
    """
    values = _host("plot_patterns", "pattern", pattern, (3, 4), "`(batch, head, query, key)` or `(head, query, key)`")
    if values.ndim == 4:
        values = values[example]
    chosen = list(range(values.shape[0])) if heads is None else [int(h) for h in heads]
    for head in chosen:
        if not -values.shape[0] <= head < values.shape[0]:
            raise IndexError(f"plot_patterns: `heads` are in range({values.shape[0]}), got {head}. "
                             "Pick heads the pattern has.")
    keys = _labels("plot_patterns", "tokens", tokens, values.shape[-1])
    queries = keys[len(keys) - values.shape[-2]:]  # the last positions: fewer queries than keys after a cache
    cols = max(1, min(ncols, len(chosen)))
    rows = -(-len(chosen) // cols)
    fig = figure("plot_patterns", figsize or (2.2 * cols + 0.8, 2.2 * rows + (0.4 if title else 0.0)))
    fig.set_layout_engine("constrained")
    grid = fig.subplots(rows, cols, squeeze=False).flatten()
    image = None
    for ax, head in zip(grid, chosen):
        image = ax.imshow(values[head].numpy(), cmap=_PATTERN_CMAP, vmin=0.0, vmax=1.0)
        ax.set_title(f"head {head % values.shape[0]}", fontsize=9)
        _ticks(ax, "x", keys)
        _ticks(ax, "y", queries)
        ax.tick_params(labelsize=7)
    for ax in grid[len(chosen):]:
        fig.delaxes(ax)
    if image is not None:
        fig.colorbar(image, ax=list(grid[: len(chosen)]), shrink=0.8)
    if title is not None:
        fig.suptitle(title)
    return fig


def plot_logit_lens(lens: LogitLens, token: int, *, kind: Literal["prob", "rank"] = "prob", position: int = -1,
                    example: int = 0, name: str | None = None, figsize: tuple[float, float] = (6, 3.5)) -> Figure:
    """A token's probability (or rank) at each layer of a logit lens, at one position.

    Args:
        lens: a :class:`~funhooks.transformer.LogitLens` of ``(layers, batch, position, vocab)``
            logits (or ``(layers, position, vocab)``).
        token: the token id followed.
        kind: ``"prob"`` (its probability, from 0 to 1) or ``"rank"`` (0: the top prediction;
            the axis is drawn upside down, so up is better for both).
        position: the position read.
        example: the batch row read.
        name: the token's text, for the title; None: its id.
        figsize: inches.

    Returns:
        A matplotlib Figure with one Axes: one point per row of the lens, the x ticks its labels.

    Raises:
        ExtraError: without matplotlib (install ``funhooks[plot]``).
        ValueError: for another `kind`, or a lens whose logits have another rank.

    Example:
        >>> import torch, funhooks as fh
        >>> lens = fh.transformer.LogitLens(torch.tensor([[[[0.0, 1.0, 2.0]]], [[[3.0, 1.0, 0.0]]]]),
        ...                                 ("blocks.0.resid_post", "blocks.1.resid_post"))
        >>> ax = fh.transformer.plot_logit_lens(lens, 0, kind="rank").axes[0]
        >>> ax.lines[0].get_ydata().tolist(), [t.get_text() for t in ax.get_xticklabels()]
        ([2.0, 0.0], ['blocks.0.resid_post', 'blocks.1.resid_post'])
    """
    if kind not in ("prob", "rank"):
        raise ValueError(f'plot_logit_lens: `kind` is "prob" or "rank", got {kind!r}.')
    if lens.logits.ndim not in (3, 4):
        raise ValueError("plot_logit_lens: `lens.logits` is `(layers, batch, position, vocab)` or `(layers, position, "
                         f"vocab)`, got shape {tuple(lens.logits.shape)}. "
                         "Build the lens from `(batch, position, d_model)` residuals.")
    per_layer = lens.prob(token) if kind == "prob" else lens.rank(token)
    values = (per_layer[:, example] if per_layer.ndim == 3 else per_layer)[:, position].detach().float().cpu()
    fig = figure("plot_logit_lens", figsize)
    fig.set_layout_engine("constrained")
    ax = fig.subplots()
    ax.plot(range(len(lens.labels)), values.numpy(), marker="o")
    _ticks(ax, "x", list(lens.labels))
    ax.tick_params(axis="x", labelsize=7)
    what = repr(name) if name is not None else f"token {token}"
    if kind == "prob":
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("probability")
    else:
        from matplotlib.ticker import MaxNLocator

        ax.set_ylim(float(values.max()) + _RANK_MARGIN, -_RANK_MARGIN)  # upside down: the top prediction is up
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("rank (0: top)")
    ax.set_title(f"Logit lens: {what} at position {position}")
    return fig
