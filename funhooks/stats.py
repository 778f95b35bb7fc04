"""HookCallback and ActivationStats: fastai's hook callbacks as pure fold reducers.

Both are frozen values (see :mod:`funhooks.fold` for the protocol): their specs say what
runs in the forward (or backward) pass, ``step`` adds one recorded train step to an
immutable state, ``result`` turns the state into fastai's results. ``every=k`` records the
train iterations with ``iteration % k == 0`` (``ceil(n / k)`` of ``n``); evaluation steps
are never recorded, and under :func:`funhooks.fit` the other iterations run with the hooks
paused, so they cost nothing but the loop.

ActivationStats keeps its statistics on the activation's device until a result is read:
nothing calls ``.item()`` per batch, so a GPU never syncs. Its statistics are fastai's, to
the bit: ``mean`` and ``std`` (unbiased) equal ``o.float().mean().item()`` and
``o.float().std().item()`` of the same output exactly (fastai's own test compares them with
``==``), ``near_zero`` is the fraction of values ``<= NEAR_ZERO`` and, with ``with_hist``,
``hist`` is ``histc(HIST_BINS, *HIST_RANGE)``. They are keyed by module path: a module that
did not run on a step is absent from it.

Cost: a contiguous CPU activation of at most ``REDUCE_IN_HOOK_NUMEL`` elements is copied in
the hook (one copy per module, alive until the end of its step; the copy keeps the numbers
right when a later in-place op such as ``ReLU(inplace=True)`` changes the output) and the
copies of a step are reduced together, a handful of kernels per step instead of three per
module, in the very order of PyTorch's own reductions (see :func:`_row_stats`). Larger,
non-contiguous and non-CPU activations are reduced in the hook by ``mean()`` and ``std()``
themselves (on a GPU, a few asynchronous kernels per module), and no copy is kept. The
state holds per step one ``(modules, 3)`` tensor of ``(mean, std, near-zero count)`` (and
``(modules, hist_bins)`` with histograms) and the paths of the modules that ran.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import attrs
import torch
from torch import nn

from .errors import ReducerError
from .loop import Step
from .record import Record
from .selector import Selector, Where, select
from .spec import Spec, observe

__all__ = [
    "HIST_BINS",
    "HIST_RANGE",
    "NEAR_ZERO",
    "REDUCE_IN_HOOK_NUMEL",
    "ActivationStats",
    "ActivationStatsResult",
    "HookCallback",
]

NEAR_ZERO = 0.05
"""fastai's near-zero threshold: an activation value counts as near zero when ``<=`` this."""

HIST_BINS = 40
"""fastai's histogram: this many bins ..."""

HIST_RANGE = (0.0, 10.0)
"""... over this range; values outside it are not counted (fastai's ``histc(40, 0, 10)``,
which ignores every negative activation)."""

REDUCE_IN_HOOK_NUMEL = (1 << 15) - 1
"""Contiguous CPU activations of at most this many elements are copied in the hook and
reduced with the step's others; the rest are reduced in the hook by ``x.mean()`` and
``x.std()`` themselves. PyTorch reduces a tensor this small on one thread whatever
``torch.get_num_threads()`` says (its grain size is ``1 << 15``), in the order the batched
reduction reproduces, so both ways give torch's own numbers to the bit."""

Tensor = torch.Tensor


# -- shared parts ---------------------------------------------------------------------------


@attrs.frozen
class LeafModules:
    """The default module selector of the hook callbacks: leaf modules with parameters
    (fastai's choice), or every leaf module with ``include_paramless=True``.

    Example:
        >>> from torch import nn
        >>> import funhooks as fh
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 1)))
        >>> [p for p, _ in fh.select(fh.stats.LeafModules()).resolve(model)]
        ['0', '2.0']
    """

    include_paramless: bool = False

    def __call__(self, path: str, module: nn.Module) -> bool:
        if next(module.children(), None) is not None:
            return False
        return self.include_paramless or next(module.parameters(), None) is not None


def _where(modules: Where | None, include_paramless: bool) -> Selector:
    return select(LeafModules(include_paramless) if modules is None else modules)


def _to_selector(modules: Where | None) -> Selector | None:
    return None if modules is None else select(modules)


