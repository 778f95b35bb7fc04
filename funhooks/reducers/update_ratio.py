"""UpdateRatio: how much each layer's parameters move at each optimizer step, relative to
their size, as a reducer.

Per layer (a module with parameters of its own, all of them together) and recorded step:
``‖θ_after - θ_before‖ / ‖θ_before‖``, the L2 norm of the update over the L2 norm of the
parameters before it, read around the optimizer's update through an
:class:`~funhooks.OptimizerWatch`, so it is the update the optimizer really made (momentum,
Adam's scaling, weight decay, the learning rate of that step included). Around 1e-3 is the
usual rule of thumb for a healthy learning rate; far below, the layer barely learns; far
above, it is being rewritten every step.

The step's Record holds, under ``"update_ratio"``, each layer's ``(‖update‖², ‖parameters
before‖²)`` in float64 (sums that add across shards); the ratios are taken when a result is
read.

Cost: per recorded step, the selected parameters are copied once before the update (stacked
by shape) and stacked again after it; five kernels per shape and three to add them by
layer, on their device. Memory: two copies of the selected parameters during the update.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

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
from ._shared import HEALTHY_RATIO
from .layers import OwnParams

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["HEALTHY_RATIO", "UpdateRatio", "UpdateRatioResult"]

_NAME = "update_ratio"


@_frozen.frozen
@attrs.frozen
class _Before:
    """The watch's first function: the parameters before the update, stacked by shape (a copy)."""

    def __call__(self, layers: Layers) -> list[torch.Tensor]:
        plan = _params.plan(layers.cache, layers.params)
        return plan.groups.stacks(plan.flat)


