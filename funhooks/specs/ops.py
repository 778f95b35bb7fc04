"""Hook points inside a forward: specs on the torch ops a selected module calls.

``fh.op_outputs(where, op)`` stores the result of every call of `op` that the selected
modules' own code makes (the attention pattern a ``softmax`` returns), ``fh.op_inputs`` its
positional arguments (``q`` and ``k`` of a ``matmul``), ``fh.op_edit`` replaces its result;
interventions (``fh.patch`` ...) take ``op=`` too. Values go in the same Record, under the
module's path and the op's name: ``rec["h.0.attn"]["softmax"]``, one value per op call.

An op is a torch function or its name, and every spelling of it matches: ``torch.add``,
``Tensor.add`` and ``a + b`` are all ``"add"``. ``fh.op(name, call=k)`` takes only the k-th
call in each module call (from 0); ``deep=True`` counts ops of its submodules too. A module
call that skips the op records nothing for it; an op spec that matched nothing in every call
of its module in a run raises :class:`~funhooks.SelectorError` when the run ends, listing the
ops it called: the model needs no change, and a wrong guess is said.

Cost: nothing for modules no op spec selects. While a selected module's forward runs,
every torch function it calls passes through one Python ``__torch_function__`` (about 1.5 µs
each here); see ``funhooks/runs/_core/op_mode.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, ClassVar, Literal, TypeAlias

import attrs

from funhooks import _frozen
from funhooks.errors import SpecError

from .editing import Intervention, Nth
from .selector import Where, select
from .spec import Located, Spec, check_bools, check_flags, check_fn

__all__ = ["OP_NAMES", "PROPERTY_READS", "At", "Derived", "Op", "OpAction", "OpLike", "Reading", "around_spec", "as_op",
           "op", "op_edit", "op_inputs", "op_name", "op_outputs"]


OP_NAMES: dict[Callable[..., object], str] = {}
"""Each torch function seen so far -> its op name (:func:`op_name` fills it; a hot loop reads
it with one ``OP_NAMES.get(func)`` and calls :func:`op_name` on a miss)."""
_REFLECTED = frozenset({"add", "sub", "mul", "matmul", "truediv", "floordiv", "div", "pow", "mod", "and", "or",
                        "xor", "lshift", "rshift"})
"""Operators whose ``__r<op>__`` / ``__i<op>__`` spellings name the same op."""
_ALIASES = {"truediv": "div"}
PROPERTY_READS: set[str] = set()
"""Names of property reads (``t.shape``, ``t.dtype``): not listed as ops a module called."""
OpLike: TypeAlias = "str | Callable[..., object] | Op"
"""An op as the op specs take it: its name, a torch function, or an :class:`Op`."""


def op_name(func: Callable[..., object]) -> str:
    """The op a torch function is: its name, with operator spellings folded
    (``__add__``/``__radd__`` -> ``add``, ``__iadd__`` -> ``add_``, ``__truediv__`` -> ``div``)."""
    found = OP_NAMES.get(func)
    if found is not None:
        return found
    name = getattr(func, "__name__", None) or type(func).__name__
    if name == "__get__":  # a property read: name it by the property
        name = getattr(getattr(func, "__self__", None), "__name__", name)
        PROPERTY_READS.add(name)
    elif name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        if core[:1] in ("r", "i") and core[1:] in _REFLECTED:
            core = _ALIASES.get(core[1:], core[1:]) + ("_" if core[0] == "i" else "")
        name = _ALIASES.get(core, core)
    OP_NAMES[func] = name
    return name


@_frozen.frozen
@attrs.frozen(repr=False)
class Op:
    """Which calls of a torch op a spec takes: every call of `name` the module's own code
    makes, or only the `call`-th in each module call; ``deep`` counts its submodules' too.

    Example:
        >>> import torch, funhooks as fh
        >>> fh.op(torch.matmul, call=1)
        fh.op('matmul', call=1)
        >>> fh.op("softmax") == fh.op(torch.nn.functional.softmax)
        True
    """

    name: str
    call: int | None = None
    deep: bool = False

    def __repr__(self) -> str:
        extra = (f", call={self.call}" if self.call is not None else "") + (", deep=True" if self.deep else "")
        return f"fh.op({self.name!r}{extra})"

    def __str__(self) -> str:
        return repr(self.name) if self.call is None and not self.deep else repr(self)

    @property
    def reads(self) -> tuple[str, ...]:
        """The torch ops whose calls it takes: its own name."""
        return (self.name,)


At: TypeAlias = Callable[[str, Any], Any]
"""How a :class:`Derived` value hands each of its points to the op specs: ``at(point, value)``
runs the specs taking `point` (the :attr:`Op.name` of a derived op) and returns the value the
computation goes on with (edited, or `value` itself)."""


class Reading(enum.Enum):
    """How one module call gives a :class:`Derived` value (:meth:`Derived.reading`)."""

    OPS = enum.auto()
    """Off the torch functions it calls, through the op mode: always possible."""
    OUTPUT = enum.auto()
    """Off the call's output, the call made as it is."""
    TWIN = enum.auto()
    """Off the output of the same forward run on a twin of the module made for the call
    (a Hugging Face attention module's eager twin, ``eager_weights``)."""


