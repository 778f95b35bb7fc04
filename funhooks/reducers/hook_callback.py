"""HookCallback: fastai's ``HookCallback`` as a pure fold reducer.

A frozen value (see :mod:`funhooks.training.folds` for the protocol): its one observer spec runs
``hook(module, input, output)`` (or the backward hook's arguments) on the selected modules,
``step`` adds one recorded train step's values to an immutable state, ``result`` gives
fastai's ``hooks.stored`` per step. ``every=k`` records the train iterations with
``iteration % k == 0`` (``ceil(n / k)`` of ``n``); under :func:`funhooks.fit` the others run
with the hooks paused.

Cost: whatever ``hook`` costs, per selected module call; the state keeps its return values
(on the CPU by default, fastai's ``cpu=True``) for every recorded step.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any, NamedTuple, TypeAlias, TypeVar

import attrs
import torch

from funhooks import _frozen
from funhooks.errors import ReducerError
from funhooks.specs.selector import Selector
from funhooks.specs.spec import Spec, observe
from funhooks.training.step import Step

from . import _shared

__all__ = ["HookCallback"]

T = TypeVar("T")


class _Entry(NamedTuple):
    """One recorded step: its iteration and the hook's values, in module order."""

    iteration: int
    values: list[Any]


_State: TypeAlias = "_shared.Cons[_Entry]"
"""One :class:`_Entry` per recorded step, newest on top."""


def _check_hook(instance: object, attribute: attrs.Attribute[T], hook: T) -> None:
    if not callable(hook):
        raise ReducerError(
            f"HookCallback: `hook` is a callable `hook(module, input, output)`, got {hook!r}. Pass a function."
        )


def _check_name(instance: object, attribute: attrs.Attribute[T], name: T) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ReducerError(
            f"HookCallback: `name` is a non-empty str or None, got {name!r}. "
            "Pass the record name, or None for the hook's __name__."
        )



@_frozen.frozen
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
    modules: Selector | None = attrs.field(default=None, converter=_shared.to_selector)
    every: int | None = attrs.field(default=None, validator=_shared.check_every("HookCallback"))
    is_forward: bool = attrs.field(default=True, validator=_shared.check_bool("HookCallback"))
    detach: bool = attrs.field(default=True, validator=_shared.check_bool("HookCallback"))
    cpu: bool = attrs.field(default=True, validator=_shared.check_bool("HookCallback"))
    include_paramless: bool = attrs.field(default=False, validator=_shared.check_bool("HookCallback"))
    name: str | None = attrs.field(default=None, kw_only=True, validator=_check_name)

    @property
    def record_name(self) -> str:
        """The name its values are stored under in each Step's record."""
        return self.name or str(getattr(self.hook, "__name__", type(self.hook).__name__))

    @property
    def specs(self) -> tuple[Spec, ...]:
        """One observer spec on the selected modules."""
        event = "forward" if self.is_forward else "backward"
        where = _shared.where(self.modules, self.include_paramless)
        return (observe(where, self.hook, event=event, name=self.record_name, detach=self.detach, cpu=self.cpu),)

    def records(self, iteration: int, training: bool) -> bool:
        """True for the train iterations this callback records."""
        return _shared.records(self.every, iteration, training)

    def init(self) -> _State:
        """The empty state."""
        return ()

    def step(self, state: _State, step: Step) -> _State:
        """Add the step's hook values when the step is recorded."""
        if not _shared.records(self.every, step.iteration, step.training):
            return state
        values = _shared.last_calls(step.record, self.record_name, "HookCallback")
        return (state, _Entry(step.iteration, values))

    def merge(self, a: _State, b: _State) -> _State:
        """The state of two disjoint chunks of steps, in iteration order."""
        return _shared.roll(sorted(_shared.unroll(a) + _shared.unroll(b), key=lambda entry: entry.iteration))

    def scalars(self, state: _State, *, since: int = 0) -> dict[str, float]:
        """``{"<i>/<record name>": value}`` of the newest recorded step, when its iteration is
        `since` or later (else ``{}``): each hook value that is a real number or a one-element
        tensor, `i` its module's index (as in ``result``); other values are left out."""
        last = _shared.newest(state, since)
        if not last:
            return {}
        return {f"{i}/{self.record_name}": float(v) for i, v in enumerate(last[1].values) if _is_scalar(v)}

    def result(self, state: _State) -> tuple[list[Any], ...]:
        """One list of hook values per recorded step."""
        return tuple(entry.values for entry in _shared.unroll(state))


def _is_scalar(value: object) -> bool:
    """A hook value ``scalars`` gives: a real number (not a bool) or a one-element tensor."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
