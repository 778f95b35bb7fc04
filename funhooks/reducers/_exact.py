"""ActivationStats' exact reductions: fastai's statistics of many activations at once, to the bit.

fastai's hook computes ``o.float().mean()``, ``o.float().std()``, ``(o <= near_zero).sum()``
and ``o.histc(bins, low, high)`` of each output, a handful of kernels per module and three
host syncs. Here a step's small activations are stacked and reduced together, with results
equal to those per-tensor calls bit for bit: ``x.mean(1)`` sums each row as ``row.mean()``
does, the std is summed in double like torch's and redone in torch's order for the rare row
near a float32 rounding boundary (:func:`_round_std`), the near-zero count is an exact float
sum of 0/1 and the histogram repeats histc's own float32 arithmetic.

Two steps of one iteration (two ranks' halves of a batch) combine exactly by module path
(:func:`combine`: Chan's formula for means and variances, sums of counts and histograms).

The hook keeps an activation without a copy where the recording it runs in learned that no
later op changes its module's output in place (:class:`~funhooks.training.recorder.Learned`,
read through ``learned()``, noted there and checked when the step's Record is taken).

Cost: per kept activation, a ``ContextVar`` read and a few attribute reads in the hook (a
copy on the module's first step of a recording, and on every step where a later op changes
it in place) and a version read at the end of the step; per step, one stack per (shape,
dtype) and about a dozen kernels over it (sums in double: 12 bytes moved per element, three
passes); a large, non-contiguous or non-CPU activation costs three reductions in its hook.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, TypeAlias

import attrs
import torch
from torch import nn

from funhooks import _frozen
from funhooks.errors import ReducerError
from funhooks.training.recorder import Learned, learned

from . import _shared

__all__ = ["REDUCE_IN_HOOK_NUMEL", "Entry", "Snapshot", "combine", "empty_entry", "reduce_calls", "Kept", "keep",
           "live"]

REDUCE_IN_HOOK_NUMEL = (1 << 15) - 1
"""Contiguous CPU activations of at most this many elements are kept by the hook and
reduced with the step's others; the rest are reduced in the hook by ``x.mean()`` and
``x.std()`` themselves. PyTorch reduces a tensor this small on one thread whatever
``torch.get_num_threads()`` says (its grain size is ``1 << 15``), in the order the batched
reduction reproduces, so both ways give torch's own numbers to the bit."""

Tensor = torch.Tensor

_Reduced: TypeAlias = tuple[int, Tensor, Tensor | None]
"""An activation reduced in its hook: ``(n, (mean, std, near-zero count), histogram)``."""

_is_compiling = torch.compiler.is_compiling
"""True while dynamo traces the calling code (read on every call of the hook)."""


@_frozen.frozen
@attrs.frozen
class Snapshot:
    """The hook of ActivationStats: a small output kept for the step's batched reduction
    (without a copy where earlier steps showed nothing changes it later), or the large one
    reduced on the spot."""

    near_zero: float
    with_hist: bool
    hist_bins: int
    hist_range: tuple[float, float]

    def __call__(self, module: nn.Module, args: tuple[object, ...], output: object) -> Tensor | _Reduced:
        known = None
        if type(output) is Tensor and not _is_compiling():
            known = learned()  # what the recording learned of the model; None outside one
            if known is not None:
                if not known.checked:  # the first output of a step: the structure compared once
                    known.check()
                if known.changed.get(module) is False:
                    # the common case: the output of a module whose output nothing changed on
                    # earlier steps of this recording, small, on the CPU, contiguous and owning
                    # its storage, is kept as ``output.data``, an alias with a version counter of
                    # its own (the run's in-place check must not fire on it); the recording notes
                    # the output's own counter and compares it when it takes the step's Record
                    n = output.numel()
                    if (0 < n <= REDUCE_IN_HOOK_NUMEL and output.is_cpu and output.is_contiguous()
                            and output.untyped_storage().nbytes() == n * output.element_size()):
                        try:
                            known.kept.append((output, output._version, module, False))
                        except RuntimeError:  # an inference tensor has no counter
                            return output.clone()
                        return output.data
        if not isinstance(output, Tensor):
            kind = type(module).__name__
            raise ReducerError(
                f"ActivationStats: statistics need a tensor output, got {type(output).__name__} from a {kind} module. "
                f"Select modules with tensor outputs with `modules=`, e.g. "
                f"`modules=fh.select(fh.reducers.LeafModules()) & ~fh.select({kind})`."
            )
        n = output.numel()
        if n == 0:  # an empty batch: NaN statistics, no counts (no kernel reads it)
            hist = output.new_zeros(self.hist_bins, dtype=torch.float32) if self.with_hist else None
            return (0, output.new_full((3,), math.nan, dtype=torch.float64), hist)
        if n <= REDUCE_IN_HOOK_NUMEL and output.is_cpu and output.is_contiguous():
            if _is_compiling():  # a compiled model: the graph hands back a copy, no alias to check
                return output.detach()
            return _copied(module, output, known)
        return self.reduce(output.detach())

    def reduce(self, o: Tensor) -> _Reduced:
        """``(n, (mean, std, near-zero count), histogram)`` of `o`, by fastai's very calls."""
        x = o.float()
        n = x.numel()
        mean = x.mean()
        std = x.std() if n > 1 else torch.full_like(mean, math.nan)  # torch warns on one value
        row = torch.stack((mean.double(), std.double(), torch.le(x, self.near_zero).sum().double()))
        return (n, row, x.histc(self.hist_bins, *self.hist_range) if self.with_hist else None)