def _check_every(caller: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, every: Any) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every <= 0):
            raise ReducerError(
                f"{caller}: `every` is a positive int or None, got {every!r}. "
                "Pass every=1 (or None) to record every train step, every=k for one in k."
            )

    return check


def _check_bool(caller: str) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, bool):
            raise ReducerError(f"{caller}: `{attribute.name}` is a bool, got {value!r}. Pass True or False.")

    return check


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _check_hook(instance: Any, attribute: Any, hook: Any) -> None:
    if not callable(hook):
        raise ReducerError(
            f"HookCallback: `hook` is a callable `hook(module, input, output)`, got {hook!r}. Pass a function."
        )


def _check_name(instance: Any, attribute: Any, name: Any) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ReducerError(
            f"HookCallback: `name` is a non-empty str or None, got {name!r}. "
            "Pass the record name, or None for the hook's __name__."
        )


def _check_near_zero(instance: Any, attribute: Any, near_zero: Any) -> None:
    if not _is_number(near_zero):
        raise ReducerError(
            f"ActivationStats: `near_zero` is a number (values `<= near_zero` count as near zero), got "
            f"{near_zero!r}. Pass e.g. near_zero={NEAR_ZERO} (fastai's)."
        )


def _check_hist_bins(instance: Any, attribute: Any, bins: Any) -> None:
    if isinstance(bins, bool) or not isinstance(bins, int) or bins <= 0:
        raise ReducerError(
            f"ActivationStats: `hist_bins` is a positive int, got {bins!r}. "
            f"Pass the number of histogram bins, e.g. hist_bins={HIST_BINS} (fastai's)."
        )


def _as_pair(value: Any) -> Any:
    """A list range becomes a tuple; anything else is left for the validator to judge."""
    return tuple(value) if isinstance(value, (tuple, list)) else value


def _check_hist_range(instance: Any, attribute: Any, bounds: Any) -> None:
    if not (isinstance(bounds, tuple) and len(bounds) == 2 and all(_is_number(b) and math.isfinite(b) for b in bounds)
            and bounds[0] < bounds[1]):
        low, high = (int(b) if float(b).is_integer() else b for b in HIST_RANGE)
        raise ReducerError(
            f"ActivationStats: `hist_range` is a pair (low, high) of finite numbers with low < high, got {bounds!r}. "
            f"Pass e.g. hist_range={(low, high)!r} (fastai's)."
        )


def _records(every: int | None, iteration: int, training: bool) -> bool:
    return training and (every is None or iteration % every == 0)


def _last_calls(record: Record, name: str, caller: str) -> list[tuple[str, Any]]:
    """``(path, value of the last call)`` for every module that stored `name`, in module order."""
    data = record._data  # the Record's own dict (package-internal, read only): no node objects per step
    out = [(path, names[name][-1]) for path, names in data.items() if name in names]
    if not out:
        raise ReducerError(
            f"{caller}: a recorded train step holds the records of the reducer's specs, got a Step whose record "
            f"has paths {list(record)} and no {name!r}. Run the steps with `specs=reducer.specs`, or use fh.fit."
        )
    return out


# States are cons lists: () or (rest, entry); adding a step is O(1) and copies nothing.


def unroll(state: tuple) -> list[Any]:
    out = []
    while state:
        state, entry = state
        out.append(entry)
    out.reverse()
    return out


def roll(entries: Sequence[Any]) -> tuple:
    state: tuple = ()
    for entry in entries:
        state = (state, entry)
    return state


# -- HookCallback -----------------------------------------------------------------------------


