"""Interventions: specs that change what a module, or an op inside it, computes.

``fh.patch`` replaces a value (with a tensor, or with what a Record of another run stored at
the same module: activation patching), ``fh.steer`` adds a vector, ``fh.scale`` multiplies,
``fh.ablate`` zeroes or puts a mean in place. Each is a frozen :class:`~funhooks.Spec`
built on ``edit``: composable in lists, usable in ``with_hooks``, ``capture`` and
``functional``, and under the one editor rule (a recording of the same call sees the
edited value). Options shared by all of them:

- ``index`` / ``dim``: edit only these positions along `dim` (default 1, the position of a
  ``(batch, position, ...)`` activation); an int, ints, a bool mask or a tensor, or during
  ``fh.generate`` the positions of some decode steps, ``fh.steps(k, None)``;
- ``nth``: edit only the `nth` module the selector matched (in module order), so one spec
  over ``"h.*"`` can patch a different layer per call;
- ``element``: for a module returning a tuple, list or dict, the item edited (default 0);
  the rest of the output is passed on untouched;
- ``op``: edit an op's result inside the module instead of the module's output;
- ``per_row=True``: ``nth``, ``index`` and a steer's ``scale`` give one entry per row (dim 0)
  of the batch, ints or a 1-d tensor, so row b is edited at module ``nth[b]``, position
  ``index[b]`` only: a sweep as one batched forward of the input repeated once per patch.

**Per-call values.** Any value, ``index`` and ``nth`` can be ``fh.arg(name)``: the value
then comes from the keyword argument `name` of the function ``fh.capture`` /
``fh.functional`` return, so ``torch.func.vmap`` over it runs a whole sweep in one call.

An ``index`` outside ``dim``, an ``nth`` past the modules matched (refused when the plan is
made, or per call), ``element`` on a tensor output, a complex value into a real output and a
per-call value of the wrong kind raise :class:`~funhooks.InterventionError`. Under ``vmap`` a
batched ``index`` / ``nth`` cannot be read: one out of range edits nothing there.

Cost: per edited call, one new tensor of the edited value's size (``torch.where`` when
``index``/``nth`` is given); outside ``vmap`` and ``torch.compile`` a tensor ``index`` or
``nth`` is range-checked with one small comparison read on the host. An intervention's plan
is made per ``with_hooks`` block (a capture function makes it once): no cache keeps a value
it holds alive once the spec, and the run or capture function using it, are gone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch

from funhooks.errors import SpecError
from funhooks.records.record import Record

from .editing import Arg, Index, Intervention, Nth, Operand, Source, is_number, show
from .ops import OpLike, around_spec, as_op
from .selector import Where, select
from .spec import Located, Spec
from .decoding import Steps

__all__ = ["Arg", "Intervention", "ablate", "arg", "patch", "scale", "steer"]

Tensor = torch.Tensor
_V = TypeVar("_V")


def arg(name: str) -> Arg:
    """A placeholder for a value given per call: ``f(x, name=value)`` where
    ``f = fh.capture(model, specs)``. ``torch.func.vmap`` can map over it.

    Args:
        name: the keyword; not one the model's ``forward`` takes.

    Returns:
        An :class:`Arg`.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> f = fh.capture(model, fh.scale("0", fh.arg("k")))
        >>> ks = torch.tensor([0.0, 1.0, 2.0])
        >>> out, _ = torch.func.vmap(lambda k: f(torch.ones(1, 2), k=k))(ks)
        >>> out.shape, bool((out[0] == 0).all())
        (torch.Size([3, 1, 2]), True)
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise SpecError(f"arg: `name` is a keyword argument name, got {name!r}. Pass e.g. 'clean' or 'pos'.")
    return Arg(name)


# -- the constructors ----------------------------------------------------------------------------

