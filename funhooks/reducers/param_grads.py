"""GradientStats: per-layer statistics of the gradients the optimizer applies, as a reducer.

It reads the gradients at each optimizer step through an :class:`~funhooks.OptimizerWatch`,
so they are the ones the update uses: accumulated over micro-batches, unscaled by a
``GradScaler``, clipped by whatever clipped them before the step (under Lightning, read in
``on_before_optimizer_step``, before Lightning's own clipping). Per layer (a module with
parameters of its own, all of them together) and step: the L2 norm, the mean, the standard
deviation and the fraction of exact zeros of its gradients. A step the optimizer skipped
(a ``GradScaler`` that found an inf) has none; a layer without gradients on a step is absent
from it.

The step's Record holds, under ``"gradient_stats"``, each layer's sums ``(count, sum, sum of
squares, zero count)`` in float64: they add across micro-steps and shards, and the statistics
are derived from them when a result is read.

Cost: per recorded step, the gradients are stacked by shape (one copy) and reduced with
three kernels per shape (sum, norm, zero count) in their own dtype, and a few to add them by
layer in float64 (the element counts are known from the shapes, not computed); nothing is
read to the host until a result is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import attrs
import torch
from torch import nn

from funhooks import _frozen, _html
from funhooks.specs.selector import Selector
from funhooks.training.watch import Layers, OptimizerWatch

from . import _display
from . import _layered
from . import _params
from . import _shared
from .layers import OwnParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["GradientStats", "GradientStatsResult"]

_NAME = "gradient_stats"
_COLUMNS = ("norm", "mean", "std", "zeros")


@_frozen.frozen
@attrs.frozen
class _GradientRows:
    """The watch's function: ``{path: (count, sum, sum of squares, zeros)}`` of each layer's
    gradients (what :func:`_finish` turns into statistics when a result is read)."""

    def __call__(self, layers: Layers) -> dict[str, torch.Tensor]:
        plan = _params.plan(layers.cache, layers.params)
        grads = [p.grad for p in plan.flat]
        if any(g is None or g.is_sparse for g in grads):
            return _some_gradients(layers)
        return _rows(plan.groups, cast(list[torch.Tensor], grads), layers.paths)


def _some_gradients(layers: Layers) -> dict[str, torch.Tensor]:
    """The rows when some parameters have no gradient (or a sparse one) on this step."""
    present: list[str] = []
    tensors: list[torch.Tensor] = []
    owners: list[int] = []
    for i, params in enumerate(layers.params):
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            owners += [len(present)] * len(grads)
            present.append(layers.paths[i])
            tensors += [g.to_dense() if g.is_sparse else g for g in grads]
    if not tensors:
        return {}
    return _rows(_params.Groups(tensors, owners, len(present)), tensors, present)


def _rows(groups: _params.Groups, grads: list[torch.Tensor], paths: tuple[str, ...] | list[str]) -> dict[str, torch.Tensor]:
    """Per layer, the sums its statistics come from: ``(count, sum, sum of squares, zeros)`` of
    its gradients, in float64 (the sums accumulated in float32 within a tensor, float64 across
    them; the zero counts exact below 2**24 elements per tensor)."""
    table = []
    for x in groups.stacks(grads):  # a copy: its 0/1 flags of zeros are written over it
        total, squares = x.sum(1), torch.linalg.vector_norm(x, dim=1).square_()
        table.append(torch.stack((total, squares, x.eq_(0).sum(1)), 1))  # zeros: a float sum of 0/1, exact below 2**24
    return dict(zip(paths, groups.by_layer(table, counts=True).unbind(0)))


def _finish(sums: torch.Tensor) -> torch.Tensor:
    """``(norm, mean, std, zero fraction)`` rows from ``(count, sum, sum of squares, zeros)``
    rows: the std (unbiased) is good to about ``1e-6 * (1 + mean**2 / std**2)``."""
    n, total, squares, zeros = sums.unbind(1)
    mean = total / n
    std = ((squares - total * mean) / (n - 1)).clamp_min_(0).sqrt_()
    return torch.stack((squares.sqrt(), mean, std, zeros / n), 1)


@_frozen.frozen
@attrs.frozen
class GradientStats(_layered.Reducer):
    """Per-layer gradient statistics at every recorded optimizer step: norm, mean, std, zeros.

    Args:
        modules: the layers (a selector); None: every module with parameters of its own.
        every: record train iterations with ``iteration % every == 0``; None: all.

    Result: a :class:`GradientStatsResult`. States merge (``merge``): chunks of steps
    concatenate; two ranks' states of one iteration hold the same all-reduced gradients
    (DDP), so the merge keeps the first's values rather than counting them twice. Under
    FSDP2 each rank reads its shards and the per-layer sums are added across ranks at the
    step (one all-reduce of a small table), so every rank already holds the whole model's
    statistics.

    Raises:
        ReducerError: at construction, for ``every <= 0``.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(3)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.GradientStats())
        >>> res.paths, len(res.stats), sorted(res.stats[0][0])
        (('0', '2'), 3, ['mean', 'norm', 'std', 'zeros'])
        >>> norms, means, stds, zeros = res.layer_stats("2")
        >>> abs(norms[-1] - torch.cat([p.grad.flatten() for p in model[2].parameters()]).norm().item()) < 1e-5
        True
    """

    modules: Selector | None = attrs.field(default=None, converter=_shared.to_selector)
    every: int | None = attrs.field(default=None, validator=_shared.check_every("GradientStats"))
    NAME = _NAME
    _watches: tuple[OptimizerWatch, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        where = OwnParams() if self.modules is None else self.modules  # made once: fit reads it often
        object.__setattr__(self, "_watches", (OptimizerWatch(where, _GradientRows(), name=_NAME),))

    @property
    def watches(self) -> tuple[OptimizerWatch, ...]:
        """One watch reading the selected layers' gradients just before each update."""
        return self._watches

    def scalars(self, state: _layered.State, *, since: int = 0) -> dict[str, float]:
        """``{"<layer>/<name>": value}``: each layer's gradient statistics (``norm``, ``mean``, ``std``, ``zeros``) at the newest
        recorded step, when its iteration is `since` or later (else ``{}``); the numbers ``result``
        gives for that step, read to the host in one copy."""
        return _layered.scalars(state, since, _finish, _COLUMNS)

    def result(self, state: _layered.State) -> GradientStatsResult:
        """The statistics of every recorded step.

        Raises:
            ReducerError: when steps were recorded and none holds gradient statistics (steps
                run without the reducer's watches, e.g. by ``fh.train`` without ``watches=``).
        """
        return GradientStatsResult(_layered.table(state, "GradientStats", _NAME, _finish))