@_frozen.frozen
@attrs.frozen(repr=False)
class Derived(Op):
    """An op value read off the calls of other torch ops (``fh.attention_pattern`` is read off
    ``softmax`` under eager attention and computed from ``scaled_dot_product_attention``'s
    arguments under SDPA): the op mode takes the calls of the ops in ``reads`` and lets
    :meth:`run` compute each one through its points, where op specs store and edit.

    A subclass sets ``reads``, ``hint`` (what to do when no call of those ops was made) and
    :meth:`run`; ``name`` is the point it stands for (and its record name)."""

    READS: ClassVar[tuple[str, ...]] = ()
    HINT: ClassVar[str] = ""
    """The fix an "op spec matched nothing" error gives."""

    @property
    def reads(self) -> tuple[str, ...]:
        """The torch ops whose calls it is read off."""
        return self.READS

    def __repr__(self) -> str:
        extra = (f", call={self.call}" if self.call is not None else "") + (", deep=True" if self.deep else "")
        return f"fh.op(fh.{self.name}{extra})" if extra else f"fh.{self.name}"

    def __str__(self) -> str:
        return repr(self)

    def run(self, op: str, func: Callable[..., Any], args: tuple, kwargs: dict, at: At) -> Any:
        """``func(*args, **kwargs)`` (a call of the op named `op`, one of ``reads``), computed
        through the points of this value's kind, each handed to `at`."""
        raise NotImplementedError

    def in_output(self, cls: type) -> bool:
        """Whether calls of modules of class `cls` may give this value in their output, so
        that a run that only records it may read it there (:meth:`reading`) instead of
        watching the ops; asked when a plan is made."""
        return False

    def reading(self, module: Any, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Reading:
        """How the call ``inner(*args, **kwargs)`` of `module` gives this value; asked only
        where :meth:`in_output` said it may, and only for runs that record the value alone."""
        return Reading.OPS

    def read(self, reading: Reading, module: Any, inner: Callable[..., Any], args: tuple, kwargs: dict,
             shared: dict) -> tuple[Any, Any]:
        """The call's output and this value, read the way `reading` (not ``OPS``) says.
        `shared`: a dict the calls of one run share (what one call made that the next may
        reuse), alive as long as the run."""
        raise NotImplementedError


def op(fn: OpLike, *, call: int | None = None, deep: bool = False) -> Op:
    """Name an op for the op specs: a torch function (``torch.matmul``,
    ``torch.nn.functional.softmax``, ``torch.Tensor.add``) or its name (``"matmul"``).

    Args:
        fn: the function or its name; every spelling of the op matches (``"add"`` is
            ``torch.add``, ``Tensor.add`` and ``a + b``; ``a += b`` is ``"add_"``), or an op
            value such as ``fh.attention_pattern``.
        call: take only the `call`-th call of the op in each call of the module (from 0).
        deep: also take calls made inside the module's submodules.

    Returns:
        An :class:`Op`.

    Raises:
        SpecError: for a bad name, `call` or `deep`.

    Example:
        >>> import torch, funhooks as fh
        >>> fh.op(torch.add), fh.op("scaled_dot_product_attention", deep=True)
        (fh.op('add'), fh.op('scaled_dot_product_attention', deep=True))
    """
    return as_op("op", fn, call=call, deep=deep)


def as_op(label: str, fn: object, *, call: int | None = None, deep: bool = False) -> Op:
    """`fn` (an :class:`Op`, a torch function or a name) as an :class:`Op`; errors name `label`."""
    if isinstance(fn, Op) and call is None and not deep:
        return fn
    if isinstance(fn, str):
        name = fn
    elif isinstance(fn, Op):
        name = fn.name
    elif callable(fn):
        name = op_name(fn)
    else:
        name = None
    if not name or not isinstance(name, str) or not name.replace(".", "_").isidentifier():
        raise SpecError(
            f"{label}: an op is a torch function or its name, got {fn!r}. Pass e.g. `torch.matmul`, "
            "`torch.nn.functional.softmax` or \"scaled_dot_product_attention\"."
        )
    if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 0):
        raise SpecError(f"{label}: `call` is None or an int >= 0, got {call!r}. Pass the call's index in the module call.")
    check_bools(label, deep=deep)
    return attrs.evolve(fn, call=call, deep=deep) if isinstance(fn, Op) else Op(name, call, deep)


_OpKind: TypeAlias = Literal["output", "input", "edit", "intervene"]
"""What an op spec does with each call of its op it takes."""


