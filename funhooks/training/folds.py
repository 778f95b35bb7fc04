"""Reducers and folds: what watches training is a pure fold over its steps.

A *reducer* is a frozen value with four members:

- ``specs``: the specs whose records it reads (``()`` for one that reads only losses);
- ``init()``: the empty state;
- ``step(state, step) -> state``: the state after one more :class:`~funhooks.Step`;
- ``result(state)``: the answer.

It may also have ``merge(a, b) -> state`` (states of disjoint chunks of steps, or of ranks,
combined exactly), ``records(iteration, training) -> bool`` (whether it reads that step's
record; when no reducer of a :func:`fit` does, the step runs with the hooks paused) and
``watches``, the :class:`~funhooks.OptimizerWatch` values whose records it reads (what the
optimizer sees at each step: final gradients, parameters before and after).

``fold`` is ``toolz.reduce(reducer.step, steps, reducer.init())`` plus ``result``, written as a
loop that lets each step (and the activations its record holds) go before the next one runs;
``fold_all`` advances several reducers over one pass; ``fit`` trains with the union of
their specs and folds them. The steps generator is always closed when a fold ends, so a
reducer that raises never leaves hooks on the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeAlias, TypeVar, cast, runtime_checkable

import toolz
from torch import nn

from funhooks.errors import ReducerError
from funhooks.specs.spec import Spec

from .progress import wrap
from ._one_step import LossFn, Optimizers, StepFn, total
from .loops import train_steps
from .step import Step
from .watch import OptimizerWatch

__all__ = ["AnyReducer", "Reducer", "Reducers", "Shape", "as_items", "fit", "fold", "fold_all", "records_of", "running",
           "watches_of"]

S = TypeVar("S")
"""A reducer's state."""
R_co = TypeVar("R_co", covariant=True)
"""A reducer's result."""
_PROTOCOL = ("specs", "init", "step", "result")
"""The members every reducer has."""


@runtime_checkable
class Reducer(Protocol[S, R_co]):
    """The reducer protocol (for type hints): ``specs``, ``init``, ``step``, ``result``.

    Generic in the state `S` and the result `R_co`: ``fh.fold(fh.ActivationStats(), steps)``
    is an ``ActivationStatsResult`` to a type checker; a bare ``Reducer`` takes any.
    ``specs`` is read-only: a field, a class attribute or a property all satisfy it. The
    optional members (``merge``, ``records``, ``watches``) are not part of the protocol;
    :mod:`funhooks.training.folds` says what each adds.

    Example:
        >>> import funhooks as fh
        >>> isinstance(fh.ActivationStats(), fh.Reducer)
        True
    """

    @property
    def specs(self) -> tuple[Spec, ...]: ...

    def init(self) -> S: ...

    def step(self, state: S, step: Step) -> S: ...

    def result(self, state: S) -> R_co: ...


AnyReducer: TypeAlias = "Reducer[Any, Any]"
"""A reducer of whatever state and result (several reducers together mix them)."""

Reducers: TypeAlias = "Mapping[Any, AnyReducer] | Sequence[AnyReducer] | AnyReducer"
"""What ``fit``, ``fold_all``, ``folding`` and the trainer callbacks take: a dict (user's keys)
or a list or tuple of reducers, or one reducer."""

Shape: TypeAlias = Callable[[Sequence[object]], Any]
"""Puts the reducers' results (or states), in order, back in the shape of `reducers`."""


def _check_reducer(reducer: object, caller: str) -> AnyReducer:
    """Return `reducer` if it has the protocol, else raise a ReducerError naming what lacks."""
    missing = [name for name in _PROTOCOL if not hasattr(reducer, name)]
    checked = cast("AnyReducer", reducer)  # its members are there; their kinds are checked next
    if not missing:
        missing = [name for name in _PROTOCOL[1:] if not callable(getattr(reducer, name))]
    if not missing:
        specs = checked.specs
        if not isinstance(specs, (tuple, list)) or not all(isinstance(s, Spec) for s in specs):
            missing = ["`specs` as a tuple of Specs"]
        elif not all(isinstance(w, OptimizerWatch) for w in watches_of(reducer)):
            missing = ["`watches` as a tuple of OptimizerWatch"]
    if not missing:
        return checked
    raise ReducerError(
            f"{caller}: a reducer has `specs`, `init()`, `step(state, step)` and `result(state)`, got {reducer!r} "
            f"which lacks {', '.join(missing)}. Give it those members (see docs/folds.md), or use "
            "fh.ActivationStats / fh.HookCallback."
    )