@attrs.frozen
class HookCallback:
    """fastai's ``HookCallback`` as a reducer: ``hook(m, i, o)`` per module, per recorded step.

    Args:
        hook: ``hook(module, input, output)`` (for ``is_forward=False``:
            ``hook(module, grad_input, grad_output)``); its return value is kept.
        modules: a selector; None: leaf modules with parameters.
        every: record train iterations with ``iteration % every == 0``; None: all.
        is_forward: a forward hook (True) or a backward hook (False).
        detach: detach the hook's arguments first.
        cpu: move the hook's arguments to the CPU first (fastai's default).
        include_paramless: with ``modules=None``, also hook leaves without parameters.
        name: the record name (default ``hook.__name__``); give two callbacks whose hooks
            share a name different ones.

    Result: a tuple, one entry per recorded train step, each a list of ``hook`` values in
    module order (fastai's ``hooks.stored``; a module called twice gives its last call).

    Raises:
        ReducerError: at construction, for a `hook` that is not callable, ``every <= 0``, a
            flag that is not a bool or an empty `name`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> batches = [(torch.randn(8, 3), torch.randn(8, 1)) for _ in range(5)]
        >>> def shape(m, i, o):
        ...     return tuple(o.shape)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> fh.fit(model, batches, nn.functional.mse_loss, opt, fh.HookCallback(shape, every=2))
        ([(8, 4), (8, 1)], [(8, 4), (8, 1)], [(8, 4), (8, 1)])
    """

    hook: Callable[..., Any] = attrs.field(validator=_check_hook)
    modules: Selector | None = attrs.field(default=None, converter=_to_selector)
    every: int | None = attrs.field(default=None, validator=_check_every("HookCallback"))
    is_forward: bool = attrs.field(default=True, validator=_check_bool("HookCallback"))
    detach: bool = attrs.field(default=True, validator=_check_bool("HookCallback"))
    cpu: bool = attrs.field(default=True, validator=_check_bool("HookCallback"))
    include_paramless: bool = attrs.field(default=False, validator=_check_bool("HookCallback"))
    name: str | None = attrs.field(default=None, kw_only=True, validator=_check_name)

    @property
    def record_name(self) -> str:
        """The name its values are stored under in each Step's record."""
        return self.name or getattr(self.hook, "__name__", type(self.hook).__name__)

    @property
    def specs(self) -> tuple[Spec, ...]:
        """One observer spec on the selected modules."""
        event = "forward" if self.is_forward else "backward"
        where = _where(self.modules, self.include_paramless)
        return (observe(where, self.hook, event=event, name=self.record_name, detach=self.detach, cpu=self.cpu),)

    def records(self, iteration: int, training: bool) -> bool:
        """True for the train iterations this callback records."""
        return _records(self.every, iteration, training)

    def init(self) -> tuple:
        """The empty state."""
        return ()

    def step(self, state: tuple, step: Step) -> tuple:
        """Add the step's hook values when the step is recorded."""
        if not _records(self.every, step.iteration, step.training):
            return state
        values = [value for _, value in _last_calls(step.record, self.record_name, "HookCallback")]
        return (state, (step.iteration, values))

    def merge(self, a: tuple, b: tuple) -> tuple:
        """The state of two disjoint chunks of steps, in iteration order."""
        return roll(sorted(unroll(a) + unroll(b), key=lambda entry: entry[0]))

    def result(self, state: tuple) -> tuple[list[Any], ...]:
        """One list of hook values per recorded step."""
        return tuple(values for _, values in unroll(state))


# -- ActivationStats --------------------------------------------------------------------------


@attrs.frozen
class _Snapshot:
    """The hook of ActivationStats: a copy of a small output, or the reduced large one."""

    near_zero: float
    with_hist: bool
    hist_bins: int
    hist_range: tuple[float, float]

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if not isinstance(output, Tensor):
            kind = type(module).__name__
            raise ReducerError(
                f"ActivationStats: statistics need a tensor output, got {type(output).__name__} from a {kind} module. "
                f"Select modules with tensor outputs with `modules=`, e.g. "
                f"`modules=fh.select(fh.stats.LeafModules()) & ~fh.select({kind})`."
            )
        o = output.detach()
        n = o.numel()
        if n == 0:  # an empty batch: NaN statistics, no counts (no kernel reads it)
            hist = o.new_zeros(self.hist_bins, dtype=torch.float32) if self.with_hist else None
            return (0, o.new_full((3,), math.nan, dtype=torch.float64), hist)
        if n <= REDUCE_IN_HOOK_NUMEL and o.is_cpu and o.is_contiguous():
            return o.clone()
        return self.reduce(o)

    def reduce(self, o: Tensor) -> tuple[int, Tensor, Tensor | None]:
        """``(n, (mean, std, near-zero count), histogram)`` of `o`, by fastai's very calls."""
        x = o.float()
        n = x.numel()
        mean = x.mean()
        std = x.std() if n > 1 else torch.full_like(mean, math.nan)  # torch warns on one value
        row = torch.stack((mean.double(), std.double(), torch.le(x, self.near_zero).sum().double()))
        return (n, row, x.histc(self.hist_bins, *self.hist_range) if self.with_hist else None)


