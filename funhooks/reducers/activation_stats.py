"""ActivationStats: fastai's activation statistics as a pure fold reducer.

A frozen value (see :mod:`funhooks.training.folds` for the protocol): its one observer spec runs on
the selected modules' outputs, ``step`` adds one recorded train step to an immutable state,
``result`` gives fastai's results. ``every=k`` records the train iterations with
``iteration % k == 0`` (``ceil(n / k)`` of ``n``); evaluation steps are never recorded, and
under :func:`funhooks.fit` the other iterations run with the hooks paused, so they cost
nothing but the loop.

ActivationStats keeps its statistics on the activation's device until a result is read:
nothing calls ``.item()`` per batch, so a GPU never syncs. Its statistics are fastai's, to
the bit: ``mean`` and ``std`` (unbiased) equal ``o.float().mean().item()`` and
``o.float().std().item()`` of the same output exactly (fastai's own test compares them with
``==``), ``near_zero`` is the fraction of values ``<= NEAR_ZERO`` and, with ``with_hist``,
``hist`` is ``histc(HIST_BINS, *HIST_RANGE)``. They are keyed by module path: a module that
did not run on a step is absent from it. How the numbers are made exact, batched, is
:mod:`funhooks.reducers._exact`'s business.

Cost: a contiguous CPU activation of at most ``REDUCE_IN_HOOK_NUMEL`` elements is kept by
the hook until the end of its step, and the step's kept activations are reduced together, a
dozen kernels per step instead of three per module. Under a recording of ``fh.fit``,
``fh.train``, ``fh.folding`` or a trainer callback, an activation is copied in the hook on the
first step of that recording that reaches its module (again after a module is added, removed
or replaced), which shows whether a later op (an ``inplace=True`` activation, a ``+=``
residual) changes it in place before the step ends; from then on it is kept without a copy if
nothing did (its version counter is checked when the step's Record is taken) and copied
otherwise. What the recording learned goes with it (see
:class:`~funhooks.training.recorder.Learned`); outside one (a plain ``with_hooks`` block)
every small activation is copied. Larger, non-contiguous and non-CPU activations are reduced in
the hook by ``mean()`` and ``std()`` themselves (on a GPU, a few asynchronous kernels per
module). The state holds per step one ``(modules, 3)`` tensor of ``(mean, std, near-zero
count)`` (and ``(modules, hist_bins)`` with histograms) and the paths of the modules that ran.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, TypeAlias, TypedDict, TypeVar, cast

import attrs
import torch

from funhooks import _frozen, _html
from funhooks.errors import ReducerError
from funhooks.specs.selector import Selector
from funhooks.specs.spec import Spec, observe
from funhooks.training.step import Step

from . import _display, _exact, _shared
from ._exact import REDUCE_IN_HOOK_NUMEL
from ._shared import roll, unroll
from .hook_callback import HookCallback
from .layers import LeafModules, OwnParams

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "HIST_BINS",
    "HIST_RANGE",
    "NEAR_ZERO",
    "REDUCE_IN_HOOK_NUMEL",
    "ActivationStats",
    "ActivationStatsResult",
    "HookCallback",
    "LeafModules",
    "OwnParams",
    "roll",
    "unroll",
]

NEAR_ZERO = 0.05
"""fastai's near-zero threshold: an activation value counts as near zero when ``<=`` this."""

HIST_BINS = 40
"""fastai's histogram: this many bins ..."""

HIST_RANGE = (0.0, 10.0)
"""... over this range; values outside it are not counted (fastai's ``histc(40, 0, 10)``,
which ignores every negative activation)."""

Tensor = torch.Tensor

T = TypeVar("T")

_State: TypeAlias = "_shared.Cons[_exact.Entry | _exact.Kept]"
"""One :class:`~funhooks.reducers._exact.Entry` per recorded step, newest on top."""


def _check_near_zero(instance: object, attribute: attrs.Attribute[T], near_zero: T) -> None:
    if not _shared.is_number(near_zero):
        raise ReducerError(
            f"ActivationStats: `near_zero` is a number (values `<= near_zero` count as near zero), got "
            f"{near_zero!r}. Pass e.g. near_zero={NEAR_ZERO} (fastai's)."
        )