@_frozen.frozen
@attrs.frozen(eq=False)
class GradientStatsResult(_layered.TableResult):
    """The result of :class:`GradientStats`: per recorded step, per layer path statistics.

    ``paths`` lists every layer that had gradients on some recorded step, in module order;
    ``stats[step]`` is aligned with it, None where the layer had none on that step.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> batches = [(torch.ones(4, 2), torch.zeros(4, 1))] * 2
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.GradientStats())
        >>> res.iterations, res.paths
        ((0, 1), ('',))
    """

    table: _layered.Table

    @property
    def stats(self) -> list[list[dict[str, float] | None]]:
        """Per recorded step, per layer of ``paths``: ``{"norm", "mean", "std", "zeros"}`` as
        Python floats (``zeros``: the fraction of exact zeros); None where it had no gradient."""
        return [[dict(zip(_COLUMNS, row[p])) if p in row else None for p in self.paths] for row in self.table.rows()]

    def layer_stats(self, idx: int | str) -> tuple[list[float], list[float], list[float], list[float]]:
        """``(norms, means, stds, zeros)`` of layer `idx` (an index into ``paths``, or a path)
        over the recorded steps; NaN for a step without its gradient.

        Raises:
            ReducerError: for an index out of range or an unknown path.
        """
        columns = [self.table.column(idx, k, "layer_stats") for k in range(len(_COLUMNS))]
        return columns[0], columns[1], columns[2], columns[3]

    def plot(self, *, model: nn.Module | None = None, figsize: tuple[float, float] = (12, 7)) -> Figure:
        """Norm, mean, std and share of zeros of every layer over the steps (the ``plot`` extra).

        Args:
            model: the model folded on, to name each layer's type in the legend (``0 Conv2d``).
            figsize: the figure's size in inches.

        Returns:
            A matplotlib Figure with four Axes (``fig.savefig("grads.png")`` writes it).
        """
        from . import plot

        return plot.plot_gradient_stats(self, model=model, figsize=figsize)

    def __repr__(self) -> str:
        return f"GradientStatsResult({len(self)} steps, paths={_html.short(list(self.paths))})"

    def _repr_html_(self) -> str:
        """A notebook's view: per layer, the steps it had gradients on and its gradient norm,
        mean, std and % zeros at the last recorded step (only that step's numbers are read for
        the table), then :meth:`plot` (the ``plot`` extra)."""
        last = self.table.last()
        it = self.iterations[-1] if len(self) else -1
        counts = _display.steps_per_path(e.paths for e in self.table.entries)
        rows: list[list[_html.Cell | str]] = [
            [p, str(counts[p]), *(_display.value(last[p][k] if p in last else None, it, scale=scale)
                                  for k, scale in enumerate((1.0, 1.0, 1.0, 100.0)))] for p in self.paths]
        caption = _display.caption("GradientStats", self.iterations, len(self.paths), "layer")
        return _display.html("GradientStats", ("layer", "steps", "norm", "mean", "std", "% zeros"), rows,
                             caption=caption, draw=self.plot if len(self) else None)