def _copied(module: nn.Module, output: Tensor, known: Learned | None) -> Tensor:
    """A small activation the hook does not keep as an alias, as the step's reduction will read
    it: a copy (its module's output is changed by a later op, or it is not known yet whether it
    is; it is a tensor subclass, or it shares a larger storage; no recording keeps what it
    learns). The first copy of a module's output in a recording is noted, so that the
    recording learns at the end of the step whether the output changed."""
    copy = output.detach().clone()
    if known is not None and known.changed.get(module) is None and not output.is_inference():
        known.note(output, module, True)
    return copy


_SUM_ORDER_SLACK = 2.0**-35
"""Two sums in double of the same ``n < 2**15`` non-negative terms, added in different
orders, differ by at most ``2 (n - 1) 2**-53 < 2**-37`` of the sum, and two stds from them
by less than ``2**-37`` of the std: with 4x margin, an std whose ``1 -/+ 2**-35`` neighbours
round to one float32 is that float32 whichever order the sum took."""


_SLACK = torch.tensor((1 - _SUM_ORDER_SLACK, 1 + _SUM_ORDER_SLACK), dtype=torch.float64)


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
    bounds = torch.outer(approx, _SLACK).float()
    std = bounds[:, 1]
    if bounds.diff(dim=1).any():  # NaN too; a CPU tensor: reading it is no device sync
        rows = bounds[:, 0].ne(std).nonzero().squeeze(1)
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
        std = _round_std(torch.sub(x, mean.double().unsqueeze(1)))  # in double: float32 minus float64
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


class _Settled(NamedTuple):
    """A small CPU tensor of a state kept as Python numbers: one tensor kept per step pins
    freed heap pages, so a long CPU run's memory would grow with its steps (issue 26, item 8).
    :func:`live` gives the tensor back, bit for bit (values, dtype and shape)."""

    values: list[Any]
    dtype: torch.dtype
    shape: tuple[int, ...]


class Kept(NamedTuple):
    """An :class:`Entry` as a CPU state keeps it: rows and histograms as :class:`_Settled`."""

    iteration: int
    paths: tuple[str, ...]
    ns: tuple[int, ...]
    order: tuple[int, ...]
    rows: _Settled
    hist: _Settled | None


def keep(entry: Entry) -> Entry | Kept:
    """`entry` as a state keeps it: on the CPU its rows and histograms as :class:`_Settled`
    (read there with no sync); on another device unchanged (nothing read)."""
    if entry.rows.device.type != "cpu":
        return entry
    hist = None if entry.hist is None else _settle(entry.hist)
    return Kept(entry.iteration, entry.paths, entry.ns, entry.order, _settle(entry.rows), hist)


def _settle(t: Tensor) -> _Settled:
    return _Settled(t.tolist(), t.dtype, tuple(t.shape))


def live(entry: Entry | Kept) -> Entry:
    """`entry` with tensors again, as :func:`keep` took them, bit for bit."""
    if isinstance(entry, Entry):
        return entry
    hist = None if entry.hist is None else _tensor(entry.hist)
    return Entry(entry.iteration, entry.paths, entry.ns, entry.order, _tensor(entry.rows), hist)