@_frozen.frozen
@attrs.frozen(repr=False)
class OpAction:
    """The action of an op spec: its :class:`Op` and what it does with each call it takes
    (``kind``: store the ``output`` or the ``input``, ``edit`` with the spec's function, or
    ``intervene`` with an intervention value)."""

    op: Op
    kind: _OpKind
    intervention: Intervention | None = None
    """The intervention value, for ``intervene``."""

    @property
    def default_name(self) -> str | None:
        """The record name a storing op spec uses unless given one."""
        return {"output": self.op.name, "input": f"{self.op.name}.input"}.get(self.kind)

    @property
    def args(self) -> tuple[str, ...]:
        """The per-call values it reads (an intervention's ``fh.arg`` names)."""
        return () if self.intervention is None else self.intervention.args

    @property
    def nth(self) -> Nth:
        """An intervention's `nth` (None for the other kinds)."""
        return None if self.intervention is None else self.intervention.nth

    @property
    def intervenes(self) -> bool:
        """Whether it edits with an intervention value."""
        return self.intervention is not None

    def __str__(self) -> str:
        if self.intervention is not None:
            return ", ".join(part for part in (str(self.intervention), f"op={self.op}") if part)
        return str(self.op)


def around_spec(label: str, where: Where | Located, op_: OpLike, kind: _OpKind, fn: Callable[..., object] | None = None,
                *, intervention: Intervention | None = None, name: str | None = None, **flags: bool) -> Spec:
    """An op spec: `kind` (``output``, ``input``, ``edit`` with `fn`, ``intervene`` with
    `intervention`) on `op_` in the modules `where` selects."""
    if isinstance(where, Located):
        return where.spec(label, op=op_)
    action = OpAction(as_op(label, op_), kind, intervention)
    stores = kind in ("output", "input")
    if kind == "input" and isinstance(action.op, Derived):
        raise SpecError(f"{label}: a derived op such as {action.op!r} is a value with no inputs of its own, got it. "
                        f"Store its value with `fh.op_outputs`, or the inputs of the ops it is read off "
                        f"({', '.join(map(repr, action.op.reads))}).")
    if name is not None and (not isinstance(name, str) or not name):
        raise SpecError(f"{label}: `name` is a non-empty str or None, got {name!r}. Pass a record name.")
    record = (name or action.default_name) if stores else name
    return Spec(where=select(where), event="forward", role="op", name=record, fn=fn, action=action,
                is_edit=not stores, label=label, **check_flags(label, **flags))


def op_outputs(where: Where | Located, op: OpLike, *, name: str | None = None, detach: bool = True,
               cpu: bool = False, clone: bool = False) -> Spec:
    """Store the result of each call of `op` made by the selected modules, under `name`
    (default: the op's name), one value per op call.

    Args:
        where: a selector (the modules whose forward calls the op).
        op: a torch function, its name, or :func:`op` (``call=``, ``deep=``).
        name: the record name.
        detach, cpu, clone: as for :func:`funhooks.outputs`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> class Attention(nn.Module):
        ...     def forward(self, q, k):
        ...         return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ k
        >>> attn = Attention()
        >>> with fh.with_hooks(attn, fh.op_outputs("", "softmax")) as run:
        ...     y = attn(torch.randn(2, 5, 4), torch.randn(2, 5, 4))
        >>> run.record[""]["softmax"].shape
        torch.Size([2, 5, 5])
    """
    return around_spec("op_outputs", where, op, "output", name=name, detach=detach, cpu=cpu, clone=clone)


def op_inputs(where: Where | Located, op: OpLike, *, name: str | None = None, detach: bool = True,
              cpu: bool = False, clone: bool = False) -> Spec:
    """Store the positional arguments of each call of `op` made by the selected modules, as
    a tuple, under `name` (default ``"<op>.input"``); keyword arguments are not stored.

    Args:
        where: a selector.
        op: a torch function, its name, or :func:`op`.
        name: the record name.
        detach, cpu, clone: as for :func:`funhooks.inputs`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Linear(3, 3)                   # F.linear inside nn.Linear.forward
        >>> with fh.with_hooks(model, fh.op_inputs("", "linear")) as run:
        ...     y = model(torch.ones(1, 3))
        >>> x, weight, bias = run.record[""]["linear.input"]
        >>> x.shape, weight is not None
        (torch.Size([1, 3]), True)
    """
    return around_spec("op_inputs", where, op, "input", name=name, detach=detach, cpu=cpu, clone=clone)


def op_edit(where: Where | Located, op: OpLike, fn: Callable[..., object], *,
            name: str | None = None) -> Spec:
    """Replace the result of each call of `op` made by the selected modules with
    ``fn(module, args, kwargs, output)`` (``None`` leaves it as it was); the rest of the
    module's forward computes with the new value.

    Args:
        where: a selector.
        op: a torch function, its name, or :func:`op`.
        fn: called with the module, the op's arguments and its result.
        name: a label for messages.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Softmax(dim=-1))
        >>> def uniform(module, args, kwargs, output):
        ...     return torch.full_like(output, 1 / output.shape[-1])
        >>> with fh.with_hooks(model, fh.op_edit("0", "softmax", uniform)):
        ...     y = model(torch.randn(1, 4))
        >>> y
        tensor([[0.2500, 0.2500, 0.2500, 0.2500]])
    """
    check_fn("op_edit", fn)
    return around_spec("op_edit", where, op, "edit", fn, name=name)