_SUM_ORDER_SLACK = 2.0**-35
"""Two sums in double of the same ``n < 2**15`` non-negative terms, added in different
orders, differ by at most ``2 (n - 1) 2**-53 < 2**-37`` of the sum, and two stds from them
by less than ``2**-37`` of the std: with 4x margin, an std whose ``1 -/+ 2**-35`` neighbours
round to one float32 is that float32 whichever order the sum took."""


def _round_std(d: Tensor) -> Tensor:
    """``row.std()`` of each row of float32 values whose deviations from the float32 mean,
    in double, are the rows of `d`: torch's float32 answer, bit for bit.

    torch adds the squares one after the other, in double, then rounds ``sqrt(sum / (n - 1))``
    to float32. A vectorised sum adds them in another order and may differ in the last bits
    of the double; rounded to float32 it is the same except within :data:`_SUM_ORDER_SLACK`
    of a rounding boundary, where (a row in a thousand or so) the sum is redone in torch's
    order with a running sum (``cumsum``, sequential like torch's loop).
    """
    n = d.shape[1]
    approx = torch.linalg.vector_norm(d, dim=1).div_(math.sqrt(n - 1))
    low = approx.mul(1 - _SUM_ORDER_SLACK).float()
    std = approx.mul_(1 + _SUM_ORDER_SLACK).float()
    unsure = low.ne(std)  # NaN too
    if unsure.any():  # a CPU tensor: reading it is no device sync
        rows = unsure.nonzero().squeeze(1)
        exact = d.index_select(0, rows).square_().cumsum_(1)[:, -1].div_(n - 1).sqrt_().float()
        std.index_copy_(0, rows, exact)
    return std


def _row_stats(x: Tensor, near_zero: float) -> Tensor:
    """``(mean, std, near-zero count)`` of every row of the float32 CPU matrix `x`, bit for
    bit those of ``row.mean()``, ``row.std()`` and ``(row <= near_zero).sum()``.

    ``x.mean(1)`` sums each row as ``row.sum()`` does (verified over many sizes; ``x.std(1)``
    is Welford's and differs in the last bit now and then, see :func:`_round_std`). The
    comparison writes floats so that it runs as a vectorised kernel (bool outputs do not);
    float sums of 0/1 are exact below ``2**24``.
    """
    n = x.shape[1]
    mean = x.mean(1)
    if n > 1:
        std = _round_std(x.double().sub_(mean.double().unsqueeze(1)))
    else:
        std = torch.full_like(mean, math.nan)
    near = torch.le(x, near_zero, out=torch.empty_like(x)).sum(1)
    return torch.stack((mean, std, near), 1)


def _batched_hist(x: Tensor, bins: int, lo: float, hi: float) -> Tensor:
    """``torch.histc(row, bins, lo, hi)`` for every row of `x` at once: histc's own float32
    arithmetic, ``(value - lo) * bins / (hi - lo)`` truncated, ``hi`` in the last bin."""
    lo32, hi32 = torch.tensor((lo, hi), dtype=torch.float32)
    width = float(hi32 - lo32)  # histc's width: a float32 difference of float32 bounds
    inside = (x >= lo) & (x <= hi)
    pos = (x - float(lo32)).mul_(bins).div_(width).long().clamp_(0, bins - 1)
    return torch.zeros(x.shape[0], bins, dtype=x.dtype, device=x.device).scatter_add_(1, pos, inside.to(x.dtype))


class _Entry(NamedTuple):
    """One recorded step: the paths of the modules that ran (module order), their output
    sizes, and per-row statistics.

    ``rows[order[i]]`` is ``(mean, std, near-zero count)`` of module ``paths[i]``, and
    ``hist[order[i]]`` its histogram. A module that did not run on the step is not here.
    """

    iteration: int
    paths: tuple[str, ...]
    ns: tuple[int, ...]
    order: tuple[int, ...]
    rows: Tensor
    hist: Tensor | None