def watches_of(reducer: object) -> tuple[OptimizerWatch, ...]:
    """The reducer's optional ``watches`` (none: ``()``)."""
    watches = getattr(reducer, "watches", ())
    return tuple(watches) if isinstance(watches, (tuple, list)) else (watches,)


def _close(steps: Iterable[object]) -> None:
    close = getattr(steps, "close", None)
    if callable(close):
        close()


def fold(reducer: Reducer[S, R_co], steps: Iterable[Step]) -> R_co:
    """Run one reducer over `steps` and return its result.

    Args:
        reducer: a value with ``specs``, ``init``, ``step`` and ``result``.
        steps: Steps, e.g. from :func:`funhooks.train` run with ``specs=reducer.specs``.

    Returns:
        ``reducer.result(state)`` after the last step.

    Raises:
        ReducerError: when `reducer` lacks the protocol.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> batches = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
        >>> stats = fh.ActivationStats(every=2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> res = fh.fold(stats, fh.train(model, batches, nn.functional.mse_loss, opt, specs=stats.specs))
        >>> len(res.stats), len(res.stats[0]), sorted(res.stats[0][0])
        (3, 2, ['mean', 'near_zero', 'std'])
    """
    _check_reducer(reducer, "fold")
    try:
        state = reducer.init()
        for step in steps:
            state = reducer.step(state, step)
            del step  # freed (with its record) before the next step runs, as functools.reduce would not
        return reducer.result(state)
    finally:
        _close(steps)


def running(reducer: Reducer[S, R_co], steps: Iterable[Step]) -> Iterator[R_co]:
    """Lazily yield the reducer's result after each step (a running view, for live plots).

    Args:
        reducer: a reducer.
        steps: Steps.

    Returns:
        An iterator of results, one per step.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(2, 1)
        >>> batches = [(torch.randn(4, 2), torch.randn(4, 1)) for _ in range(3)]
        >>> stats = fh.ActivationStats()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> [len(r.stats) for r in fh.running(stats, fh.train(model, batches, nn.functional.mse_loss, opt, specs=stats.specs))]
        [1, 2, 3]
    """
    _check_reducer(reducer, "running")
    states = toolz.accumulate(reducer.step, steps, initial=reducer.init())
    next(states)  # the initial state
    try:
        for state in states:
            yield reducer.result(state)
    finally:
        _close(steps)


def as_items(reducers: Reducers, caller: str) -> tuple[Shape, tuple[AnyReducer, ...]]:
    """The reducers as a tuple, plus the function that puts results back in their shape."""
    if isinstance(reducers, Mapping):
        keys = tuple(reducers)
        items = tuple(_check_reducer(reducers[k], caller) for k in keys)
        return (lambda results: dict(zip(keys, results))), items
    if isinstance(reducers, (list, tuple)):
        kind = type(reducers)
        items = tuple(_check_reducer(r, caller) for r in reducers)
        return (lambda results: kind(results) if kind in (list, tuple) else list(results)), items
    if all(hasattr(reducers, name) for name in _PROTOCOL):
        return (lambda results: results[0]), (_check_reducer(reducers, caller),)
    raise ReducerError(
        f"{caller}: `reducers` is a dict or a list of reducers, got {type(reducers).__name__}. "
        "Pass e.g. {'stats': fh.ActivationStats()} or [fh.ActivationStats()]."
    )


