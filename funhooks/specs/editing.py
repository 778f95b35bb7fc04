"""Intervention values: what ``fh.patch``, ``fh.steer``, ``fh.scale`` and ``fh.ablate`` do
to each value they edit (see ``funhooks.specs.interventions`` for the specs).

An :class:`Intervention` is the ``action`` of an intervention spec. The run core calls its
``apply`` for each call of a selected module (or of a selected op inside it) with the
module's path, its index among the modules the spec selected, how often it applied in the
run so far, and the call's per-call values (``fh.arg`` placeholders). Everything it does is
a differentiable, ``vmap``-able tensor op: ``torch.where`` over a position mask and a module
gate, never an in-place write, so a sweep maps over positions, modules and values alike.

With ``per_row`` the module gate and the position mask are per row of the batch, so one
batched forward runs a sweep, one patch per row.

Cost: per edited call, one new tensor the size of the edited value; for ``index``/``nth`` a
mask, made once and kept per rank while calls pass the same per-call ints and tensors (outside
transforms and traces); a Record source is a dict lookup.
"""

from __future__ import annotations

import abc
import copy
import weakref
from collections.abc import Mapping, Sequence
from typing import Literal, TypeAlias, TypeGuard, cast

import attrs
import torch

from funhooks import _frozen, _torch
from funhooks.errors import InterventionError
from funhooks.records.node import Calls, StoredValue
from funhooks.records.record import Record

from .selector import path_label
from .spec import Spec
from .decoding import DECODING, Decoding, Steps

__all__ = ["Arg", "Index", "Intervention", "Nth", "Operand", "Source", "View", "is_number", "show"]

Tensor = torch.Tensor


@_frozen.frozen
@attrs.frozen(repr=False)
class Arg:
    """A per-call value: the keyword argument `name` of a capture function's call.

    Example:
        >>> import funhooks as fh
        >>> fh.arg("clean")
        fh.arg('clean')
    """

    name: str

    def __repr__(self) -> str:
        return f"fh.arg({self.name!r})"


class View(abc.ABC):
    """A tensor seen another way (heads split off, one third of a fused projection): what an
    intervention on a standard point edits, written back into the tensor it was read from.
    Both directions are plain tensor ops (no in-place write), so edits stay ``vmap``-able."""

    @abc.abstractmethod
    def get(self, tensor: Tensor) -> Tensor:
        """The view of `tensor`."""

    @abc.abstractmethod
    def put(self, tensor: Tensor, new: Tensor) -> Tensor:
        """`tensor` with its view replaced by `new` (a new tensor)."""


Index: TypeAlias = "int | Sequence[int] | Tensor | Arg | Steps | None"
"""The positions an intervention edits along its `dim` (None: all of them)."""
Nth: TypeAlias = "int | Sequence[int] | Tensor | Arg | None"
"""Which of the modules a selector matched an intervention edits (None: every one; ints: one
per row, with ``per_row``)."""
Source: TypeAlias = "Tensor | float | Record | Arg"
"""What a patch puts in, or an ablation's mean: a value, or a Record holding one per module."""
Operand: TypeAlias = "Tensor | float | Arg"
"""What a steer adds (its vector and scale) or a scale multiplies by."""
_PerCall: TypeAlias = "Mapping[str, object]"
"""The per-call values of one call of a capture function, by ``fh.arg`` name."""


def show(value: object) -> str:
    if isinstance(value, Tensor):
        return f"<Tensor of shape {tuple(value.shape)}>"
    if isinstance(value, Record):
        return f"<Record of {len(value)} module{'s' if len(value) != 1 else ''}>"
    return repr(value)