@_frozen.frozen
@attrs.frozen
class _After:
    """The watch's second function: ``{path: (‖update‖², ‖parameters before‖²)}`` from the copy
    and the parameters now (what :func:`_finish` turns into ratios when a result is read)."""

    def __call__(self, layers: Layers, before: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = _params.plan(layers.cache, layers.params)
        table = [torch.stack((torch.linalg.vector_norm(a.sub_(b), dim=1), torch.linalg.vector_norm(b, dim=1)), 1)
                 for a, b in zip(plan.groups.stacks(plan.flat), before)]
        return dict(zip(layers.paths, plan.groups.by_layer([t.square_() for t in table]).unbind(0)))


def _log10(ratio: float) -> float:
    """log10 of a ratio: ``-inf`` for a zero update, NaN for NaN."""
    return math.log10(ratio) if ratio > 0 else -math.inf if ratio == 0 else math.nan


def _finish(sums: torch.Tensor) -> torch.Tensor:
    """Ratios ``‖update‖ / ‖parameters‖`` from rows of ``(‖update‖², ‖parameters‖²)``."""
    return sums[:, :1].div(sums[:, 1:]).sqrt_()


@_frozen.frozen
@attrs.frozen
class UpdateRatio(_layered.Reducer):
    """Per-layer ``‖update‖ / ‖parameters‖`` at every recorded optimizer step.

    Args:
        modules: the layers (a selector); None: every module with parameters of its own.
        every: record train iterations with ``iteration % every == 0``; None: all.

    Result: an :class:`UpdateRatioResult`. States merge (``merge``): chunks of steps
    concatenate; two ranks' states of one iteration hold the same replicated parameters
    (DDP), so the merge keeps the first's values. Under FSDP2 the per-layer sums of the
    ranks' shards are added at the step, so every rank holds the whole model's ratios.

    Raises:
        ReducerError: at construction, for ``every <= 0``.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> batches = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(3)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.UpdateRatio())
        >>> res.paths, len(res.ratios)
        (('0', '2'), 3)
        >>> 0 < res.layer("0")[0] < 1
        True
    """

    modules: Selector | None = attrs.field(default=None, converter=_shared.to_selector)
    every: int | None = attrs.field(default=None, validator=_shared.check_every("UpdateRatio"))
    NAME = _NAME
    _watches: tuple[OptimizerWatch, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        where = OwnParams() if self.modules is None else self.modules  # made once: fit reads it often
        object.__setattr__(self, "_watches", (OptimizerWatch(where, _Before(), _After(), name=_NAME),))

    @property
    def watches(self) -> tuple[OptimizerWatch, ...]:
        """One watch copying the selected parameters before each update, comparing after it."""
        return self._watches

    def scalars(self, state: _layered.State, *, since: int = 0) -> dict[str, float]:
        """``{"<layer>/<name>": value}``: each layer's ratio (``ratio``) at the newest
        recorded step, when its iteration is `since` or later (else ``{}``); the numbers ``result``
        gives for that step, read to the host in one copy."""
        return _layered.scalars(state, since, _finish, ("ratio",))

    def result(self, state: _layered.State) -> UpdateRatioResult:
        """The ratios of every recorded step.

        Raises:
            ReducerError: when steps were recorded and none holds ratios (steps run without
                the reducer's watches).
        """
        return UpdateRatioResult(_layered.table(state, "UpdateRatio", _NAME, _finish))


@_frozen.frozen
@attrs.frozen(eq=False)
class UpdateRatioResult(_layered.TableResult):
    """The result of :class:`UpdateRatio`: per recorded step, per layer path, the ratio.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.0)
        >>> res = fh.fit(model, [(torch.ones(4, 2), torch.zeros(4, 1))], nn.functional.mse_loss, opt, fh.UpdateRatio())
        >>> res.ratios
        [[0.0]]
    """

    table: _layered.Table

    @property
    def ratios(self) -> list[list[float]]:
        """Per recorded step, per layer of ``paths``, the ratio (NaN where the layer was not updated)."""
        return self.table.per_step(0)

    def layer(self, idx: int | str) -> list[float]:
        """The ratios of layer `idx` (an index into ``paths``, or a path) over the steps.

        Raises:
            ReducerError: for an index out of range or an unknown path.
        """
        return self.table.column(idx, 0, "layer")

    def log10(self) -> list[list[float]]:
        """``ratios`` in log10 (``-inf`` for a zero update)."""
        return [[_log10(r) for r in row] for row in self.ratios]

    def plot(self, *, model: nn.Module | None = None, figsize: tuple[float, float] = (8, 4)) -> Figure:
        """log10 of every layer's ratio over the steps, with the 1e-3 rule of thumb (``plot`` extra).

        Args:
            model: the model folded on, to name each layer's type in the legend (``0 Conv2d``).
            figsize: the figure's size in inches.

        Returns:
            A matplotlib Figure (``fig.savefig("update.png")`` writes it).
        """
        from . import plot

        return plot.plot_update_ratio(self, model=model, figsize=figsize)

    def __repr__(self) -> str:
        return f"UpdateRatioResult({len(self)} steps, paths={_html.short(list(self.paths))})"

    def _repr_html_(self) -> str:
        """A notebook's view: per layer, the steps it was updated on and its ratio (and log10) at
        the last recorded step (only that step's numbers are read for the table), then
        :meth:`plot` (the ``plot`` extra)."""
        last = self.table.last()
        it = self.iterations[-1] if len(self) else -1
        counts = _display.steps_per_path(e.paths for e in self.table.entries)
        rows: list[list[_html.Cell | str]] = []
        for p in self.paths:
            ratio = last[p][0] if p in last else None
            log = None if ratio is None else _log10(ratio)
            rows.append([p, str(counts[p]), _display.value(ratio, it), _display.value(log, it)])
        caption = _display.caption("UpdateRatio", self.iterations, len(self.paths), "layer")
        return _display.html("UpdateRatio", ("layer", "steps", "|update| / |param|", "log10"), rows,
                             caption=caption + f"; healthy near {HEALTHY_RATIO:g} (log10 {math.log10(HEALTHY_RATIO):g})",
                             draw=self.plot if len(self) else None)