def _checked(label: str, *, index: object, dim: object, nth: object, element: object, name: object,
             per_row: object) -> Nth:
    """Refuses an argument of the wrong kind; returns `nth`, a tensor where ``per_row`` gives ints."""
    if not isinstance(per_row, bool):
        raise SpecError(f"{label}: `per_row` is a bool, got {per_row!r}. Pass True to give `nth`, `index` and a "
                        "steer's `scale` one entry per row of the batch.")
    if per_row and isinstance(nth, (list, tuple)) and nth and all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nth):
        nth = torch.tensor(nth)  # one module per row: checked against the modules matched like a tensor
    if per_row and dim == 0:
        raise SpecError(f"{label}: `dim` is the position axis, which is not the rows' (dim 0) with `per_row=True`, "
                        f"got {dim!r}. Pass the dimension holding the positions.")
    ints = isinstance(index, Sequence) and not isinstance(index, str) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in index)
    if not (index is None or ints or isinstance(index, (Tensor, Arg, Steps)) or (isinstance(index, int) and not isinstance(index, bool))):
        raise SpecError(f"{label}: `index` is None, an int, a sequence of ints, a tensor, `fh.arg(name)` or "
                        f"`fh.steps(...)`, got "
                        f"{index!r}. Pass the positions to edit along `dim`.")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise SpecError(f"{label}: `dim` is an int, got {dim!r}. Pass the dimension holding the positions.")
    if not (nth is None or isinstance(nth, (Tensor, Arg)) or (isinstance(nth, int) and not isinstance(nth, bool) and nth >= 0)):
        raise SpecError(f"{label}: `nth` is None, an int >= 0, a tensor or `fh.arg(name)`, got {nth!r}. Pass the "
                        "index of the module to edit among those the selector matches.")
    if isinstance(element, bool) or not isinstance(element, (int, str)):
        raise SpecError(f"{label}: `element` is an int or a str, got {element!r}. Pass the index or key of the "
                        "item to edit in a tuple, list or dict output.")
    if name is not None and (not isinstance(name, str) or not name):
        raise SpecError(f"{label}: `name` is a non-empty str or None, got {name!r}. Pass the record name to read.")
    return nth


def _checked_value(label: str, arg_name: str, value: _V, *, record: bool = True, none: bool = False) -> _V:
    kinds = (Tensor, Arg, Record) if record else (Tensor, Arg)
    if isinstance(value, kinds) or is_number(value) or (none and value is None):
        return value
    what = "a tensor, a number" + (", a Record" if record else "") + " or `fh.arg(name)`" + (" or None" if none else "")
    raise SpecError(f"{label}: `{arg_name}` is {what}, got {show(value)}. Pass one of those.")


def _spec(label: str, where: Where | Located, intervention: Intervention, op: OpLike | None) -> Spec:
    if isinstance(where, Located):
        return where.spec(label, intervention=intervention, op=op)
    if op is None:
        return Spec(where=select(where), event="forward", role="intervene", name=None, action=intervention, is_edit=True,
                    label=label)
    return around_spec(label, where, op, "intervene", intervention=intervention)


def _named(name: str | None, op: OpLike | None) -> str:
    """The record name a Record source is read at: `name`, else the op's, else ``output``."""
    if name is not None:
        return name
    return "output" if op is None else as_op("patch", op).name


def patch(where: Where | Located, value: Source, *, index: Index = None, dim: int = 1, nth: Nth = None, element: int | str = 0,
          name: str | None = None, op: OpLike | None = None, per_row: bool = False) -> Spec:
    """Replace each selected module's output (or `op`'s result inside it) with `value`.

    `value` is a tensor or number broadcast to the output's shape, or a Record: the value it
    stored at the same module (activation patching from a clean run into a corrupted one;
    a module called several times takes the Record's calls in order), or ``fh.arg(name)``
    for either, given per call.

    Args:
        where: a selector.
        value: a tensor, a number, a Record, or ``fh.arg(name)``.
        index, dim: patch only these positions along `dim` (see :mod:`funhooks.specs.interventions`).
        nth: patch only the `nth` module the selector matched, in module order.
        element: the item of a tuple, list or dict output to patch.
        name: the record name read from a Record (default ``"output"``, or the op's name).
        op: patch the result of this op inside the module (see :func:`funhooks.op`).
        per_row: `nth` and `index` give one entry per row of the batch (ints or a 1-d
            tensor; an int is every row's): row b is patched at module ``nth[b]``, position
            ``index[b]`` only.

    Returns:
        A Spec.

    Raises:
        SpecError: for an argument of the wrong kind. When called: InterventionError for a
            value that does not fit, or a Record without the module.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
        >>> clean, corrupt = torch.ones(1, 3), torch.zeros(1, 3)
        >>> _, rec = fh.capture(model, fh.outputs("0"))(clean)
        >>> with fh.with_hooks(model, fh.patch("0", rec)):
        ...     patched = model(corrupt)
        >>> torch.equal(patched, model(clean))
        True
    """
    nth = _checked("patch", index=index, dim=dim, nth=nth, element=element, name=name, per_row=per_row)
    value = _checked_value("patch", "value", value)
    return _spec("patch", where, Intervention("patch", value, index, dim, nth, element, _named(name, op),
                                                  per_row=per_row), op)


