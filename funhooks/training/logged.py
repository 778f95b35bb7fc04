"""Statistics sent to a logger as they are computed: the ``scalars`` protocol, the names a
dashboard groups, and :class:`Logged`, reducers whose scalars go to TensorBoard every few steps.

A reducer may have ``scalars(state, *, since=0) -> {name: float}``: the statistics of its
newest step when that step's iteration is `since` or later, else ``{}`` (every library reducer
has it; see docs/folds.md). A logger reads it every `every` steps with ``since`` the step's own
iteration, so a point logged at step ``i`` is the result for step ``i`` (a reducer that did not
record step ``i`` gives ``{}`` and is not written), each recorded step is read at most once,
and the whole history never is. The names are ``"<layer>/<statistic>"``; a logger puts
``funhooks/<group>/`` in front, the group being the reducer's key in a dict of reducers (or
its class name in a list): ``funhooks/activations/0/std``. Dashboards group on the slashes.

Cost: between reads nothing: the reducers keep their statistics on the device. A read copies
the newest step of each reducer to the host (on CUDA, one sync per read).
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs

from funhooks import _frozen
from funhooks.errors import ExtraError, LoopError, ReducerError
from funhooks.specs.spec import Spec

from .folds import AnyReducer, Reducers, Shape, as_items, records_of, watches_of
from .step import Step
from .watch import OptimizerWatch

__all__ = ["Logged", "Scalars", "check_log_every", "group_names", "scalars_of"]

S_contra = TypeVar("S_contra", contravariant=True)
"""A reducer's state."""

_PREFIX = "funhooks"
"""The first part of every logged name: ``funhooks/<group>/<layer>/<statistic>``."""

_LOG_EVERY = 50
"""The default interval of :class:`Logged`, in steps (Lightning's ``log_every_n_steps``)."""


@runtime_checkable
class Scalars(Protocol[S_contra]):
    """A reducer that can be logged: ``scalars(state, *, since=0) -> {name: float}``.

    Example:
        >>> import funhooks as fh
        >>> isinstance(fh.GradientStats(), fh.Scalars)
        True
    """

    def scalars(self, state: S_contra, *, since: int = 0) -> dict[str, float]: ...


class _Writer(Protocol):
    """Where :class:`Logged` writes: ``add_scalar(tag, value, global_step)``, as
    ``torch.utils.tensorboard.SummaryWriter`` (and tensorboardX's) has it."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> object: ...


def check_log_every(every: object, caller: str, name: str) -> int | None:
    """`every` if it is a positive int or None, else a LoopError."""
    if every is None or (isinstance(every, int) and not isinstance(every, bool) and every > 0):
        return every
    raise LoopError(f"{caller}: `{name}` is a positive int (log every that many steps) or None (do not log), "
                    f"got {every!r}. Pass e.g. {name}=50.")


def group_names(reducers: Reducers) -> tuple[str, ...]:
    """The group of each reducer in logged names: its key in a dict, else its class name (with
    its position when the class comes twice)."""
    if isinstance(reducers, Mapping):
        return tuple(str(k) for k in reducers)
    items = list(reducers) if isinstance(reducers, (list, tuple)) else [reducers]
    names = [type(r).__name__ for r in items]
    return tuple(n if names.count(n) == 1 else f"{n}.{i}" for i, n in enumerate(names))


def scalars_of(names: Sequence[str], items: Sequence[AnyReducer], states: Sequence[object], since: int) -> dict[str, float]:
    """``{"funhooks/<group>/<name>": value}`` of every reducer that has ``scalars``, read from
    its newest step at iteration `since` or later (loggers pass the step's own iteration)."""
    out: dict[str, float] = {}
    for group, reducer, state in zip(names, items, states):
        if isinstance(reducer, Scalars):
            out.update((f"{_PREFIX}/{group}/{name}", value) for name, value in reducer.scalars(state, since=since).items())
    return out


class _EventFile:
    """A TensorBoard event file in `logdir` that holds nothing open: each :meth:`flush` opens
    the file, appends the scalars added since the last one and closes it. No thread is
    started (``SummaryWriter`` starts one per writer and keeps it until ``close()``, which a
    reducer is never told to call), so a run that ends, fails or is abandoned leaves nothing
    behind. The file (``events.out.tfevents.<time>.<host>.<pid>.<random>``, in TensorBoard's
    format, made with the ``tensorboard`` package) is created at the first flush.

    Raises:
        ExtraError: at construction, when tensorboard is not installed.
    """

    def __init__(self, logdir: str | os.PathLike[str]) -> None:
        try:
            from tensorboard.compat.proto import event_pb2, summary_pb2  # type: ignore[import-untyped]
            from tensorboard.summary.writer.record_writer import RecordWriter  # type: ignore[import-untyped]
        except ImportError:
            raise ExtraError(
                "Logged: writing to a log directory needs tensorboard, got it not installed. "
                "Install the extra: pip install 'funhooks[tensorboard]'."
            ) from None
        self._event, self._summary, self._records = event_pb2.Event, summary_pb2.Summary, RecordWriter
        self.logdir = os.fspath(logdir)
        self.path: str | None = None  # made at the first flush
        self._pending: list[bytes] = []

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        """Queue one scalar, written at the next :meth:`flush`."""
        value = self._summary.Value(tag=tag, simple_value=float(scalar_value))
        event = self._event(wall_time=time.time(), step=global_step or 0, summary=self._summary(value=[value]))
        self._pending.append(event.SerializeToString())

    def flush(self) -> None:
        """Append the queued scalars to the file (made, with its version record, the first time)."""
        if not self._pending:
            return
        records = self._pending
        if self.path is None:
            os.makedirs(self.logdir, exist_ok=True)
            name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}."
                    f"{secrets.token_hex(4)}")
            self.path = os.path.join(self.logdir, name)
            records = [self._event(wall_time=time.time(), file_version="brain.Event:2").SerializeToString(), *records]
        with open(self.path, "ab") as file:
            writer = self._records(file)
            for record in records:
                writer.write(record)
        self._pending = []


