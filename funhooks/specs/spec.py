"""Specs: frozen values that say where, when and what a hook does. They touch no model.

A spec is *where* (a selector), *when* (an event), *what* (a function) and whether the
function's result is *stored* under a record name (an observer) or *replaces* the value
PyTorch lets that hook replace (an editor). Specs are hashable, so equal specs are
installed once and make natural cache keys; they pickle when their function does.
"""

from __future__ import annotations

import abc
import weakref
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeAlias, TypedDict, TypeGuard, get_args

import attrs
import torch

from funhooks import _frozen, _torch
from funhooks.errors import InterventionError, SpecError

from .selector import Selector, Where, select

__all__ = [
    "EVENTS",
    "Event",
    "Hook",
    "Located",
    "Spec",
    "edit",
    "grads",
    "inputs",
    "observe",
    "outputs",
    "check_nth",
    "check_bools",
    "check_flags",
    "check_fn",
    "record_name",
]

Event: TypeAlias = Literal["forward_pre", "forward", "backward_pre", "backward", "param_grad"]
EVENTS: tuple[Event, ...] = get_args(Event)
"""The hook events, with PyTorch's hook signatures:
``forward_pre`` ``fn(module, args)``, ``forward`` ``fn(module, args, output)``,
``backward_pre`` ``fn(module, grad_output)``, ``backward`` ``fn(module, grad_input,
grad_output)``, ``param_grad`` ``fn(param, grad)``."""

_Role: TypeAlias = Literal["output", "input", "grad", "grad_output", "call", "intervene", "op"]
_ROLES: tuple[_Role, ...] = get_args(_Role)
"""What a spec does: the built-in stores (``output``, ``input``, ``grad`` and fastai's
``grad_output`` tuple) have fast paths; ``call`` runs the spec's function (``fn``);
``intervene`` is an editor whose action is an intervention value that also reads the call's
per-call values (``funhooks.specs.interventions``); ``op`` acts on the operations called inside
the module's forward, as its action says (``funhooks.specs.ops``)."""

Hook: TypeAlias = Literal["forward_pre", "forward", "around", "output_grad", "backward_pre", "backward", "param_grad"]
_HOOKS: tuple[Hook, ...] = get_args(Hook)
_BACKWARD_HOOKS: frozenset[Hook] = frozenset(_HOOKS[3:])
"""How a run reaches a spec, the one field it dispatches on: ``forward_pre`` / ``forward``
around the module's own forward; ``around``, during the module's own forward (the ops it
calls); ``output_grad``, tensor hooks on the outputs (``grads``, whose event is
``backward_pre``, are set up during the forward); ``backward_pre`` / ``backward``, PyTorch's
per-call backward hook; ``param_grad``, hooks on the parameters."""


class _Action(Protocol):
    """What an intervention or op spec does (its ``action``): an ``Intervention``
    (``funhooks.specs.editing``) or an ``OpAction`` (``funhooks.specs.ops``). ``str()`` of it
    renders its arguments for the spec's repr."""

    @property
    def args(self) -> tuple[str, ...]:
        """The names of the ``fh.arg`` placeholders it reads per call."""

    @property
    def nth(self) -> Any:
        """The index of the one selected module it edits (an ``Nth``), or None."""

    @property
    def intervenes(self) -> bool:
        """Whether it edits with an intervention value (whose values are the user's)."""


class _Flags(TypedDict):
    """What a store does with a value before keeping it (the flags of :func:`outputs`)."""

    detach: bool
    cpu: bool
    gather: bool
    clone: bool