def fold_all(reducers: Reducers, steps: Iterable[Step]) -> Any:
    """Run several reducers over `steps` in one pass; results come back in the same shape.

    Args:
        reducers: a dict or a list (or tuple) of reducers; a single reducer gives its result.
        steps: Steps (one pass; a generator is fine).

    Returns:
        dict -> dict of results, list -> list, tuple -> tuple.

    Raises:
        ReducerError: when an entry lacks the reducer protocol.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.ReLU())
        >>> batches = [(torch.randn(4, 3), torch.randn(4, 3)) for _ in range(4)]
        >>> every2, every1 = fh.ActivationStats(every=2), fh.ActivationStats()
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> steps = fh.train(model, batches, nn.functional.mse_loss, opt, specs=every1.specs)
        >>> res = fh.fold_all({"sparse": every2, "dense": every1}, steps)
        >>> len(res["sparse"].stats), len(res["dense"].stats)
        (2, 4)
    """
    shape, items = as_items(reducers, "fold_all")
    steppers = tuple(r.step for r in items)

    try:
        states = [r.init() for r in items]
        for step in steps:
            states = [f(s, step) for f, s in zip(steppers, states)]
            del step  # freed (with its record) before the next step runs
        return shape([r.result(s) for r, s in zip(items, states)])
    finally:
        _close(steps)


def records_of(items: tuple[AnyReducer, ...]) -> Callable[[int, bool], bool] | None:
    """``records(iteration, training)`` for the reducers that read records; None: always."""
    methods = [getattr(r, "records", None) for r in items if r.specs or watches_of(r)]  # optional: not in Reducer
    if any(not callable(m) for m in methods):
        return None
    if len(methods) == 1:
        return cast("Callable[[int, bool], bool]", methods[0])
    wants = toolz.juxt(*methods)
    return lambda iteration, training: any(wants(iteration, training))


def fit(
    model: nn.Module,
    batches: Iterable[object],
    loss_fn: LossFn | None = None,
    opt: Optimizers | None = None,
    reducers: Reducers | None = None,
    *,
    step: StepFn | None = None,
    epochs: int = 1,
    accumulate: int = 1,
    to_device: bool = False,
    start_iteration: int = 0,
    progress: bool | None = None,
) -> Any:
    """Train `model` with the union of the reducers' specs and watches, and fold them over the steps.

    Equal specs (and watches) are installed once, for the whole of ``fit``, and paused between
    steps (a forward a reducer makes in its ``step`` is not recorded) and on steps that no
    reducer records (``records`` says so, e.g. ``every=4`` skips three in four): their spec
    functions do not run at all. A module added, removed or replaced mid-training is seen from
    the next step. Hooks are removed however training ends.

    Args:
        model, batches, loss_fn, opt, step, epochs, accumulate, to_device, start_iteration: as
            for :func:`funhooks.train` (with your own `step`, pass `opt` when a reducer watches
            the optimizer; resuming a run, ``start_iteration`` is the number of steps already
            trained, so the results number on from the first run's and merge with them).
        reducers: a dict or a list of reducers (a single reducer gives its result).
        progress: show a progress bar (tqdm); None: in a terminal and not in CI.

    Returns:
        The reducers' results in the shape of `reducers` (dict -> dict, list -> list).

    Raises:
        ReducerError: when an entry lacks the reducer protocol.
        LoopError: for bad training arguments or batches (none at all included).

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> batches = [(torch.randn(16, 3), torch.randn(16, 1)) for _ in range(6)]
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.05)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt, {"acts": fh.ActivationStats(every=3)})
        >>> res["acts"].paths, len(res["acts"].stats)
        (('0', '2'), 2)
        >>> fh.testing.assert_no_hooks(model)
    """
    if reducers is None:
        raise ReducerError("fit: `reducers` is a dict or a list of reducers, got None. "
                           "Pass e.g. reducers={'stats': fh.ActivationStats()}.")
    shape, items = as_items(reducers, "fit")
    specs = tuple(dict.fromkeys(s for r in items for s in r.specs))
    watches = tuple(dict.fromkeys(w for r in items for w in watches_of(r)))
    steps = train_steps(model, batches, loss_fn, opt, step=step, specs=specs, watches=watches, epochs=epochs,
                        accumulate=accumulate, to_device=to_device, records=records_of(items),
                        start_iteration=start_iteration, caller="fit", held=True)
    wrapped = wrap(steps, total=total(batches, epochs, accumulate), desc="fit", progress=progress)
    return shape(fold_all(list(items), wrapped))