def _reduce_step(values: list[Any], snap: _Snapshot) -> tuple[tuple[int, ...], tuple[int, ...], Tensor, Tensor | None]:
    """``(order, ns, rows, histograms)`` of one step's hook values (module order): copies of
    one shape and dtype are stacked and reduced together; ``order[i]`` is value i's row."""
    groups: dict[Any, list[int]] = {}
    for i, v in enumerate(values):
        key = None if type(v) is tuple else (v.shape, v.dtype)  # None: reduced in the hook
        members = groups.get(key)
        if members is None:
            groups[key] = [i]
        else:
            members.append(i)
    pieces, hists, order, ns = [], [], [0] * len(values), [0] * len(values)
    row = 0
    for key, members in groups.items():
        if key is None:
            pieces += [values[i][1][None] for i in members]
            hists += [values[i][2][None] for i in members] if snap.with_hist else []
            for i in members:
                ns[i] = values[i][0]
        else:
            x = torch.stack(values if len(members) == len(values) else [values[i] for i in members]).flatten(1)
            if x.dtype != torch.float32:
                x = x.float()
            pieces.append(_row_stats(x, snap.near_zero))
            if snap.with_hist:
                hists.append(_batched_hist(x, snap.hist_bins, *snap.hist_range))
            for i in members:
                ns[i] = x.shape[1]
        for i in members:
            order[i] = row
            row += 1
    rows = pieces[0] if len(pieces) == 1 else torch.cat(pieces)  # float64 where a big one is (exact counts)
    hist = None if not snap.with_hist else hists[0] if len(hists) == 1 else torch.cat(hists)
    return tuple(order), tuple(ns), rows, hist


def _empty_entry(iteration: int, snap: _Snapshot) -> _Entry:
    """A recorded step on which no selected module ran."""
    hist = torch.zeros(0, snap.hist_bins) if snap.with_hist else None
    return _Entry(iteration, (), (), (), torch.zeros(0, 3, dtype=torch.float64), hist)