def _tensor(s: _Settled) -> Tensor:
    return torch.tensor(s.values, dtype=s.dtype).reshape(s.shape)


class Entry(NamedTuple):
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


def _reduce_step(values: list[Any], snap: Snapshot) -> tuple[tuple[int, ...], tuple[int, ...], Tensor, Tensor | None]:
    """``(order, ns, rows, histograms)`` of one step's hook values (module order): kept
    activations of one shape and dtype are stacked and reduced together; ``order[i]`` is
    value i's row."""
    kept = True  # every value kept by the hook (none reduced there)
    for v in values:
        if type(v) is tuple:
            kept = False
            break
    first = values[0]
    if kept and ([v.shape for v in values].count(first.shape) == len(values)
                 and [v.dtype for v in values].count(first.dtype) == len(values)):
        # the common case: every activation kept, all of one shape
        x = torch.stack(values).flatten(1)
        if x.dtype != torch.float32:
            x = x.float()
        hist = _batched_hist(x, snap.hist_bins, *snap.hist_range) if snap.with_hist else None
        return tuple(range(len(values))), (x.shape[1],) * len(values), _row_stats(x, snap.near_zero), hist
    groups: dict[tuple[torch.Size, torch.dtype] | None, list[int]] = {}
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
            x = torch.stack([values[i] for i in members]).flatten(1)
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


def reduce_calls(calls: dict[str, tuple[Tensor | _Reduced, ...]], snap: Snapshot, iteration: int) -> Entry:
    """The Entry of one step from every call's hook value, by path (module order): the calls
    of a module on one step (micro-batches, several forwards before a mark) are one batch.

    With one call per module, its statistics are :func:`_reduce_step`'s (fastai's, to the
    bit); each further round of calls is reduced the same way and added by :func:`combine`
    (Chan's exact merge, as two ranks' parts of one step).
    """
    paths = tuple(calls)
    if max(map(len, calls.values())) == 1:  # the common case: one call per module
        order, ns, rows, hist = _reduce_step([v for v, in calls.values()], snap)
        return Entry(iteration, paths, ns, order, rows, hist)
    values = list(calls.values())
    entries = []
    for k in range(max(map(len, values))):
        here = [(p, v[k]) for p, v in zip(paths, values) if len(v) > k]
        ps = [p for p, _ in here]
        order, ns, rows, hist = _reduce_step([v for _, v in here], snap)
        entries.append(Entry(iteration, tuple(ps), ns, order, rows, hist))
    entry = entries[0]
    for part in entries[1:]:
        entry = combine(entry, part)
    return entry


def empty_entry(iteration: int, snap: Snapshot) -> Entry:
    """A recorded step on which no selected module ran."""
    hist = torch.zeros(0, snap.hist_bins) if snap.with_hist else None
    return Entry(iteration, (), (), (), torch.zeros(0, 3, dtype=torch.float64), hist)


def _in_module_order(entry: Entry) -> Entry:
    if entry.order == tuple(range(len(entry.order))):
        return entry
    index = torch.tensor(entry.order, device=entry.rows.device)
    hist = None if entry.hist is None else entry.hist.index_select(0, index)
    return entry._replace(order=tuple(range(len(entry.order))), rows=entry.rows.index_select(0, index), hist=hist)


def _spread(entry: Entry, paths: tuple[str, ...], device: torch.device) -> tuple[Tensor, Tensor, Tensor | None]:
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


def combine(a: Entry, b: Entry) -> Entry:
    """One step seen in two parts (two ranks), by module path: a module that ran in one part
    keeps that part's statistics; one that ran in both gets those of the joint batch (Chan's
    exact merge of means and squared deviations, written symmetrically: combining a with b
    gives the very floats of combining b with a)."""
    a, b = _in_module_order(a), _in_module_order(b)
    paths = _shared.module_order([a.paths, b.paths])
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
    hist = None if ha is None or hb is None else ha + hb
    ns = tuple(sum(e.ns[e.paths.index(p)] for e in (a, b) if p in e.paths) for p in paths)
    return Entry(a.iteration, paths, ns, tuple(range(len(paths))), rows, hist)

