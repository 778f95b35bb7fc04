"""Folding reducers over a training loop you write yourself.

Research code trains in its own loop. ``fh.folding(model, reducers, opt=opt)`` is a block
around that loop: the reducers' specs record the model's calls and their watches read the
optimizer's updates, and each ``fold.step(loss)`` you write at the end of an iteration marks
one step: what was recorded since the last mark becomes a frozen :class:`~funhooks.Step`,
every reducer advances by it, and recording starts afresh. ``fold.result()`` gives the
results in the shape of `reducers`, the same values :func:`funhooks.fit` gives on the same
training.

The block is a ``with_hooks`` run for its whole length (so the model's wrappers are put on
once, not per step), seen only by the thread and context that entered it; the model's
train/eval mode is yours. Iterations no reducer records run with the recording paused; so
does anything inside ``with fold.paused():`` (an evaluation between iterations). Calls after
the last mark are not a step.

Cost: per marked step, a Record built from what was stored, one Step and each reducer's
``step``; no ``.item()``, so no GPU sync.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from funhooks.errors import LoopError

from . import _one_step
from ._one_step import Optimizers
from .folds import Reducers, as_items, records_of, watches_of
from .recorder import Phase, Recorder
from .step import EMPTY_RECORD, Step

__all__ = ["Folding", "folding"]


class Folding:
    """Reducers folded over the steps of your own loop; use it through :func:`folding`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> with fh.folding(model, [fh.LossCurve()]) as fold:
        ...     for loss in (3.0, 2.0, 1.0):          # whatever your loop computes
        ...         step = fold.step(torch.tensor(loss))
        >>> step.iteration, fold.result()[0].losses
        (2, [3.0, 2.0, 1.0])
    """

    def __init__(self, model: nn.Module, reducers: Reducers, opt: Optimizers | None,
                 start_iteration: int = 0, caller: str = "folding") -> None:
        if not isinstance(model, nn.Module):
            raise LoopError(f"{caller}: `model` is an nn.Module, got {type(model).__name__}. Pass the model you train.")
        _one_step.check_start(start_iteration, caller)
        self._shape, self._items = as_items(reducers, caller)
        specs = tuple(dict.fromkeys(s for r in self._items for s in r.specs))
        watches = tuple(dict.fromkeys(w for r in self._items for w in watches_of(r)))
        if watches and opt is None:
            raise LoopError(f"{caller}: a reducer watches the optimizer step (`watches`), got no optimizer. "
                            "Pass `opt=` (the optimizer your loop steps).")
        self._caller = caller
        self._recorder = Recorder(model, specs, watches, opt, caller)
        self._records = records_of(self._items)
        self._states = [r.init() for r in self._items]
        self._start = self._iteration = start_iteration
        self._evaluated = 0
        self._epoch = 0
        self._state = "new"

    def __enter__(self) -> Folding:
        if self._state != "new":
            raise LoopError(f"{self._caller}: a folding block is entered once, got a second `with`. "
                            "Call fh.folding again for another loop.")
        self._state = "open"
        self._recorder.open()
        self._next(self._iteration)
        return self

    def __exit__(self, *exc: object) -> None:
        self._state = "closed"
        self._recorder.close()

    def _wanted(self, iteration: int) -> bool:
        return self._recorder.active and (self._records is None or self._records(iteration, True))

    def _next(self, iteration: int) -> None:
        if self._wanted(iteration):
            self._recorder.resume()
        else:
            self._recorder.pause()

    def step(self, loss: object = None, *, epoch: int | None = None, training: bool = True) -> Step:
        """Mark the end of one iteration: what was recorded since the last mark is one Step.

        Args:
            loss: the iteration's loss (a tensor, detached here; a number; or a dict holding
                it under ``"loss"``, the rest becoming ``Step.metrics``); None: no loss.
            epoch: the epoch of this step (kept for the next ones); None: the last given (0).
            training: False marks an evaluation step (reducers skip those).

        Returns:
            The Step the reducers advanced by.

        Raises:
            LoopError: outside the ``with`` block, or for a loss that is not a scalar.
        """
        if self._state != "open":
            raise LoopError(f"{self._caller}: `step` marks an iteration inside the `with fh.folding(...)` block, "
                            "got a call outside it. Mark iterations inside the block.")
        if epoch is not None:
            self._epoch = epoch
        loss, metrics = _one_step.outcome(loss, self._caller)
        record = EMPTY_RECORD if self._recorder.phase is Phase.PAUSED else self._recorder.take()
        iteration = self._iteration if training else self._evaluated
        step = Step(self._epoch, iteration, loss, record, training, metrics)
        self._states = [r.step(s, step) for r, s in zip(self._items, self._states)]
        if training:
            self._iteration += 1
        else:
            self._evaluated += 1
        self._next(self._iteration)
        return step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside this block nothing is recorded (an evaluation between training iterations)."""
        was = self._recorder.phase is Phase.PAUSED
        self._recorder.pause()
        try:
            yield
        finally:
            if not was:
                self._recorder.resume()

    @property
    def states(self) -> Any:
        """The reducers' states now, in the shape of `reducers` (for ``fh.merge_across_ranks``)."""
        return self._shape(list(self._states))

    def result(self) -> Any:
        """The reducers' results over the steps marked so far, in the shape of `reducers`."""
        return self._shape([r.result(s) for r, s in zip(self._items, self._states)])

    def __repr__(self) -> str:
        return f"Folding({len(self._items)} reducers, {self._iteration - self._start} train steps marked)"


def folding(model: nn.Module, reducers: Reducers, *, opt: Optimizers | None = None,
            start_iteration: int = 0) -> Folding:
    """Fold `reducers` over the steps of a training loop you write: mark each with ``fold.step(loss)``.

    Args:
        model: the model your loop trains.
        reducers: a dict or a list of reducers (a single reducer gives its result).
        opt: the optimizer (or optimizers) your loop steps; needed when a reducer watches the
            optimizer (``fh.GradientStats``, ``fh.UpdateRatio``).
        start_iteration: the ``iteration`` of the first train step marked; resuming a loop
            from a checkpoint, the number of optimizer steps already trained.

    Returns:
        A :class:`Folding` to use as a context manager; ``fold.result()`` after (or during) the
        loop gives what :func:`funhooks.fit` would on the same training.

    Raises:
        ReducerError: when an entry lacks the reducer protocol.
        LoopError: for a missing optimizer a watch needs, or a bad `start_iteration`.
        SpecError, SelectorError: for specs or watches that do not fit the model.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.05)
        >>> batches = [(torch.randn(16, 3), torch.randn(16, 1)) for _ in range(4)]
        >>> with fh.folding(model, {"acts": fh.ActivationStats(), "grads": fh.GradientStats()}, opt=opt) as fold:
        ...     for x, y in batches:                   # your own loop, untouched
        ...         opt.zero_grad()
        ...         loss = nn.functional.mse_loss(model(x), y)
        ...         loss.backward()
        ...         opt.step()
        ...         _ = fold.step(loss)                # one Step per marked iteration
        >>> res = fold.result()
        >>> len(res["acts"].stats), res["grads"].paths
        (4, ('0', '2'))
        >>> fh.testing.assert_no_hooks(model)
    """
    return Folding(model, reducers, opt, start_iteration)