def _check_hist_bins(instance: object, attribute: attrs.Attribute[T], bins: T) -> None:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
        raise ReducerError(
            f"ActivationStats: `hist_bins` is a positive int, got {bins!r}. "
            f"Pass the number of histogram bins, e.g. hist_bins={HIST_BINS} (fastai's)."
        )


def _as_pair(value: object) -> object:
    """A list range becomes a tuple; anything else is left for the validator to judge."""
    return tuple(value) if isinstance(value, (tuple, list)) else value


def _check_hist_range(instance: object, attribute: attrs.Attribute[T], bounds: T) -> None:
    if not (isinstance(bounds, tuple) and len(bounds) == 2
            and all(_shared.is_number(b) and math.isfinite(b) for b in bounds)
            and bounds[0] < bounds[1]):
        low, high = (int(b) if float(b).is_integer() else b for b in HIST_RANGE)
        raise ReducerError(
            f"ActivationStats: `hist_range` is a pair (low, high) of finite numbers with low < high, got {bounds!r}. "
            f"Pass e.g. hist_range={(low, high)!r} (fastai's)."
        )



@_frozen.frozen
@attrs.frozen
class ActivationStats:
    """fastai's ``ActivationStats`` as a reducer: mean, std and near-zero share (and
    histograms) of each module's output, per recorded train step, keyed by module path.

    Args:
        with_hist: also keep ``histc(hist_bins, *hist_range)`` of each output.
        modules: a selector; None: leaf modules with parameters (fastai's choice).
        every: record train iterations with ``iteration % every == 0``; None: all.
        include_paramless: with ``modules=None``, also the leaves without parameters.
        near_zero: the near-zero threshold (:data:`NEAR_ZERO`, fastai's).
        hist_bins, hist_range: the histogram (:data:`HIST_BINS`, :data:`HIST_RANGE`, fastai's).

    Result: an :class:`ActivationStatsResult`. A module that did not run on a step
    (stochastic depth, routing, early exit) is absent from that step; the result's
    ``paths`` are those of every module that ran on some recorded step. States merge
    exactly (``merge``): disjoint chunks of steps concatenate, and two parts of one step
    (two ranks) combine by path: counts, means and variances (Chan's formula), near-zero
    counts and histograms of a module that ran in both, the one part's statistics of a
    module that ran in one.

    Raises:
        ReducerError: at construction, for ``every <= 0``, ``hist_bins <= 0``, a `hist_range`
            that is not a pair ``low < high`` of finite numbers, a `near_zero` that is not a
            number, or a flag that is not a bool; in the forward pass (from the hook, so
            possibly wrapped in a :class:`~funhooks.HookError`), for a selected module whose
            output is not a tensor (an ``nn.LSTM``'s tuple): select others with `modules=`;
            from ``result``, when recorded steps exist and no selected module stored
            statistics on any of them (steps run without ``specs=reducer.specs``).
        StaleTensorError: from the training (``fh.fit``, ``fh.train``, ...) when it takes a
            step's Record, if an output kept without a copy (nothing changed it on the earlier
            steps of that recording) was changed in place after the hook: a module whose
            output some steps change in place and others not.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> batches = [(torch.randn(16, 4), torch.randn(16, 2)) for _ in range(10)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.ActivationStats(every=4, with_hist=True))
        >>> res.iterations, res.paths
        ((0, 4, 8), ('0', '2'))
        >>> means, stds, near_zero = res.layer_stats(0)
        >>> len(means), res.hist(-1).shape
        (3, torch.Size([40, 3]))
    """

    with_hist: bool = attrs.field(default=False, validator=_shared.check_bool("ActivationStats"))
    modules: Selector | None = attrs.field(default=None, converter=_shared.to_selector)
    every: int | None = attrs.field(default=None, validator=_shared.check_every("ActivationStats"))
    include_paramless: bool = attrs.field(default=False, validator=_shared.check_bool("ActivationStats"))
    near_zero: float = attrs.field(default=NEAR_ZERO, kw_only=True, validator=_check_near_zero)
    hist_bins: int = attrs.field(default=HIST_BINS, kw_only=True, validator=_check_hist_bins)
    hist_range: tuple[float, float] = attrs.field(default=HIST_RANGE, kw_only=True, converter=_as_pair,
                                                  validator=_check_hist_range)
    _snapshot: _exact.Snapshot = attrs.field(init=False, repr=False, eq=False)
    record_name: str = attrs.field(init=False, repr=False, eq=False)
    """The name its values are stored under in each Step's record."""
    _specs: tuple[Spec, ...] = attrs.field(init=False, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        low, high = self.hist_range
        snap = _exact.Snapshot(float(self.near_zero), self.with_hist, self.hist_bins, (float(low), float(high)))
        name = "activation_stats"
        if (snap.near_zero, snap.hist_bins, snap.hist_range) != (NEAR_ZERO, HIST_BINS, HIST_RANGE):
            name += f"(near_zero={snap.near_zero}, bins={snap.hist_bins}, range={snap.hist_range})"
        object.__setattr__(self, "_snapshot", snap)
        object.__setattr__(self, "record_name", name + ("+hist" if self.with_hist else ""))
        where = _shared.where(self.modules, self.include_paramless)  # made once: fit and the loops read it often
        object.__setattr__(self, "_specs", (observe(where, snap, name=self.record_name, detach=False),))

    @property
    def specs(self) -> tuple[Spec, ...]:
        """One observer spec on the selected modules."""
        return self._specs

    def records(self, iteration: int, training: bool) -> bool:
        """True for the train iterations these statistics record."""
        return _shared.records(self.every, iteration, training)

    def init(self) -> _State:
        """The empty state."""
        return ()

    def step(self, state: _State, step: Step) -> _State:
        """Add the step's statistics (computed on the device, not read) when it is recorded;
        the modules that did not run on it are absent from it, and a module called several
        times on it (micro-batches) has the statistics of all its calls together."""
        if not _shared.records(self.every, step.iteration, step.training):
            return state
        calls = step.record.calls_by_path(self.record_name)
        if not calls:
            return (state, _exact.keep(_exact.empty_entry(step.iteration, self._snapshot)))
        return (state, _exact.keep(_exact.reduce_calls(calls, self._snapshot, step.iteration)))

    def merge(self, a: _State, b: _State) -> _State:
        """Combine two states exactly: steps of disjoint chunks are put in iteration order;
        the same iteration in both (two ranks) is combined by module path as one larger batch."""
        by_iteration: dict[int, _exact.Entry] = {}
        for kept in _shared.unroll(a) + _shared.unroll(b):
            entry = _exact.live(kept)
            seen = by_iteration.get(entry.iteration)
            by_iteration[entry.iteration] = entry if seen is None else _exact.combine(seen, entry)
        return _shared.roll([_exact.keep(by_iteration[k]) for k in sorted(by_iteration)])

    def scalars(self, state: _State, *, since: int = 0) -> dict[str, float]:
        """``{"<layer>/mean", "<layer>/std", "<layer>/near_zero": value}`` of each module at the
        newest recorded step, when its iteration is `since` or later (else ``{}``): the numbers
        ``result().stats`` gives for that step (no histogram), read to the host in one copy."""
        last = _shared.newest(state, since)
        if not last:
            return {}
        res = ActivationStatsResult((last[1],), False)
        rows = {p: [s["mean"], s["std"], s["near_zero"]] for p, s in zip(res.paths, res.stats[0]) if s is not None}
        return _shared.layer_scalars(rows, ("mean", "std", "near_zero"))

    def result(self, state: _State) -> ActivationStatsResult:
        """The statistics of every recorded step.

        Raises:
            ReducerError: when steps were recorded and none of them holds this reducer's
                values (steps run without its specs, or no selected module ever ran).
        """
        entries = tuple(_shared.unroll(state))
        if entries and not any(e.paths for e in entries):
            raise ReducerError(
                f"ActivationStats: a recorded train step holds the records of the reducer's specs, got "
                f"{len(entries)} recorded steps and no {self.record_name!r} in any of their records. Run the steps "
                f"with `specs=reducer.specs` (fh.fit does), and select modules that run."
            )
        return ActivationStatsResult(entries, self.with_hist)


_ABSENT = (math.nan, math.nan, math.nan)


class _Hist(TypedDict, total=False):
    hist: Tensor


class _ModuleStats(_Hist):
    """One module's statistics on one step, as :attr:`ActivationStatsResult.stats` gives them:
    Python floats, and ``"hist"`` (a CPU tensor) with ``with_hist``."""

    mean: float
    std: float
    near_zero: float


@_frozen.frozen
@attrs.frozen(eq=False)
class ActivationStatsResult:
    """The result of :class:`ActivationStats`: per recorded step, per module path statistics.

    ``paths`` lists every module that ran on some recorded step, in module order (two
    modules that never ran on the same step, whose order no step shows, are put in path
    order, numbered parts by number: ``experts.2`` before ``experts.10``). A module
    that did not run on a step is absent there: ``stats[step]`` holds ``None`` at its
    position (so positions stay aligned with ``paths``), ``layer_stats`` gives NaN for that
    step, ``hist`` (and ``color_dim``) an empty column (zero counts), and the plots a gap.
    A module that ran on an empty batch (a zero-element output) has NaN ``mean``, ``std``
    and ``near_zero`` and zero histogram counts for that step.

    Everything stays on the device until read; reading ``stats``, ``layer_stats`` or
    ``hist`` copies to the host once.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 2)
        >>> batches = [(torch.ones(4, 2), torch.zeros(4, 2))]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.0)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.ActivationStats())
        >>> out = model(torch.ones(4, 2)).detach()
        >>> abs(res.stats[0][0]["mean"] - out.mean().item()) < 1e-6
        True
    """

    kept: tuple[_exact.Entry | _exact.Kept, ...]
    """Per recorded step, its entry as the state keeps it (on the CPU, numbers: see
    :func:`~funhooks.reducers._exact.keep`)."""
    with_hist: bool
    paths: tuple[str, ...] = attrs.field(init=False, default=attrs.Factory(
        lambda self: _shared.module_order(e.paths for e in self.kept), takes_self=True))
    """The module paths, in module order: every module that ran on some recorded step."""
    _live: list[tuple[_exact.Entry, ...]] = attrs.field(init=False, factory=list, repr=False)
    """:attr:`entries`, once read."""

    @property
    def entries(self) -> tuple[_exact.Entry, ...]:
        """Per recorded step, its entry with tensors (made from the kept numbers when first
        read: a result that is only passed on, or read through ``stats``, never makes them)."""
        if not self._live:
            self._live.append(tuple(_exact.live(e) for e in self.kept))
        return self._live[0]

    @property
    def iterations(self) -> tuple[int, ...]:
        """The train iterations recorded."""
        return tuple(e.iteration for e in self.kept)

    def __len__(self) -> int:
        return len(self.kept)

    def _host_rows(self) -> list[list[list[float]]]:
        if all(type(e) is _exact.Kept for e in self.kept):  # a CPU run: the numbers are on the host already
            return [cast(_exact.Kept, e).rows.values for e in self.kept]
        rows = [e.rows for e in self.entries]
        if rows and all(r.shape == rows[0].shape and r.dtype == rows[0].dtype for r in rows):
            return torch.stack(rows).tolist()  # one copy to the host for all steps
        return [r.tolist() for r in rows]

    def _positions(self, entry: _exact.Entry | _exact.Kept) -> list[int | None]:
        """For each of ``paths``, its index in ``entry.paths``, or None where it did not run."""
        if entry.paths == self.paths:
            return list(range(len(entry.paths)))
        here = {p: i for i, p in enumerate(entry.paths)}
        return [here.get(p) for p in self.paths]

    @property
    def stats(self) -> list[list[_ModuleStats | None]]:
        """Per recorded step, per module of ``paths``: ``{"mean", "std", "near_zero"}`` as
        Python floats (plus ``"hist"``, a CPU tensor, with ``with_hist``), fastai's
        ``stats``; ``None`` for a module that did not run on that step."""
        out = []
        hists = [cast(torch.Tensor, e.hist).cpu() for e in self.entries] if self.with_hist else None
        for s, (entry, rows) in enumerate(zip(self.kept, self._host_rows())):
            per_module: list[_ModuleStats | None] = []
            for i in self._positions(entry):
                if i is None:
                    per_module.append(None)
                    continue
                r = entry.order[i]
                mean, std, near = rows[r]
                n = entry.ns[i]
                item: _ModuleStats = {"mean": mean, "std": std, "near_zero": near / n if n else math.nan}
                if hists is not None:
                    item["hist"] = hists[s][r]
                per_module.append(item)
            out.append(per_module)
        return out

    def _index(self, idx: int | str, caller: str) -> int:
        paths = self.paths
        if isinstance(idx, str) and idx in paths:
            return paths.index(idx)
        if isinstance(idx, int) and not isinstance(idx, bool) and -len(paths) <= idx < len(paths):
            return idx % len(paths)
        raise ReducerError(
            f"{caller}: `idx` is a module index in range(-{len(paths)}, {len(paths)}) or a module path, got {idx!r}; "
            f"there are {len(paths)} modules: {list(paths)}. Pick one of those."
        )

    def layer_stats(self, idx: int | str) -> tuple[list[float], list[float], list[float]]:
        """``(means, stds, near_zero)`` of module `idx` (index into ``paths``, or a path) over
        the recorded steps; NaN for a step on which the module did not run.

        Raises:
            ReducerError: for an index out of range or an unknown path (says how many modules).
        """
        i = self._index(idx, "layer_stats")
        per_step = [step[i] for step in self.stats]
        cols = [_ABSENT if s is None else (s["mean"], s["std"], s["near_zero"]) for s in per_step]
        return ([c[0] for c in cols], [c[1] for c in cols], [c[2] for c in cols])

    def hist(self, idx: int | str) -> Tensor:
        """fastai's histogram image of module `idx`: ``log1p`` of the counts, ``(bins, steps)``,
        on the CPU; a column of zeros for a step on which the module did not run.

        Raises:
            ReducerError: for an index out of range, or a result folded without ``with_hist``.
        """
        if not self.with_hist:
            raise ReducerError(
                "hist: histograms are kept by `ActivationStats(with_hist=True)`, got a result folded with "
                "with_hist=False. Fold ActivationStats(with_hist=True)."
            )
        path = self.paths[self._index(idx, "hist")]
        cols = [cast(torch.Tensor, e.hist)[e.order[e.paths.index(path)]] if path in e.paths else None for e in self.entries]
        present = next(c for c in cols if c is not None)
        empty = torch.zeros_like(present)
        return torch.stack([empty if c is None else c.to(present.device) for c in cols]).t().float().log1p().cpu()  # one copy to the host

    def color_dim(self, idx: int | str, ax: Axes | None = None, *, figsize: tuple[float, float] = (10, 5)) -> Axes:
        """Draw the "colorful dimension" image of module `idx` (needs the ``plot`` extra).

        Returns:
            The matplotlib Axes drawn on (`ax`, or a new figure's).
        """
        from . import plot

        return plot.color_dim(self, idx, ax=ax, figsize=figsize)

    def plot_layer_stats(self, idx: int | str, *, figsize: tuple[float, float] = (12, 3)) -> Figure:
        """Plot mean, std and near-zero share of module `idx` over steps (needs the ``plot`` extra).

        Returns:
            A matplotlib Figure with three Axes (``fig.savefig("stats.png")`` writes it).
        """
        from . import plot

        return plot.plot_layer_stats(self, idx, figsize=figsize)

    def __repr__(self) -> str:
        return (f"ActivationStatsResult({len(self.kept)} steps, paths={_html.short(list(self.paths))}, "
                f"with_hist={self.with_hist})")

    def _repr_html_(self) -> str:
        """A notebook's view: per module, the steps it ran on and its mean, std and % near zero
        at the last recorded step (only that step's numbers are read for the table), then the
        mean, std and % near zero of every module over the steps (the ``plot`` extra)."""
        shown: dict[str, _ModuleStats | None] = {}
        if self.kept:
            shown = dict(zip(self.kept[-1].paths, ActivationStatsResult(self.kept[-1:], False).stats[0]))
        counts = _display.steps_per_path(e.paths for e in self.kept)
        it = self.iterations[-1] if self.kept else -1
        rows: list[list[_html.Cell | str]] = []
        for p in self.paths:
            s = shown.get(p)
            values = (None, None, None) if s is None else (s["mean"], s["std"], s["near_zero"])
            rows.append([p, str(counts[p]), *(_display.value(v, it, scale=scale)
                                               for v, scale in zip(values, (1.0, 1.0, 100.0)))])
        from . import plot

        caption = _display.caption("ActivationStats", self.iterations, len(self.paths), "module")
        return _display.html("ActivationStats", ("module", "steps", "mean", "std", "% near zero"), rows,
                             caption=caption, draw=(lambda: plot.plot_activation_stats(self)) if self.kept else None)