def steer(where: Where | Located, vector: Operand, *, scale: Operand = 1.0, index: Index = None, dim: int = 1,
          nth: Nth = None, element: int | str = 0, op: OpLike | None = None, per_row: bool = False) -> Spec:
    """Add ``scale * vector`` to each selected module's output (a steering vector).

    Args:
        where: a selector.
        vector: a tensor broadcast to the output (e.g. ``(d_model,)``), or ``fh.arg(name)``.
        scale: a number, a tensor or ``fh.arg(name)``; with `per_row`, a 1-d tensor is one
            scale per row of the batch (a dose-response curve in one forward).
        index, dim, nth, element, op, per_row: as for :func:`patch`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Identity())
        >>> with fh.with_hooks(model, fh.steer("0", torch.tensor([1.0, 0.0]), scale=2.0)):
        ...     y = model(torch.zeros(2, 3, 2))
        >>> y[0]
        tensor([[2., 0.],
                [2., 0.],
                [2., 0.]])
    """
    nth = _checked("steer", index=index, dim=dim, nth=nth, element=element, name=None, per_row=per_row)
    vector = _checked_value("steer", "vector", vector, record=False)
    scale = _checked_value("steer", "scale", scale, record=False)
    return _spec("steer", where, Intervention("steer", vector, index, dim, nth, element, "output", scale,
                                                   per_row=per_row), op)


def scale(where: Where | Located, factor: Operand, *, index: Index = None, dim: int = 1, nth: Nth = None,
          element: int | str = 0, op: OpLike | None = None, per_row: bool = False) -> Spec:
    """Multiply each selected module's output by `factor`.

    Args:
        where: a selector.
        factor: a number, a tensor broadcast to the output, or ``fh.arg(name)``.
        index, dim, nth, element, op, per_row: as for :func:`patch`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Identity())
        >>> with fh.with_hooks(model, fh.scale("0", 0.5, index=0)):
        ...     y = model(torch.ones(1, 2, 2))
        >>> y
        tensor([[[0.5000, 0.5000],
                 [1.0000, 1.0000]]])
    """
    nth = _checked("scale", index=index, dim=dim, nth=nth, element=element, name=None, per_row=per_row)
    factor = _checked_value("scale", "factor", factor, record=False)
    return _spec("scale", where, Intervention("scale", factor, index, dim, nth, element, per_row=per_row), op)


def ablate(where: Where | Located, *, mean: Source | None = None, index: Index = None, dim: int = 1,
           nth: Nth = None, element: int | str = 0, name: str | None = None, op: OpLike | None = None,
           per_row: bool = False) -> Spec:
    """Zero each selected module's output, or with `mean` put a mean in its place.

    Args:
        where: a selector.
        mean: None (zero-ablation), a tensor broadcast to the output, a Record (the mean of
            its values at the module over their calls and first dimension: the outputs of
            a reference run, or the result of folding :class:`funhooks.OutputMeans`), or
            ``fh.arg(name)``.
        index, dim, nth, element, name, op, per_row: as for :func:`patch`.

    Returns:
        A Spec.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> model = nn.Sequential(nn.Identity())
        >>> _, ref = fh.capture(model, fh.outputs("0"))(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        >>> with fh.with_hooks(model, fh.ablate("0", mean=ref)):
        ...     y = model(torch.zeros(1, 2))
        >>> y
        tensor([[2., 3.]])
    """
    nth = _checked("ablate", index=index, dim=dim, nth=nth, element=element, name=name, per_row=per_row)
    mean = _checked_value("ablate", "mean", mean, none=True)
    return _spec("ablate", where, Intervention("ablate", mean, index, dim, nth, element, _named(name, op),
                                                   per_row=per_row), op)