class _Memo(weakref.WeakKeyDictionary):
    """A spec's :attr:`Spec.memo`: by model (held weakly), what runs keep of the spec while
    it lives. Deep copies and pickles of the spec start with an empty one."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _Memo, ()

    def __copy__(self) -> _Memo:
        return _Memo()

    def __deepcopy__(self, memo: object) -> _Memo:
        return _Memo()


@_frozen.frozen
@attrs.frozen(repr=False, cache_hash=True)  # hashed by every run's plan lookup
class Spec:
    """A hook as a value: where, when, what, and whether the result is stored or replaces.

    Build specs with the constructors (:func:`outputs`, :func:`inputs`, :func:`grads`,
    :func:`observe`, :func:`edit` and the fastai spellings); change one with
    ``attrs.evolve``. Nothing touches a model until a spec is run by
    :func:`funhooks.with_hooks`, :func:`funhooks.capture` or a training loop.

    Example:
        >>> import funhooks as fh
        >>> spec = fh.outputs("features.*", clone=True)
        >>> spec
        outputs('features.*', clone=True)
        >>> spec == fh.outputs("features.*", clone=True), spec.name, spec.event
        (True, 'output', 'forward')
    """

    where: Selector = attrs.field(converter=select)  # so `attrs.evolve(spec, where="head.*")` works
    event: Event = attrs.field(validator=lambda spec, _, event: _check_event(spec.label, event))
    role: _Role = attrs.field(validator=lambda spec, _, role: _check_role(spec.label, role))
    name: str | None
    fn: Callable[..., Any] | None = None
    """The function a run calls with the hook's arguments (``observe``, ``edit``, ``op_edit``,
    a standard point's read); None for the stores and the interventions."""
    is_edit: bool = False
    detach: bool = True
    cpu: bool = False
    gather: bool = False
    clone: bool = False
    label: str = "observe"  # the constructor's name, for repr and messages only
    labels: tuple[tuple[str, str], ...] = ()
    """``(module path, Record path)`` pairs: the values of those modules are stored (and a
    Record source read) under the Record path instead (a standard point's ``blocks.3.resid_pre``)."""
    shown: str | None = None
    """How repr shows `where` (a standard point's name), None for the selector's repr."""
    action: _Action | None = attrs.field(default=None, kw_only=True)
    """What an intervention or op spec does (``role`` ``intervene``: an ``Intervention``;
    ``op``: an ``OpAction``); None for the others."""
    hook: Hook = attrs.field(init=False)
    """How a run reaches this spec (see :data:`_HOOKS`), derived from `event` and `role`."""
    memo: weakref.WeakKeyDictionary[Any, Any] = attrs.field(factory=_Memo, init=False, eq=False)
    """What runs keep of this spec, by model (held weakly), for as long as the spec lives: the
    plans of a spec holding a value of the user's (an intervention), which no cache beyond
    the spec may keep. Never compared or hashed; a deep copy, a pickle and ``attrs.evolve`` of
    the spec start with an empty one (a shallow copy, equal to the spec, shares it)."""

    @hook.default
    def _hook(self) -> Hook:
        if self.role == "op":
            return "around"
        return "output_grad" if self.role in ("grad", "grad_output") else self.event

    @property
    def args(self) -> tuple[str, ...]:
        """The per-call values the spec reads: the names of its ``fh.arg`` placeholders."""
        return () if self.action is None else self.action.args

    @property
    def nth(self) -> Any:  # an `Nth` (specs/editing.py, which imports this module)
        """The index, among the modules it selects, of the one an intervention spec edits
        (an int, a tensor or an ``fh.arg``); None for every module, and for other specs."""
        return None if self.action is None else self.action.nth

    @property
    def intervenes(self) -> bool:
        """Whether the spec edits with an intervention value (on a module or an op)."""
        return self.action is not None and self.action.intervenes

    @property
    def needs_backward(self) -> bool:
        """True for specs that act during a backward pass (gradients of outputs, module
        backward events, parameter gradients)."""
        return self.hook in _BACKWARD_HOOKS

    def __repr__(self) -> str:
        parts = [repr(self.where) if self.shown is None else self.shown]
        if self.role == "call" and (fn_name := getattr(self.fn, "__name__", repr(self.fn))):  # "": a point's read
            parts.append(fn_name)
            if self.event != "forward":
                parts.append(f"event={self.event!r}")
            if self.name is not None and self.name != getattr(self.fn, "__name__", None):
                parts.append(f"name={self.name!r}")
        if self.action is not None and (shown := str(self.action)):  # the action renders its own arguments
            parts.append(shown)
            if self.role == "op":
                if self.fn is not None:  # an op editor's function
                    parts.append(getattr(self.fn, "__name__", repr(self.fn)))
                if self.name is not None and self.name != getattr(self.action, "default_name", None):
                    parts.append(f"name={self.name!r}")
        if self.role == "grad_output":
            parts.append("grad=True")
        if not self.is_edit:
            defaults = {"detach": True, "cpu": False, "gather": False, "clone": False}
            parts += [f"{k}={getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v]
        return f"{self.label}({', '.join(parts)})"

    def __enter__(self) -> None:
        raise TypeError(
            f"{self.label}: a spec is a value and touches no model, got `with {self!r}:`. "
            "Run it with `with fh.with_hooks(model, spec) as run:` and read `run.stored` "
            "or `run.record`."
        )

    def __exit__(self, *exc: object) -> None:  # pragma: no cover - __enter__ always raises
        return None


class Located(abc.ABC):
    """A where-value that makes the spec a constructor asks for itself, instead of being
    selected as modules are: ``fh.transformer``'s standard points (a module's output, its input,
    a view of either, or an op inside it, stored under the point's own Record path)."""

    @abc.abstractmethod
    def spec(self, label: str, **options: Any) -> Spec:
        """The spec constructor `label` makes at this place, with its `options` (the flags of
        a store, ``intervention=`` and ``op=`` of an intervention); a ``SpecError`` when the
        place has no such spec."""


_SHOWN_PATHS = 8
"""How many of the selected paths an `nth` error lists."""


def check_nth(spec: Spec, nth: object, paths: list[str], caller: str) -> None:
    """An intervention's `nth` (an int, or an integer tensor outside transforms and traces,
    read with one host sync; ints or a 1-d tensor give one per row, ``per_row``) must index
    one of the `paths` its spec selected."""
    row = ""
    if isinstance(nth, (list, tuple)) and all(isinstance(n, int) and not isinstance(n, bool) for n in nth):
        nth = torch.tensor(nth, dtype=torch.long)
    if isinstance(nth, torch.Tensor):
        if nth.ndim > 1 or nth.is_floating_point() or nth.is_complex() or _torch.is_functorch_active() \
                or _torch.is_compiling():
            return  # a batched value cannot be read; a wrong kind is said when the intervention applies
        if nth.ndim:  # one per row
            low, high = (int(x) for x in torch.aminmax(nth)) if len(nth) else (0, 0)
            if 0 <= low and high < len(paths):
                return
            first = int(((nth < 0) | (nth >= len(paths))).nonzero()[0])
            row, nth = f" in row {first}", nth[first]
        nth = int(nth)
    if not isinstance(nth, int) or isinstance(nth, bool) or 0 <= nth < len(paths):
        return
    shown = paths[:_SHOWN_PATHS] + (["..."] if len(paths) > _SHOWN_PATHS else [])
    raise InterventionError(
        f"{caller}: `nth` is the index of a module the selector matched ({len(paths)} here: {shown}), got {nth}{row}, "
        f"for {spec!r}. Pass an `nth` below {len(paths)}."
    )


def check_bools(label: str, **flags: object) -> None:
    """Refuse a flag that is not a bool."""
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise SpecError(f"{label}: `{key}` is a bool, got {value!r}. Pass True or False.")


def check_flags(label: str, *, detach: bool = True, cpu: bool = False, gather: bool = False,
                clone: bool = False) -> _Flags:
    """A store's flags, each refused unless a bool."""
    check_bools(label, detach=detach, cpu=cpu, gather=gather, clone=clone)
    return _Flags(detach=detach, cpu=cpu, gather=gather, clone=clone)


def _is_event(event: object) -> TypeGuard[Event]:
    return event in EVENTS


def _check_event(label: str, event: object) -> Event:
    if not _is_event(event):
        raise SpecError(f"{label}: `event` is one of {list(EVENTS)}, got {event!r}. Pick one of those.")
    return event


def _check_role(label: str, role: str) -> None:
    if role not in _ROLES:
        raise SpecError(f"{label}: a spec's `role` is one of {list(_ROLES)}, got {role!r}.")


def check_fn(label: str, fn: object, arg: str = "fn") -> Callable[..., object]:
    if not callable(fn):
        raise SpecError(
            f"{label}: `{arg}` is a callable taking PyTorch's hook arguments, got {fn!r}. "
            "Pass a function such as `lambda module, args, output: output.mean()`."
        )
    try:
        hash(fn)
    except TypeError:
        raise SpecError(
            f"{label}: `{arg}` is hashable (a spec is a value, compared and cached by its function), got an "
            f"unhashable {type(fn).__name__}. Make it hashable (e.g. `@attrs.frozen` or "
            "`@dataclasses.dataclass(frozen=True)`), or pass a function."
        ) from None
    return fn


def record_name(label: str, fn: Callable[..., object], name: str | None) -> str:
    if name is None:
        name = getattr(fn, "__name__", None)
        if name is None:
            raise SpecError(
                f"{label}: the record name defaults to `fn.__name__`, got {fn!r} which has none. "
                "Pass `name=`."
            )
    if not isinstance(name, str) or not name:
        raise SpecError(f"{label}: `name` is a non-empty str, got {name!r}. Pass a record name.")
    return name


def outputs(where: Where | Located, *, detach: bool = True, cpu: bool = False, gather: bool = False, clone: bool = False) -> Spec:
    """Store each selected module's output under the record name ``"output"``.

    Args:
        where: a selector (see :func:`funhooks.select`).
        detach: store ``output.detach()`` (no autograd graph kept alive).
        cpu: move stored tensors to the CPU.
        gather: all-gather stored tensors across a ``torch.distributed`` group (a ``DTensor``,
            such as an FSDP2 gradient shard: its ``full_tensor()``).
        clone: store a copy, safe from later in-place ops (costs one copy per call).

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        >>> with fh.with_hooks(model, fh.outputs("0")) as run:
        ...     y = model(torch.ones(1, 3))
        >>> run.record["0"]["output"].shape
        torch.Size([1, 2])
    """
    flags = check_flags("outputs", detach=detach, cpu=cpu, gather=gather, clone=clone)
    if isinstance(where, Located):
        return where.spec("outputs", **flags)
    return Spec(where=select(where), event="forward", role="output", name="output", label="outputs", **flags)


def inputs(where: Where | Located, *, detach: bool = True, cpu: bool = False, gather: bool = False, clone: bool = False) -> Spec:
    """Store each selected module's inputs as ``(args, kwargs)`` under ``"input"``.

    Inputs are taken before the module runs, so a module that changes its input in place
    (``ReLU(inplace=True)``) is caught: pass ``clone=True`` to keep the values it received.

    Args:
        where: a selector.
        detach, cpu, gather, clone: as for :func:`outputs`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> with fh.with_hooks(model, fh.inputs("0")) as run:
        ...     y = model(torch.ones(1, 3))
        >>> args, kwargs = run.record["0"]["input"]
        >>> args[0].shape, kwargs
        (torch.Size([1, 3]), {})
    """
    flags = check_flags("inputs", detach=detach, cpu=cpu, gather=gather, clone=clone)
    if isinstance(where, Located):
        return where.spec("inputs", **flags)
    return Spec(where=select(where), event="forward_pre", role="input", name="input", label="inputs", **flags)


def grads(where: Where | Located, *, detach: bool = True, cpu: bool = False, gather: bool = False, clone: bool = False) -> Spec:
    """Store the gradient with respect to each selected module's output under ``"grad"``.

    The value has the structure of the output (a tensor for a tensor output). It is taken
    with a tensor hook on the output, so it is right even when an in-place op follows the
    module (where module backward hooks fail). Outputs that need no grad store nothing.

    Args:
        where: a selector.
        detach, cpu, gather, clone: as for :func:`outputs`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> with fh.with_hooks(model, fh.grads("0")) as run:
        ...     model(torch.ones(1, 3)).sum().backward()
        >>> run.record["0"]["grad"]
        tensor([[1., 1.]])
    """
    flags = check_flags("grads", detach=detach, cpu=cpu, gather=gather, clone=clone)
    if isinstance(where, Located):
        return where.spec("grads", **flags)
    return Spec(where=select(where), event="backward_pre", role="grad", name="grad", label="grads", **flags)


def observe(
    where: Where | Located,
    fn: Callable[..., object],
    *,
    event: str = "forward",
    name: str | None = None,
    detach: bool = True,
    cpu: bool = False,
    gather: bool = False,
    clone: bool = False,
) -> Spec:
    """Store ``fn(module, *hook_args)`` under `name` (default ``fn.__name__``).

    The hook arguments are detached / moved / gathered / cloned as flagged *before* `fn`
    sees them, as fastai's ``Hook`` does.

    Args:
        where: a selector, or a standard point (``fh.transformer.points``): `fn` then gets
            ``(module, args, value)``, the point's value in place of the output (docs/transformers.md).
        fn: called with PyTorch's hook arguments for `event` (see :data:`EVENTS`).
        event: one of :data:`EVENTS`.
        name: the record name; defaults to ``fn.__name__``.
        detach, cpu, gather, clone: applied to the hook arguments.

    Returns:
        A Spec.

    Raises:
        SpecError: for a non-callable `fn`, an unknown `event` or a bad flag.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> def mean(module, args, output):
        ...     return output.mean()
        >>> model = nn.Sequential(nn.Linear(3, 2))
        >>> with fh.with_hooks(model, fh.observe(nn.Linear, mean)) as run:
        ...     y = model(torch.ones(1, 3))
        >>> bool(run.record["0"]["mean"] == y.mean())
        True
    """
    check_fn("observe", fn)
    checked = _check_event("observe", event)
    flags = check_flags("observe", detach=detach, cpu=cpu, gather=gather, clone=clone)
    if isinstance(where, Located):
        return where.spec("observe", fn=fn, event=event, name=name, **flags)
    return Spec(where=select(where), event=checked, role="call", name=record_name("observe", fn, name), fn=fn,
                label="observe", **flags)


def edit(where: Where | Located, fn: Callable[..., object], *, event: str = "forward", name: str | None = None) -> Spec:
    """Replace a value with ``fn``'s result: the output (``forward``), the args
    (``forward_pre``), ``grad_output`` (``backward_pre``), ``grad_input`` (``backward``) or a
    parameter's gradient (``param_grad``). Returning ``None`` leaves the value as it was.

    Args:
        where: a selector, or a standard point (``fh.transformer.points``): `fn` then gets
            ``(module, args, value)`` and returns the point's new value (docs/transformers.md).
        fn: called with PyTorch's hook arguments for `event`.
        event: one of :data:`EVENTS`.
        name: a label for messages; editors store nothing.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 2), nn.ReLU())
        >>> zero = fh.edit("0", lambda module, args, output: torch.zeros_like(output))
        >>> with fh.with_hooks(model, zero):
        ...     y = model(torch.ones(1, 3))
        >>> y
        tensor([[0., 0.]])
    """
    check_fn("edit", fn)
    checked = _check_event("edit", event)
    if name is not None and (not isinstance(name, str) or not name):
        raise SpecError(f"edit: `name` is a non-empty str or None, got {name!r}. Pass a label.")
    if isinstance(where, Located):
        return where.spec("edit", fn=fn, event=event, name=name)
    return Spec(where=select(where), event=checked, role="call", name=name, fn=fn, is_edit=True, label="edit")
