"""LossCurve: the training loss of every step and its moving average, as a reducer.

It needs no hooks: it reads ``step.loss``, keeping the tensors on their device (no
``.item()`` per step; a CPU loss is kept as a float, not a tensor per step) until the result is read, which copies them to the host at once and
computes the exponential moving average there: fastai's smoothed loss, debiased,
``ema_t = (beta * m_{t-1} + (1 - beta) * loss_t) / (1 - beta ** t)`` with the raw average
``m``.

Cost: one tuple per train step; the state keeps every step's loss (a float on the CPU, a
0-d tensor on another device).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, TypeAlias, TypeVar

import attrs
import torch

from funhooks import _frozen, _html
from funhooks.errors import ReducerError
from funhooks.specs.spec import Spec
from funhooks.training.step import Step

from . import _display, _shared

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["LossCurve", "LossCurveResult"]

T = TypeVar("T")

_BETA = 0.98
"""fastai's smoothing of the loss (``Recorder``'s ``SmoothenValue``)."""


def _check_beta(instance: object, attribute: attrs.Attribute[T], beta: T) -> None:
    if not _shared.is_number(beta) or not 0 <= beta < 1:
        raise ReducerError(f"LossCurve: `beta` is a number in [0, 1), got {beta!r}. Pass e.g. beta={_BETA} (fastai's).")


class _Entry(NamedTuple):
    iteration: int
    loss: torch.Tensor | float
    parts: int
    """How many ranks' losses `loss` sums (1 until states of one iteration merge)."""


_State: TypeAlias = "_shared.Cons[_Entry]"
"""One entry per recorded train step, newest on top."""


@_frozen.frozen
@attrs.frozen
class LossCurve:
    """The loss of every train step and its debiased exponential moving average.

    Args:
        beta: the smoothing (:data:`_BETA`, fastai's); 0: no smoothing.

    Result: a :class:`LossCurveResult`. States merge (``merge``): chunks of steps
    concatenate; two ranks' losses of one iteration average.

    Raises:
        ReducerError: at construction, for a `beta` outside ``[0, 1)``.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> batches = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, fh.LossCurve())
        >>> len(res.losses), res.ema[0] == res.losses[0], res.iterations
        (3, True, (0, 1, 2))
    """

    beta: float = attrs.field(default=_BETA, validator=_check_beta)

    @property
    def specs(self) -> tuple[Spec, ...]:
        """None: only ``step.loss`` is read."""
        return ()

    def init(self) -> _State:
        """The empty state: a cons list of losses."""
        return ()

    def step(self, state: _State, step: Step) -> _State:
        """Add the loss of a train step (one that has a loss)."""
        if not step.training or step.loss is None:
            return state
        return (state, _Entry(step.iteration, _shared.settled(step.loss.detach()), 1))

    def merge(self, a: _State, b: _State) -> _State:
        """Chunks of steps in iteration order; one iteration's losses from two ranks average."""
        by_iteration: dict[int, _Entry] = {}
        for entry in _shared.unroll(a) + _shared.unroll(b):
            seen = by_iteration.get(entry.iteration)
            if seen is not None:
                entry = _Entry(entry.iteration, _added(seen.loss, entry.loss), seen.parts + entry.parts)
            by_iteration[entry.iteration] = entry
        return _shared.roll([by_iteration[k] for k in sorted(by_iteration)])

    def scalars(self, state: _State, *, since: int = 0) -> dict[str, float]:
        """``{"loss": ..., "ema": ...}`` at the newest train step, when its iteration is `since` or
        later (else ``{}``): the last of ``result().losses`` and of ``result().ema``. The moving
        average depends on every loss so far, so a read copies them all to the host (a float per
        step so far)."""
        if not _shared.newest(state, since):
            return {}
        res = self.result(state)
        return {"loss": res.losses[-1], "ema": res.ema[-1]}

    def result(self, state: _State) -> LossCurveResult:
        """The losses in step order and their moving average (one copy to the host)."""
        entries = _shared.unroll(state)
        if not entries:
            return LossCurveResult((), [], [], self.beta)
        device = next((e.loss.device for e in entries if isinstance(e.loss, torch.Tensor)), None)
        if device is None:  # a CPU run: floats
            values = torch.tensor([e.loss for e in entries], dtype=torch.float32)
        else:
            values = torch.stack([_shared.as_tensor(e.loss, device, torch.float32) for e in entries])
        parts = torch.tensor([e.parts for e in entries], dtype=torch.float32, device=values.device)
        losses = values.div_(parts).tolist()
        return LossCurveResult(tuple(e.iteration for e in entries), losses, _ema(losses, self.beta), self.beta)


def _added(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor | float:
    """Two ranks' losses of one iteration, added (on the device of a tensor one)."""
    if isinstance(a, torch.Tensor):
        return a + _shared.as_tensor(b, a.device, a.dtype)
    if isinstance(b, torch.Tensor):
        return _shared.as_tensor(a, b.device, b.dtype) + b
    return a + b


def _ema(losses: list[float], beta: float) -> list[float]:
    out, avg = [], 0.0
    for t, loss in enumerate(losses, 1):
        avg = beta * avg + (1 - beta) * loss
        out.append(avg / (1 - beta**t))
    return out


@_frozen.frozen
@attrs.frozen(eq=False)
class LossCurveResult:
    """The result of :class:`LossCurve`: ``iterations``, ``losses`` and their ``ema``.

    Example:
        >>> from funhooks.reducers.loss_curve import LossCurveResult
        >>> res = LossCurveResult((0, 1), [1.0, 3.0], [1.0, 2.01], 0.98)
        >>> res.last
        2.01
    """

    iterations: tuple[int, ...]
    losses: list[float]
    ema: list[float]
    beta: float

    @property
    def last(self) -> float:
        """The moving average at the last step (NaN without steps)."""
        return self.ema[-1] if self.ema else math.nan

    def __len__(self) -> int:
        return len(self.losses)

    def plot(self, *, epoch_len: int | None = None, figsize: tuple[float, float] = (8, 4)) -> Figure:
        """The loss at every step (thin), its moving average (thick) and, given `epoch_len`
        (steps per epoch), the epoch boundaries (the ``plot`` extra).

        Returns:
            A matplotlib Figure (``fig.savefig("loss.png")`` writes it).
        """
        from . import plot

        return plot.plot_loss(self, epoch_len=epoch_len, figsize=figsize)

    def __repr__(self) -> str:
        return f"LossCurveResult({len(self)} steps, last ema={self.last:.4g})"

    def _repr_html_(self) -> str:
        """A notebook's view: the number of steps, the last loss and moving average, the lowest
        loss and its iteration, then :meth:`plot` (the ``plot`` extra)."""
        rows: list[list[_html.Cell | str]] = []
        if self.losses:
            low = min(range(len(self.losses)), key=lambda i: (math.isnan(self.losses[i]), self.losses[i]))
            it = self.iterations
            rows = [["last loss", _display.value(self.losses[-1], it[-1])],
                    ["moving average", _display.value(self.last, it[-1])],
                    [f"lowest loss (iteration {it[low]})", _display.value(self.losses[low], it[low])]]
        caption = (f"LossCurve: {len(self)} step(s), iterations {self.iterations[0]}–{self.iterations[-1]}, "
                   f"beta {self.beta:g}" if self.losses else "LossCurve: no steps")
        return _display.html("LossCurve", ("", "value"), rows, caption=caption, draw=self.plot if self.losses else None)