def _writer(to: object) -> _Writer:
    if isinstance(to, (str, os.PathLike)):
        return _EventFile(to)
    if callable(getattr(to, "add_scalar", None)):
        return to  # type: ignore[return-value]  # add_scalar is there; its signature is the writer's
    raise ReducerError(
        f"Logged: `to` is a log directory or a writer with `add_scalar(tag, value, global_step)`, got {to!r}. "
        "Pass a path, or a torch.utils.tensorboard.SummaryWriter."
    )


def _every(instance: object, attribute: object, every: object) -> None:
    check_log_every(every, "Logged", "every")
    if every is None:
        raise LoopError("Logged: `every` is a positive int (log every that many steps), got None. Pass e.g. every=50.")


@_frozen.frozen
@attrs.frozen(eq=False)
class Logged:
    """Reducers folded as usual whose scalars are also written to TensorBoard as they are computed.

    A reducer itself (give it to ``fh.fit``, ``fh.fold``, ``fh.fold_all``, ``fh.folding`` or a
    trainer callback): its result is the reducers' results in the shape of `reducers`. After
    each train step whose iteration is a multiple of `every` it reads the reducers'
    :class:`Scalars` of that step and writes them with
    ``add_scalar("funhooks/<group>/<layer>/<statistic>", value, iteration)``, the group being
    the key in a dict of reducers (a class name in a list). A reducer that did not record the
    step is not written there: one recording with the same ``every`` (or a divisor of it) is
    written at each of the logger's steps. Nothing is read in between: on CUDA, one host sync
    per write, none per step. The writer is flushed after each write; a log directory gets an
    :class:`_EventFile`, which holds nothing open between writes.

    Args:
        reducers: a dict or a list of reducers (a single reducer gives its result).
        to: a log directory (an :class:`_EventFile` is written there; the ``tensorboard``
            extra), or a writer with ``add_scalar(tag, value, global_step)`` (a
            ``SummaryWriter``, yours to close).
        every: write every that many steps (:data:`_LOG_EVERY`).

    Raises:
        ReducerError: for an entry without the reducer protocol, or a `to` that is neither.
        LoopError: for an `every` that is not a positive int.
        ExtraError: for a log directory without tensorboard installed.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> class Printer:
        ...     def add_scalar(self, tag, value, step):
        ...         print(step, tag, round(value, 3))
        >>> model = nn.Linear(2, 1)
        >>> batches = [(torch.ones(4, 2), torch.zeros(4, 1))] * 3
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.0)
        >>> _ = torch.nn.init.constant_(model.weight, 0.5), torch.nn.init.zeros_(model.bias)
        >>> res = fh.fit(model, batches, nn.functional.mse_loss, opt,
        ...              fh.Logged({"loss": fh.LossCurve()}, Printer(), every=2))
        0 funhooks/loss/loss 1.0
        0 funhooks/loss/ema 1.0
        2 funhooks/loss/loss 1.0
        2 funhooks/loss/ema 1.0
        >>> len(res["loss"])
        3
    """

    reducers: Reducers
    to: _Writer = attrs.field(converter=_writer)
    every: int = attrs.field(default=_LOG_EVERY, kw_only=True, validator=_every)
    _shape: Shape = attrs.field(init=False, repr=False)
    _items: tuple[AnyReducer, ...] = attrs.field(init=False, repr=False)
    _names: tuple[str, ...] = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        shape, items = as_items(self.reducers, "Logged")
        object.__setattr__(self, "_shape", shape)
        object.__setattr__(self, "_items", items)
        object.__setattr__(self, "_names", group_names(self.reducers))

    @property
    def specs(self) -> tuple[Spec, ...]:
        """The reducers' specs (equal ones once)."""
        return tuple(dict.fromkeys(s for r in self._items for s in r.specs))

    @property
    def watches(self) -> tuple[OptimizerWatch, ...]:
        """The reducers' optimizer watches (equal ones once)."""
        return tuple(dict.fromkeys(w for r in self._items for w in watches_of(r)))

    def records(self, iteration: int, training: bool) -> bool:
        """Whether some reducer reads the step's record."""
        wants = records_of(self._items)
        return wants is None or wants(iteration, training)

    def init(self) -> tuple[object, ...]:
        """The reducers' empty states."""
        return tuple(r.init() for r in self._items)

    def step(self, state: tuple[object, ...], step: Step) -> tuple[object, ...]:
        """The reducers advanced by `step`; on a train step whose iteration is a multiple of
        ``every``, their scalars since the last write written."""
        states = tuple(r.step(s, step) for r, s in zip(self._items, state))
        if step.training and step.iteration % self.every == 0:
            values = scalars_of(self._names, self._items, states, step.iteration)
            for tag, value in values.items():
                self.to.add_scalar(tag, value, step.iteration)
            flush = getattr(self.to, "flush", None)
            if callable(flush):
                flush()
        return states

    def result(self, state: tuple[object, ...]) -> Any:
        """The reducers' results, in the shape of `reducers`."""
        return self._shape([r.result(s) for r, s in zip(self._items, state)])