def _path_key(path: str) -> tuple:
    """A stand-in for module order between two paths no step orders: numbered parts by number."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in path.split("."))


def _module_order(orders: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    """Every path of `orders` once, in module order.

    Each of `orders` lists some paths in module order (the modules that ran on one step), so
    together they say which of two paths comes first wherever a step ran both; paths no step
    orders (never run together) are put by :func:`_path_key`. The answer depends on the set
    of orders only, not on their sequence, so merging states in any order gives the same.
    """
    distinct = set(orders)
    if len(distinct) == 1:  # the same modules ran on every step
        return next(iter(distinct))
    later: dict[str, set[str]] = {}
    for seq in distinct:
        for p in seq:
            later.setdefault(p, set())
        for a, b in itertools.pairwise(seq):
            later[a].add(b)
    waiting = dict.fromkeys(later, 0)
    for nexts in later.values():
        for b in nexts:
            waiting[b] += 1
    ready = [(_path_key(p), p) for p, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        _, p = heapq.heappop(ready)
        out.append(p)
        for b in later[p]:
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, (_path_key(b), b))
    if len(out) < len(later):  # contradicting orders (states of different models): the rest by name
        out += sorted(set(later) - set(out), key=_path_key)
    return tuple(out)


def _in_module_order(entry: _Entry) -> _Entry:
    if entry.order == tuple(range(len(entry.order))):
        return entry
    index = torch.tensor(entry.order, device=entry.rows.device)
    hist = None if entry.hist is None else entry.hist.index_select(0, index)
    return entry._replace(order=tuple(range(len(entry.order))), rows=entry.rows.index_select(0, index), hist=hist)


def _spread(entry: _Entry, paths: tuple[str, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
    """`entry`'s sizes, rows and histograms (module order) placed at the positions of `paths`;
    zeros where its module did not run."""
    where = torch.tensor([paths.index(p) for p in entry.paths], dtype=torch.long, device=device)
    ns = torch.zeros(len(paths), dtype=torch.float64, device=device)
    ns.index_copy_(0, where, torch.tensor(entry.ns, dtype=torch.float64, device=device))
    rows = torch.zeros(len(paths), 3, dtype=torch.float64, device=device)
    rows.index_copy_(0, where, entry.rows.to(device, torch.float64))
    if entry.hist is None:
        return ns, rows, None
    hist = torch.zeros(len(paths), entry.hist.shape[1], dtype=entry.hist.dtype, device=device)
    return ns, rows, hist.index_copy_(0, where, entry.hist.to(device))


def _combine(a: _Entry, b: _Entry) -> _Entry:
    """One step seen in two parts (two ranks), by module path: a module that ran in one part
    keeps that part's statistics; one that ran in both gets those of the joint batch (Chan's
    exact merge of means and squared deviations, written symmetrically: combining a with b
    gives the very floats of combining b with a)."""
    a, b = _in_module_order(a), _in_module_order(b)
    paths = _module_order([a.paths, b.paths])
    device = a.rows.device
    na, ra, ha = _spread(a, paths, device)
    nb, rb, hb = _spread(b, paths, device)
    n = na + nb
    m2a = torch.where(na > 1, ra[:, 1].square() * (na - 1), 0.0)
    m2b = torch.where(nb > 1, rb[:, 1].square() * (nb - 1), 0.0)
    mean = (na * ra[:, 0] + nb * rb[:, 0]) / n
    delta = rb[:, 0] - ra[:, 0]
    m2 = m2a + m2b + delta * delta * (na * nb / n)
    std = torch.where(n > 1, (m2 / (n - 1)).sqrt(), math.nan)
    both = torch.stack((mean, std, ra[:, 2] + rb[:, 2]), 1)
    rows = torch.where((na == 0)[:, None], rb, torch.where((nb == 0)[:, None], ra, both))
    hist = None if ha is None else ha + hb
    ns = tuple(sum(e.ns[e.paths.index(p)] for e in (a, b) if p in e.paths) for p in paths)
    return _Entry(a.iteration, paths, ns, tuple(range(len(paths))), rows, hist)


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

    with_hist: bool = attrs.field(default=False, validator=_check_bool("ActivationStats"))
    modules: Selector | None = attrs.field(default=None, converter=_to_selector)
    every: int | None = attrs.field(default=None, validator=_check_every("ActivationStats"))
    include_paramless: bool = attrs.field(default=False, validator=_check_bool("ActivationStats"))
    near_zero: float = attrs.field(default=NEAR_ZERO, kw_only=True, validator=_check_near_zero)
    hist_bins: int = attrs.field(default=HIST_BINS, kw_only=True, validator=_check_hist_bins)
    hist_range: tuple[float, float] = attrs.field(default=HIST_RANGE, kw_only=True, converter=_as_pair,
                                                  validator=_check_hist_range)
    _snapshot: _Snapshot = attrs.field(init=False, repr=False, eq=False)
    record_name: str = attrs.field(init=False, repr=False, eq=False)
    """The name its values are stored under in each Step's record."""

    def __attrs_post_init__(self) -> None:
        snap = _Snapshot(float(self.near_zero), self.with_hist, self.hist_bins, tuple(map(float, self.hist_range)))
        name = "activation_stats"
        if (snap.near_zero, snap.hist_bins, snap.hist_range) != (NEAR_ZERO, HIST_BINS, HIST_RANGE):
            name += f"(near_zero={snap.near_zero}, bins={snap.hist_bins}, range={snap.hist_range})"
        object.__setattr__(self, "_snapshot", snap)
        object.__setattr__(self, "record_name", name + ("+hist" if self.with_hist else ""))

    @property
    def specs(self) -> tuple[Spec, ...]:
        """One observer spec on the selected modules."""
        where = _where(self.modules, self.include_paramless)
        return (observe(where, self._snapshot, name=self.record_name, detach=False),)

    def records(self, iteration: int, training: bool) -> bool:
        """True for the train iterations these statistics record."""
        return _records(self.every, iteration, training)

    def init(self) -> tuple:
        """The empty state."""
        return ()

    def step(self, state: tuple, step: Step) -> tuple:
        """Add the step's statistics (computed on the device, not read) when it is recorded;
        the modules that did not run on it are absent from it."""
        if not _records(self.every, step.iteration, step.training):
            return state
        data = step.record._data  # the Record's own dict (package-internal, read only): no node objects per step
        name = self.record_name
        paths, values = [], []
        for path, names in data.items():
            calls = names.get(name)
            if calls:
                paths.append(path)
                values.append(calls[-1])  # a module called twice: its last call, as fastai's
        if not values:
            return (state, _empty_entry(step.iteration, self._snapshot))
        order, ns, rows, hist = _reduce_step(values, self._snapshot)
        return (state, _Entry(step.iteration, tuple(paths), ns, order, rows, hist))

    def merge(self, a: tuple, b: tuple) -> tuple:
        """Combine two states exactly: steps of disjoint chunks are put in iteration order;
        the same iteration in both (two ranks) is combined by module path as one larger batch."""
        by_iteration: dict[int, _Entry] = {}
        for entry in unroll(a) + unroll(b):
            seen = by_iteration.get(entry.iteration)
            by_iteration[entry.iteration] = entry if seen is None else _combine(seen, entry)
        return roll([by_iteration[k] for k in sorted(by_iteration)])

    def result(self, state: tuple) -> ActivationStatsResult:
        """The statistics of every recorded step.

        Raises:
            ReducerError: when steps were recorded and none of them holds this reducer's
                values (steps run without its specs, or no selected module ever ran).
        """
        entries = tuple(unroll(state))
        if entries and not any(e.paths for e in entries):
            raise ReducerError(
                f"ActivationStats: a recorded train step holds the records of the reducer's specs, got "
                f"{len(entries)} recorded steps and no {self.record_name!r} in any of their records. Run the steps "
                f"with `specs=reducer.specs` (fh.fit does), and select modules that run."
            )
        return ActivationStatsResult(entries, self.with_hist)