def is_number(x: object) -> TypeGuard[float]:
    """Whether `x` is a Python int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_one(x: object) -> bool:
    return isinstance(x, (int, float)) and x == 1


def _shape(t: Tensor) -> tuple[int, ...]:
    return tuple(t.shape)


@_frozen.frozen
@attrs.frozen(eq=False, repr=False)
class Intervention:
    """What an intervention spec does to each value it edits (the ``action`` of its Spec).

    ``kind`` is ``patch``, ``steer``, ``scale`` or ``ablate``; ``value`` the patch value,
    steering vector, factor or mean; ``coef`` the steering scale; the rest as the
    constructors say. Compared by identity, like any value holding tensors.
    """

    kind: str
    value: Source | None = None
    index: Index = None
    dim: int = 1
    nth: Nth = None
    element: int | str = 0
    name: str = "output"
    coef: Operand = 1.0
    view: View | None = None
    """Edit this view of the value (a standard point's), written back through it."""
    per_row: bool = False
    """`nth`, `index` and a steer's `coef` give one entry per row (dim 0) of the edited value."""
    _masks: _Masks = attrs.field(factory=lambda: _Masks(), init=False)
    """The last mask made per rank, with the per-call values it was made from (see :meth:`_where`)."""

    @property
    def args(self) -> tuple[str, ...]:
        """The names of the ``fh.arg`` placeholders it reads."""
        return tuple(x.name for x in (self.value, self.index, self.nth, self.coef) if isinstance(x, Arg))

    @property
    def intervenes(self) -> bool:
        """True: it edits with an intervention value (see :class:`~funhooks.specs.spec._Action`)."""
        return True

    def __str__(self) -> str:
        first = {"ablate": []}.get(self.kind, [show(self.value)])
        named = [("mean", self.value if self.kind == "ablate" else None), ("scale", None if _is_one(self.coef) else self.coef),
                 ("index", self.index), ("dim", self.dim if self.dim != 1 else None), ("nth", self.nth),
                 ("element", self.element or None), ("per_row", self.per_row or None)]
        if self.name != "output" and isinstance(self.value, (Record, Arg)):
            named.append(("name", self.name))
        return ", ".join(first + [f"{k}={show(v)}" for k, v in named if v is not None])

    # -- applying ------------------------------------------------------------------------

    def apply(self, output: StoredValue, spec: Spec, path: str, rank: int, count: int, values: _PerCall,
              caller: str) -> StoredValue:
        """The edited `output` of the `count`-th call (in the run) of the module at `path`,
        the `rank`-th its spec selected; None to leave it as it was."""
        at = _At(self, spec, path, caller)
        nth = self._nth(values, at)
        if nth is not None and not isinstance(nth, Tensor) and nth != rank:
            return None
        if isinstance(output, Tensor) and self.element != 0:
            raise at.error(f"`element` picks an item of a tuple, list or dict output, got element {self.element!r} of "
                           "a Tensor", "Leave `element` out for a module returning a tensor")
        whole = output if isinstance(output, Tensor) else _item(output, self.element, at)
        target = whole if self.view is None else self.view.get(whole)
        mask = self._where(nth, rank, target, values, at)
        if mask is False:
            return None
        new, fresh = self._new(target, values, count, at)
        if mask is not None:
            new = torch.where(mask, new, target)  # broadcasts `new` (`_check_fits` checked it fits)
        elif not fresh:  # never hand the model a tensor a Record or the caller still holds (`put` copies)
            new = new.expand(target.shape) if self.view is not None else new.expand(target.shape).clone()
        if self.view is not None:  # `put` makes a new tensor
            new = self.view.put(whole, new)
        return new if isinstance(output, Tensor) else _replace(output, self.element, new)

    def _get(self, x: object, values: _PerCall, at: _At, role: str = "index") -> object:
        """`x`, or the call's value for it when it is an ``fh.arg``; a value for a `role` other
        than ``index`` (checked by :meth:`_mask`) must be of the kind the constructor takes."""
        if not isinstance(x, Arg):
            return x
        try:
            value = values[x.name]
        except KeyError:
            raise at.error(
                f"a per-call value comes from the call's keyword argument `{x.name}`, got none",
                f"Call the capture function as `f(..., {x.name}=value)`",
            ) from None
        if role == "nth":
            if isinstance(value, Tensor) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                return value
            if self.per_row and isinstance(value, (list, tuple)) and all(map(_is_int, value)):
                return torch.tensor(value)
            what = "an int >= 0, ints (one per row) or an integer tensor" if self.per_row else \
                "an int >= 0 or an integer tensor"
            raise at.error(f"`nth` is {what}, got {show(value)}",
                           "Pass the index of the module to edit among those the selector matches")
        if role != "index" and not (isinstance(value, Tensor) or is_number(value)
                                    or (isinstance(value, Record) and role in ("value", "mean"))):
            what = "a tensor, a number or a Record" if role in ("value", "mean") else "a tensor or a number"
            raise at.error(f"`{role}` is {what}, got {show(value)}", "Pass one of those per call")
        return value

    def _nth(self, values: _PerCall, at: _At) -> int | Tensor | None:
        """The call's `nth`, checked: an int, or an integer tensor (1-d: one per row, with `per_row`)."""
        nth = cast("int | Tensor | None", self._get(self.nth, values, at, "nth"))  # `_get` checked it
        if isinstance(nth, Tensor):
            if self.per_row and (nth.ndim > 1 or nth.is_floating_point() or nth.is_complex()):
                raise at.error(f"`nth` is one integer module index per row (per_row=True), got a tensor of shape "
                               f"{_shape(nth)}", "Pass an int, or a list or 1-d integer tensor of one index per row")
            if not self.per_row and (nth.ndim != 0 or nth.is_floating_point() or nth.is_complex()):
                raise at.error(f"`nth` is one integer module index per call, got a tensor of shape {_shape(nth)}",
                               "Map over a 1-d tensor of indices with `torch.func.vmap`, which gives each call one, "
                               "or pass `per_row=True` for one per row of the batch")
        return nth

    def _where(self, nth: int | Tensor | None, rank: int, target: Tensor, values: _PerCall,
               at: _At) -> Tensor | Literal[False] | None:
        """Where `target` is edited (None: everywhere): at `index`, in the calls (or with `per_row`
        the rows) whose `nth` is `rank`. Outside transforms and traces the mask is kept per rank
        and reused while calls pass the same ints and tensors (unchanged in place), so a sweep's
        masks are made once per module, not once per call of it; there a per-row mask no row
        selects is False: the module is left alone, as an int `nth` leaves the others."""
        index = self._get(self.index, values, at)
        if index is None and nth is None:
            return None
        key = _key(rank, nth, index, target)
        kept = self._masks.get(rank) if key is not None else None
        if kept is not None and kept[0] == key and all(ref() is not None for ref in kept[1]):
            return kept[-1]
        mask = self._mask(index, target, values, at)
        if isinstance(nth, Tensor):
            gate = nth == rank
            gate = self._rows(gate, target, "nth", at) if self.per_row else gate
            mask = gate if mask is None else mask & gate
        if key is None:
            return mask
        # one host read per kept mask
        where: Tensor | Literal[False] | None = False if self.per_row and mask is not None and not bool(mask.any()) else mask
        # the per-call tensors held weakly (no cache keeps a user's tensor alive): while one lives, its id is its own
        self._masks[rank] = (key, tuple(weakref.ref(x) for x in (nth, index) if isinstance(x, Tensor)), where)
        return where

    def _new(self, target: Tensor, values: _PerCall, count: int, at: _At) -> tuple[Tensor, bool]:
        """The replacement of `target` (before `index`/`nth`; broadcast to it, not expanded), and
        whether it is a new tensor."""
        kind = self.kind
        if kind == "ablate" and self.value is None:
            return torch.zeros_like(target), True
        value = self._get(self.value, values, at, _ROLES[kind])
        if isinstance(value, Record):
            value = _from_record(value, self, count, at) if kind != "ablate" else _record_mean(value, self, at)
        if not isinstance(value, Tensor):
            value = torch.as_tensor(value)
        _check_real(value, target, at)
        if value.device != target.device or (kind != "scale" and value.dtype != target.dtype):
            value = value.to(device=target.device, dtype=target.dtype if kind != "scale" else None)
        _check_fits(value, target, at)
        if kind == "steer":
            coef = cast("Tensor | float", self._get(self.coef, values, at, "scale"))  # `_get` checked it
            if isinstance(coef, Tensor):
                _check_real(coef, target, at)
                if self.per_row and coef.ndim == 1:
                    coef = self._rows(coef, target, "scale", at)
            return (target + coef * value).to(target.dtype), True
        if kind == "scale":
            return (target * value).to(target.dtype), True
        return value, False

    def _mask(self, index: object, target: Tensor, values: _PerCall, at: _At) -> Tensor | None:
        if index is None:
            return None
        ndim = target.ndim
        if not -ndim <= self.dim < ndim:
            raise at.error(f"`dim` is a dimension of the edited value (which has {ndim}), got {self.dim}",
                           "Pass the dimension that holds the positions")
        dim = self.dim % ndim
        size = target.shape[dim]
        shape = (size,) + (1,) * (ndim - dim - 1)  # the mask's, broadcast over the dims after `dim`
        if self.per_row and (isinstance(index, (list, tuple)) or isinstance(index, Tensor) and index.ndim):
            return self._row_mask(index, target, dim, at)
        if isinstance(index, Steps):
            return self._steps(index, size, values, at, target.device).reshape(shape)
        if not _is_positions(index):
            raise at.error(f"`index` is an int, ints, a bool mask or an integer tensor, got {show(index)}",
                           f"Pass integer positions along dim {dim}")
        outside = _outside(index, size)
        if outside is not None:
            raise at.error(f"`index` is a position along dim {dim} (size {size}), got {outside}",
                           f"Pass an index in [{-size}, {size})")
        if isinstance(index, int):
            return (torch.arange(size, device=target.device) == index % size).reshape(shape)
        if not isinstance(index, Tensor) or index.device != target.device:
            index = torch.as_tensor(index, device=target.device)
        if index.dtype == torch.bool:
            if _shape(index) != (size,):
                raise at.error(f"a bool `index` has one entry per position along dim {dim} ({size}), got "
                               f"shape {_shape(index)}", "Pass a mask of that length")
            return index.reshape(shape)
        # position p is index p or p - size: one comparison with both (an index out of range under
        # `vmap`, where it cannot be read, matches none), and no arithmetic on a batched index
        both = torch.arange(-size, size, device=target.device).reshape((2,) + shape)
        if index.ndim == 0:
            return (both == index).any(0)
        return (both.unsqueeze(-1) == index.reshape(-1)).any(-1).any(0)


    def _row_mask(self, index: Sequence[object] | Tensor, target: Tensor, dim: int, at: _At) -> Tensor:
        """The mask of one position per row (``per_row``): row b along `dim` is true at
        ``index[b]`` only, shaped ``(rows, 1..., size, 1...)``."""
        if dim == 0:
            raise at.error(f"`dim` is the position axis, which is not the rows' (dim 0) with `per_row=True`, got "
                           f"{self.dim}", "Pass the dimension holding the positions")
        if isinstance(index, Tensor) and index.ndim == 1 and not (
                index.dtype == torch.bool or index.is_floating_point() or index.is_complex()):
            positions = index
        elif not isinstance(index, Tensor) and all(map(_is_int, index)):
            positions = torch.tensor(index, device=target.device)
        else:
            raise at.error(f"`index` is one int position per row (per_row=True), got {show(index)}",
                           "Pass an int, or a list or 1-d integer tensor of one position per row")
        rows = self._rows(positions, target, "index", at).reshape(-1, 1, 1)
        size = target.shape[dim]
        # row b's position is index[b] or index[b] - size: one comparison with both, as in `_mask`
        mask = (torch.arange(-size, size, device=target.device).reshape(2, size) == rows).any(1)
        if not (_torch.is_functorch_active() or _torch.is_compiling()) and not bool(mask.any(1).all()):
            row = int((~mask.any(1)).nonzero()[0])
            raise at.error(f"`index` is a position along dim {dim} (size {size}) in each row, got "
                           f"{int(positions[row])} in row {row}", f"Pass an index in [{-size}, {size})")
        return mask.reshape((len(mask),) + (1,) * (dim - 1) + (size,) + (1,) * (target.ndim - dim - 1))

    def _rows(self, x: Tensor, target: Tensor, role: str, at: _At) -> Tensor:
        """`x`, one entry per row of `target` (``per_row``), shaped to broadcast over the
        rest of each row; a 0-d `x` is every row's."""
        if x.ndim == 0:
            return x
        rows = target.shape[0] if target.ndim else 0
        if len(x) != rows:
            raise at.error(f"`{role}` is one entry per row of the batch (per_row=True: {rows} rows along dim 0), got "
                           f"{len(x)} entries", f"Pass {rows} entries, or run the model on a batch of {len(x)} rows "
                           f"(the input repeated {len(x)} times)")
        if x.device != target.device:
            x = x.to(target.device)
        return x.reshape((rows,) + (1,) * (target.ndim - 1))

    def _steps(self, index: Steps, size: int, values: _PerCall, at: _At, device: torch.device) -> Tensor:
        """The mask of ``index=fh.steps(...)`` over a call's `size` positions."""
        decoding = values.get(DECODING)
        if not isinstance(decoding, Decoding):
            raise at.error(f"`index={index!r}` addresses the decode steps of `fh.generate` or `fh.iter_generate`, "
                           "got a call outside one", "Generate through `fh.generate(model, specs, input_ids, ...)`")
        if size > decoding.end:
            raise at.error(f"`index={index!r}` reads positions along dim {self.dim}, which holds at most the "
                           f"{decoding.end} tokens the call sees at step {decoding.step}, got {size}",
                           "Pass the `dim` of the positions")
        return index.mask(size, decoding, device)


class _Masks(dict):
    """An intervention's kept masks, by rank: ``(key, weak references to the per-call tensors
    the key names by id, mask)``. Copies and pickles of the intervention start empty."""

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _Masks, ()


def _key(rank: int, nth: object, index: object, target: Tensor) -> tuple[object, ...] | None:
    """What a kept mask was made from: ints by value, tensors by identity and version, and the
    edited value's shape, device and inference mode; None where a mask cannot be kept (other
    per-call values, values inside a ``torch.func`` transform or a trace)."""
    if _torch.is_functorch_active() or _torch.is_compiling():
        return None
    parts: list[object] = [rank, tuple(target.shape), target.device, torch.is_inference_mode_enabled()]
    for x in (nth, index):
        if isinstance(x, Tensor):
            parts.append((id(x), x._version))
        elif x is None or _is_int(x):
            parts.append(x)
        else:
            return None
    return tuple(parts)


_ROLES = {"patch": "value", "steer": "vector", "scale": "factor", "ablate": "mean"}
"""The name of each kind's value, in messages."""


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_positions(index: object) -> TypeGuard[int | Sequence[int] | Tensor]:
    """Whether `index` is of a kind `index` takes: an int, ints, a bool or integer tensor."""
    if isinstance(index, Tensor):
        return not (index.is_floating_point() or index.is_complex())
    if isinstance(index, (list, tuple)):
        return all(map(_is_int, index))
    return _is_int(index)


def _outside(index: int | Sequence[int] | Tensor, size: int) -> int | None:
    """The first position of `index` outside ``[-size, size)``, or None. A tensor is checked
    with one comparison (a host read), except under a ``torch.func`` transform or a
    ``torch.compile`` trace, where its values cannot be read."""
    if isinstance(index, int):
        return None if -size <= index < size else index
    if not isinstance(index, Tensor):
        return next((i for i in index if not -size <= i < size), None)
    if index.dtype == torch.bool or _torch.is_functorch_active() or _torch.is_compiling():
        return None
    out = (index < -size) | (index >= size)
    return int(index[out].reshape(-1)[0]) if bool(out.any()) else None


def _check_real(value: Tensor, target: Tensor, at: _At) -> None:
    if value.is_complex() and not target.is_complex():
        raise at.error(f"an intervention's value is real where the value it edits is real ({target.dtype}), got a "
                       "complex value", "Pass a real value, or edit a complex output")


class _At:
    """Where an intervention applies, for its messages."""

    __slots__ = ("caller", "intervention", "path", "spec")

    def __init__(self, intervention: Intervention, spec: Spec, path: str, caller: str) -> None:
        self.intervention, self.spec, self.path, self.caller = intervention, spec, path, caller

    def error(self, rule: str, fix: str) -> InterventionError:
        return InterventionError(f"{self.caller}: {rule}, at module {path_label(self.path)} for {self.spec!r}. {fix}.")


def _item(output: StoredValue, element: int | str, at: _At) -> Tensor:
    """The edited item of a module's tuple, list or dict output."""
    try:
        container: StoredValue = output
        if isinstance(output, (tuple, list)) and isinstance(element, int) or isinstance(output, Mapping):
            item = container[element]
        else:
            item = None
    except (IndexError, KeyError):
        item = None
    if not isinstance(item, Tensor):
        got = f"a {type(output).__name__}" + (f" of {len(output)}" if isinstance(output, (tuple, list, Mapping)) else "")
        raise at.error(f"an intervention edits a tensor, or the tensor item `element` of a tuple, list or dict, got "
                       f"element {element!r} of {got}", "Pass `element=` naming a tensor in it")
    return item


def _replace(output: StoredValue, element: int | str, new: Tensor) -> StoredValue:
    """`output` with its item `element` replaced: the rest passes on untouched."""
    if isinstance(output, tuple):
        items: StoredValue = output
        position = cast(int, element)  # a tuple's element is an index (checked by `_item`)
        if hasattr(items, "_fields"):  # a namedtuple
            return items._replace(**{items._fields[position]: new})
        return items[:position] + (new,) + items[position + 1:]
    if type(output) is dict:
        return {**output, element: new}
    out = copy.copy(output)  # a list, or a dict subclass such as transformers' ModelOutput
    out[element] = new
    return out


def _source(rec: Record, self: Intervention, at: _At) -> Calls:
    node = rec.get(at.path)
    if node is None or self.name not in node:
        has = list(rec) if node is None else list(node)
        what = "paths" if node is None else f"names at {path_label(at.path)}"
        raise at.error(
            f"a Record given to an intervention holds the {self.name!r} of every module it edits, got none "
            f"(its {what}: {has})",
            "Record those modules in the source run with the same selector (e.g. `fh.outputs`, `fh.op_outputs`)",
        )
    return node.calls(self.name)


def _from_record(rec: Record, self: Intervention, count: int, at: _At) -> Tensor:
    calls = _source(rec, self, at)
    if len(calls) > 1 and count >= len(calls):
        raise at.error(f"a Record source holds one value per call it patches, got call {count + 1} where it "
                       f"holds {len(calls)}", "Record the source run with as many calls")
    value = calls[0] if len(calls) == 1 else calls[count]
    return value if isinstance(value, Tensor) else _item(value, self.element, at)


def _record_mean(rec: Record, self: Intervention, at: _At) -> Tensor:
    """The mean over the Record's calls and their first (batch) dimension."""
    calls = [c if isinstance(c, Tensor) else _item(c, self.element, at) for c in _source(rec, self, at)]
    return torch.cat(calls, 0).mean(0) if len(calls) > 1 else calls[0].mean(0)


def _check_fits(value: Tensor, target: Tensor, at: _At) -> None:
    if _broadcasts(value.shape, target.shape):
        return
    v, t = _shape(value), _shape(target)
    if len(v) == len(t) + 1 and _broadcasts(v[1:], t):
        fix = ("It has one leading dimension more than the value it edits: map over it with `torch.func.vmap` "
               "to get one edited output per entry")
    elif len(v) == len(t) and v and v[0] != t[0] and _broadcasts(v[1:], t[1:]):
        fix = (f"Its batch size {v[0]} is not the model's {t[0]}: make the source run with the same batch (or 1), "
               "and under `vmap` map only over the values' first dimension")
    else:
        fix = "Pass a value that broadcasts to the edited value's shape"
    raise at.error(f"an intervention's value broadcasts to the value it edits, got shape {v} where the edited "
                   f"value has shape {t}", fix)


def _broadcasts(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether shape `a` broadcasts to shape `b` (in Python: ``torch.broadcast_shapes`` costs
    tens of microseconds, paid per edited call)."""
    return a == b or len(a) <= len(b) and all(m == 1 or m == n for m, n in zip(reversed(a), reversed(b)))
