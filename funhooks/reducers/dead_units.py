"""DeadUnits: the fraction of each layer's units that are dead, step by step, as a reducer.

A unit is a channel of a layer's output: dimension 1 of an output with four or more
dimensions (``(N, C, H, W)``), the last dimension otherwise (``(N, features)``,
``(N, tokens, features)``). It is dead on a step when its magnitude stays at or below
``near_zero`` at every other position of the step's batch (every example, pixel and token,
every micro-batch): a ReLU whose bias pushed it negative for good outputs exact zeros. The
result gives, per layer and recorded step, the fraction of units dead on that step, and the
fraction dead on every recorded step (dead throughout training).

Cost: per selected module call, one reduction of the output to one peak per unit, in the
hook, on its device (the output itself is not kept); per recorded step, one comparison per
shape of peaks. The state keeps one bool per unit per layer per recorded step (on the CPU one
bit, in a Python int: no tensor per step, so a long CPU run's memory stays flat).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple, TypeAlias, TypeVar, cast

import attrs
import torch
from torch import nn

from funhooks import _frozen, _html
from funhooks.errors import ReducerError
from funhooks.specs.selector import Selector, select
from funhooks.specs.spec import Spec, observe
from funhooks.training.step import Step

from . import _display, _shared

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["DeadUnits", "DeadUnitsResult"]

T = TypeVar("T")

_NEAR_ZERO = 1e-6
"""A unit's magnitude at or below this counts as zero (``fh.testing.check_dead_units``' too)."""

_ACTIVATIONS: tuple[type[nn.Module], ...] = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.RReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardtanh, nn.Softplus,
)
"""PyTorch's activation modules, where units die (with Hugging Face's, the default layers; see
:func:`_is_activation`)."""

_HF_ACTIVATIONS = "transformers.activations"
_HF_IDENTITY = "LinearActivation"


def _is_activation(path: str, module: nn.Module) -> bool:
    """Whether `module` is an activation: one of :data:`_ACTIVATIONS`, or one of Hugging Face's
    own activation modules (the classes of ``transformers.activations``, such as GPT-2's
    ``NewGELUActivation`` and BERT's ``GELUActivation``; not its identity, ``LinearActivation``).

    Example:
        >>> from torch import nn
        >>> from funhooks.reducers.dead_units import _is_activation
        >>> _is_activation("1", nn.ReLU()), _is_activation("0", nn.Linear(2, 2))
        (True, False)
    """
    if isinstance(module, _ACTIVATIONS):
        return True
    cls = type(module)
    return cls.__module__ == _HF_ACTIVATIONS and cls.__name__ != _HF_IDENTITY


_NAME = "dead_units"


def _check_near_zero(instance: object, attribute: attrs.Attribute[T], value: T) -> None:
    if not _shared.is_number(value) or value < 0:
        raise ReducerError(f"DeadUnits: `near_zero` is a number >= 0, got {value!r}. Pass e.g. near_zero={_NEAR_ZERO}.")


def _unit_peaks(module: nn.Module, args: tuple[object, ...], output: object) -> torch.Tensor | None:
    """The largest magnitude of each unit of `output` over the batch (None: not a tensor, or 0-d).

    Example:
        >>> import torch
        >>> from funhooks.reducers.dead_units import _unit_peaks
        >>> _unit_peaks(None, (), torch.tensor([[0.0, -2.0], [0.0, 1.0]]))
        tensor([0., 2.])
    """
    if not isinstance(output, torch.Tensor) or output.dim() == 0 or output.numel() == 0:
        return None
    o = output.detach()
    unit = 1 if o.dim() >= 4 else o.dim() - 1
    dims = tuple(d for d in range(o.dim()) if d != unit)
    return o.abs().amax(dim=dims) if dims else o.abs()


class _Bits(NamedTuple):
    """A dead-unit mask kept on the host: bit i of `value` is set when unit i is dead."""

    value: int
    units: int


_BIT = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8)


def _on_host(mask: torch.Tensor | _Bits) -> _Bits:
    """`mask` as bits (units 8j..8j+7 packed into byte j, little-endian)."""
    if isinstance(mask, _Bits):
        return mask
    flat = mask.detach().cpu().flatten().to(torch.uint8)
    packed = torch.nn.functional.pad(flat, (0, -flat.numel() % 8)).view(-1, 8).mul(_BIT).sum(1, dtype=torch.uint8)
    return _Bits(int.from_bytes(bytes(packed.tolist()), "little"), flat.numel())


def _and(a: torch.Tensor | _Bits, b: torch.Tensor | _Bits) -> torch.Tensor | _Bits:
    """Dead in both."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a & b.to(a.device)
    a, b = _on_host(a), _on_host(b)
    return _Bits(a.value & b.value, a.units)


def _fractions(masks: tuple[torch.Tensor | _Bits, ...]) -> torch.Tensor | list[float]:
    """The dead fraction of each mask: on the device of tensor masks, floats for bits."""
    if all(isinstance(m, torch.Tensor) for m in masks):
        device = cast(torch.Tensor, masks[0]).device
        return torch.stack([cast(torch.Tensor, m).double().mean().to(device) for m in masks])
    return [b.value.bit_count() / b.units for b in map(_on_host, masks)]


class _Entry(NamedTuple):
    """One recorded step: per layer (module order) its dead-unit mask and the dead fraction
    (bits and floats for a CPU step)."""

    iteration: int
    paths: tuple[str, ...]
    masks: tuple[torch.Tensor | _Bits, ...]
    fractions: torch.Tensor | list[float]


_State: TypeAlias = "_shared.Cons[_Entry]"
"""One entry per recorded step, newest on top."""


def _entry(iteration: int, paths: tuple[str, ...], peaks: list[torch.Tensor], near_zero: float) -> _Entry:
    if not peaks:
        return _Entry(iteration, (), (), [])
    if all(p.is_cpu for p in peaks):
        masks: tuple[torch.Tensor | _Bits, ...] = tuple(_on_host(p.le(near_zero)) for p in peaks)
        return _Entry(iteration, paths, masks, _fractions(masks))
    if all(p.shape == peaks[0].shape and p.device == peaks[0].device for p in peaks):
        dead = torch.stack(peaks).le(near_zero)
        return _Entry(iteration, paths, tuple(dead.unbind(0)), dead.double().mean(1))
    masks = tuple(p.le(near_zero) for p in peaks)
    return _Entry(iteration, paths, masks, _fractions(masks))


@_frozen.frozen
@attrs.frozen
class DeadUnits:
    """The fraction of dead units per layer at every recorded train step, and throughout.

    Args:
        modules: the layers (a selector); None: the activation modules (:func:`_is_activation`:
            PyTorch's and Hugging Face's).
        every: record train iterations with ``iteration % every == 0``; None: all.
        near_zero: a magnitude at or below this counts as zero (:data:`_NEAR_ZERO`).

    Result: a :class:`DeadUnitsResult`. States merge exactly (``merge``): chunks of steps
    concatenate; two ranks' states of one iteration (halves of one batch) combine by path: a
    unit is dead on the joint batch when it is dead on both.

    Raises:
        ReducerError: at construction, for ``every <= 0`` or a negative `near_zero`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(2, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> with torch.no_grad():
        ...     _ = model[0].bias.copy_(torch.tensor([-100.0, -100.0, 100.0, 100.0]))  # two never fire, two always
        >>> batches = [(torch.randn(8, 2), torch.randn(8, 1)) for _ in range(3)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.0)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.DeadUnits())
        >>> res.paths, res.layer("1"), res.dead_throughout()
        (('1',), [0.5, 0.5, 0.5], {'1': 0.5})
    """

    modules: Selector | None = attrs.field(default=None, converter=_shared.to_selector)
    every: int | None = attrs.field(default=None, validator=_shared.check_every("DeadUnits"))
    near_zero: float = attrs.field(default=_NEAR_ZERO, kw_only=True, validator=_check_near_zero)

    @property
    def specs(self) -> tuple[Spec, ...]:
        """One observer spec storing each unit's peak magnitude over the batch."""
        where = select(_is_activation) if self.modules is None else self.modules
        return (observe(where, _unit_peaks, name=_NAME, detach=False),)

    def records(self, iteration: int, training: bool) -> bool:
        """True for the train iterations recorded."""
        return _shared.records(self.every, iteration, training)

    def init(self) -> _State:
        """The empty state."""
        return ()

    def step(self, state: _State, step: Step) -> _State:
        """Add the step's dead-unit masks (on the device, not read) when it is recorded; a
        module called several times (micro-batches) counts every call."""
        if not _shared.records(self.every, step.iteration, step.training):
            return state
        paths, peaks = [], []
        for path, every in step.record.calls_by_path(_NAME).items():
            calls = [c for c in every if c is not None]
            if calls:
                paths.append(path)
                peaks.append(calls[0] if len(calls) == 1 else torch.stack(calls).amax(0))
        return (state, _entry(step.iteration, tuple(paths), peaks, self.near_zero))

    def merge(self, a: _State, b: _State) -> _State:
        """Chunks of steps in iteration order; one iteration's two parts (two ranks) by path:
        dead on the joint batch where dead on both."""
        by_iteration: dict[int, _Entry] = {}
        for entry in _shared.unroll(a) + _shared.unroll(b):
            seen = by_iteration.get(entry.iteration)
            by_iteration[entry.iteration] = entry if seen is None else self._combine(seen, entry)
        return _shared.roll([by_iteration[k] for k in sorted(by_iteration)])

    def _combine(self, a: _Entry, b: _Entry) -> _Entry:
        masks = dict(zip(a.paths, a.masks))
        for path, mask in zip(b.paths, b.masks):
            masks[path] = mask if path not in masks else _and(masks[path], mask)
        paths = _shared.module_order([a.paths, b.paths])
        ordered = tuple(masks[p] for p in paths)
        return _Entry(a.iteration, paths, ordered, _fractions(ordered))

    def scalars(self, state: _State, *, since: int = 0) -> dict[str, float]:
        """``{"<layer>/dead": fraction}`` of each module at the newest recorded step, when its
        iteration is `since` or later (else ``{}``): the numbers ``result().dead`` gives for
        that step."""
        last = _shared.newest(state, since)
        if not last:
            return {}
        res = DeadUnitsResult((last[1],))
        return _shared.layer_scalars({p: [d] for p, d in zip(res.paths, res.dead[0])}, ("dead",))

    def result(self, state: _State) -> DeadUnitsResult:
        """The dead fractions of every recorded step.

        Raises:
            ReducerError: when steps were recorded and none holds this reducer's values.
        """
        entries = tuple(_shared.unroll(state))
        if entries and not any(e.paths for e in entries):
            raise ReducerError(
                f"DeadUnits: a recorded train step holds the records of the reducer's specs, got {len(entries)} "
                f"recorded steps and no {_NAME!r} in any of their records. Run the steps with "
                "`specs=reducer.specs` (fh.fit does), and select modules that run."
            )
        return DeadUnitsResult(entries)


@_frozen.frozen
@attrs.frozen(eq=False)
class DeadUnitsResult(_shared.Steps):
    """The result of :class:`DeadUnits`: per recorded step, per layer path, the dead fraction.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.0)
        >>> res = fh.fit(model, [(torch.randn(4, 2), torch.randn(4, 3))], nn.functional.mse_loss, opt, fh.DeadUnits())
        >>> len(res.dead), res.paths
        (1, ('1',))
    """

    entries: tuple[_Entry, ...]
    paths: tuple[str, ...] = attrs.field(init=False, default=attrs.Factory(_shared.entry_paths, takes_self=True))
    """The layer paths, in module order: every layer that ran on some recorded step."""

    @property
    def dead(self) -> list[list[float]]:
        """Per recorded step, per layer of ``paths``, the fraction of its units dead on that
        step (NaN where the layer did not run); one copy to the host."""
        host = [e.fractions if isinstance(e.fractions, list) else e.fractions.tolist() for e in self.entries]
        return [[row[e.paths.index(p)] if p in e.paths else math.nan for p in self.paths]
                for e, row in zip(self.entries, host)]

    def layer(self, idx: int | str) -> list[float]:
        """The dead fractions of layer `idx` (an index into ``paths``, or a path) over the steps.

        Raises:
            ReducerError: for an index out of range or an unknown path.
        """
        from ._layered import index

        i = index(self.paths, idx, "layer")
        return [row[i] for row in self.dead]

    def dead_throughout(self) -> dict[str, float]:
        """Per layer, the fraction of its units dead on every recorded step it ran."""
        out = {}
        for path in self.paths:
            masks = [e.masks[e.paths.index(path)] for e in self.entries if path in e.paths]
            first = masks[0]
            if isinstance(first, torch.Tensor) and all(isinstance(m, torch.Tensor) and m.shape == first.shape
                                                       for m in masks):
                tensors = cast(list[torch.Tensor], masks)
                out[path] = torch.stack([m.to(first.device) for m in tensors]).all(0).double().mean().item()
            elif len({b.units for b in map(_on_host, masks)}) == 1:
                dead = _on_host(functools.reduce(_and, masks))
                out[path] = dead.value.bit_count() / dead.units
            else:
                out[path] = math.nan  # the unit count changed between steps: no unit is followed throughout
        return out

    def plot(self, *, model: nn.Module | None = None, figsize: tuple[float, float] = (8, 4)) -> Figure:
        """The dead fraction of every layer over the steps (the ``plot`` extra).

        Args:
            model: the model folded on, to name each layer's type in the legend (``0 Conv2d``).
            figsize: the figure's size in inches.

        Returns:
            A matplotlib Figure (``fig.savefig("dead.png")`` writes it).
        """
        from . import plot

        return plot.plot_dead_units(self, model=model, figsize=figsize)

    def __repr__(self) -> str:
        return f"DeadUnitsResult({len(self)} steps, paths={_html.short(list(self.paths))})"

    def _repr_html_(self) -> str:
        """A notebook's view: per layer, the steps it ran on, the % of its units dead at the last
        recorded step (only that step's fractions are read) and dead on every step it ran, then
        :meth:`plot` (the ``plot`` extra)."""
        last = dict(zip(self.entries[-1].paths, DeadUnitsResult(self.entries[-1:]).dead[0])) if self.entries else {}
        throughout = self.dead_throughout() if self.entries else {}
        it = self.iterations[-1] if self.entries else -1
        counts = _display.steps_per_path(e.paths for e in self.entries)
        rows: list[list[_html.Cell | str]] = [[p, str(counts[p]), _display.value(last.get(p), it, scale=100.0),
                 _display.value(throughout[p], it, scale=100.0)] for p in self.paths]
        return _display.html("DeadUnits", ("layer", "steps", "% dead", "% dead throughout"), rows,
                             caption=_display.caption("DeadUnits", self.iterations, len(self.paths), "layer"),
                             draw=self.plot if self.entries else None)