_ABSENT = (math.nan, math.nan, math.nan)


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

    entries: tuple[_Entry, ...]
    with_hist: bool
    paths: tuple[str, ...] = attrs.field(init=False)
    """The module paths, in module order: every module that ran on some recorded step."""

    @paths.default
    def _all_paths(self) -> tuple[str, ...]:
        return _module_order(e.paths for e in self.entries)

    @property
    def iterations(self) -> tuple[int, ...]:
        """The train iterations recorded."""
        return tuple(e.iteration for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def _host_rows(self) -> list[list[list[float]]]:
        rows = [e.rows for e in self.entries]
        if rows and all(r.shape == rows[0].shape and r.dtype == rows[0].dtype for r in rows):
            return torch.stack(rows).tolist()  # one copy to the host for all steps
        return [r.tolist() for r in rows]

    def _positions(self, entry: _Entry) -> list[int | None]:
        """For each of ``paths``, its index in ``entry.paths``, or None where it did not run."""
        if entry.paths == self.paths:
            return list(range(len(entry.paths)))
        here = {p: i for i, p in enumerate(entry.paths)}
        return [here.get(p) for p in self.paths]

    @property
    def stats(self) -> list[list[dict[str, Any] | None]]:
        """Per recorded step, per module of ``paths``: ``{"mean", "std", "near_zero"}`` as
        Python floats (plus ``"hist"``, a CPU tensor, with ``with_hist``), fastai's
        ``stats``; ``None`` for a module that did not run on that step."""
        out = []
        hists = [e.hist.cpu() for e in self.entries] if self.with_hist else None
        for s, (entry, rows) in enumerate(zip(self.entries, self._host_rows())):
            per_module: list[dict[str, Any] | None] = []
            for i in self._positions(entry):
                if i is None:
                    per_module.append(None)
                    continue
                r = entry.order[i]
                mean, std, near = rows[r]
                n = entry.ns[i]
                item = {"mean": mean, "std": std, "near_zero": near / n if n else math.nan}
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
        cols = [e.hist[e.order[e.paths.index(path)]] if path in e.paths else None for e in self.entries]
        present = next(c for c in cols if c is not None)
        empty = torch.zeros_like(present)
        cols = [empty if c is None else c.to(present.device) for c in cols]
        return torch.stack(cols).t().float().log1p().cpu()  # one copy to the host

    def color_dim(self, idx: int | str, ax: Any = None, *, figsize: tuple[float, float] = (10, 5)) -> Any:
        """Draw the "colorful dimension" image of module `idx` (needs the ``plot`` extra).

        Returns:
            The matplotlib Axes drawn on (`ax`, or a new figure's).
        """
        from . import plot

        return plot.color_dim(self, idx, ax=ax, figsize=figsize)

    def plot_layer_stats(self, idx: int | str, *, figsize: tuple[float, float] = (12, 3)) -> Any:
        """Plot mean, std and near-zero share of module `idx` over steps (needs the ``plot`` extra).

        Returns:
            A matplotlib Figure with three Axes (``fig.savefig("stats.png")`` writes it).
        """
        from . import plot

        return plot.plot_layer_stats(self, idx, figsize=figsize)

    def __repr__(self) -> str:
        return f"ActivationStatsResult({len(self.entries)} steps, paths={list(self.paths)}, with_hist={self.with_hist})"
