"""What the model utilities return: ``Shape`` (a shape that prints as fastai's), ``LayerRow``
(one module's row) and ``ModuleSummary`` (the printed table)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeAlias

import attrs
import torch

from funhooks import _frozen, _torch
from funhooks._frozen import Frozen

__all__ = ["NO_WEIGHT", "LayerRow", "ModuleSummary", "Shape", "ShapeTree", "shape_tree"]

_COLUMNS = (("Layer (type)", 20), ("Output Shape", 20), ("Param #", 10), ("Trainable", 10))


class Shape(tuple):
    """A tensor shape that also compares equal to a list, as fastai's tests write shapes.

    Example:
        >>> from funhooks.summary import Shape
        >>> Shape((1, 50)) == [1, 50], Shape((1, 50)) == (1, 50), Shape((1, 50)) != [1, 50]
        (True, True, False)
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, torch.Size)):
            other = tuple(other)
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = tuple.__hash__


ShapeTree: TypeAlias = "Shape | tuple[ShapeTree, ...] | list[ShapeTree] | dict[Hashable, ShapeTree] | None"
"""A value's tensors as :class:`Shape`, in the value's tuples, lists and dicts; None for
anything else (and for a module that did not run)."""


def shape_tree(value: object) -> ShapeTree:
    """`value` with every tensor replaced by its :class:`Shape` and anything else by None."""
    if isinstance(value, torch.Tensor):
        return Shape(value.shape)
    return _torch.tree_map(lambda x: Shape(x.shape) if isinstance(x, torch.Tensor) else None, value)


def _plain(shape: ShapeTree) -> object:
    """A shape tree as plain lists (JSON-ready)."""
    if isinstance(shape, Shape):
        return list(shape)
    if isinstance(shape, (tuple, list)):
        return [_plain(s) for s in shape]
    if isinstance(shape, dict):
        return {k: _plain(v) for k, v in shape.items()}
    return shape


NO_WEIGHT = ""
"""fastai 2.8's params and trainable of a module without a ``weight`` (an activation, a pool)."""


class LayerRow(tuple, Frozen):
    """One leaf module of :func:`layer_info`: fastai 2.8's five-item tuple ``(type, params,
    trainable, shape, same)``, with the module's ``path`` attached.

    A row *is* that tuple: it unpacks into five values and compares equal to fastai's
    documented rows such as ``('Linear', 100, True, [1, 50], False)`` or ``('ReLU', '', '',
    [1, 50], True)``. The path is extra information, not part of equality or hashing. Rows
    are frozen.

    Example:
        >>> from funhooks.summary import LayerRow
        >>> row = LayerRow("0", "Linear", 100, True, (1, 50), False)
        >>> row == ("Linear", 100, True, [1, 50], False), row.path, row.params
        (True, '0', 100)
        >>> row.to_dict()
        {'path': '0', 'type': 'Linear', 'params': 100, 'trainable': True, 'shape': [1, 50], 'same': False}
    """

    path: str
    """The module's path in the model (``""`` for a model that is itself a leaf)."""

    def __new__(cls, path: str, type: str, params: int | str, trainable: bool | str,  # noqa: A002
                shape: ShapeTree | Sequence[int],
                same: bool) -> LayerRow:
        if isinstance(shape, (tuple, list, torch.Size)) and all(isinstance(d, int) for d in shape):
            shape = Shape(shape)
        row = super().__new__(cls, (type, params, trainable, shape, same))
        object.__setattr__(row, "path", path)
        return row

    @property
    def type(self) -> str:
        """The module's class name."""
        return self[0]

    @property
    def params(self) -> int | str:
        """The number of parameters of the module; ``''`` for a module without a ``weight``
        attribute (fastai's rule: activations, pools)."""
        return self[1]

    @property
    def trainable(self) -> bool | str:
        """True when the module has parameters and one of them requires grad; ``''`` for a
        module without a ``weight`` attribute."""
        return self[2]

    @property
    def shape(self) -> ShapeTree:
        """The output's :class:`Shape` (a tree of them for tuple or dict outputs; None when
        the module did not run or returned no tensor)."""
        return self[3]

    @property
    def same(self) -> bool:
        """fastai's "size unchanged": an input's shape without its batch dimension equals
        the matching output's (False when the module did not run)."""
        return self[4]

    def to_dict(self) -> dict[str, Any]:
        """The row as plain Python values (shapes as lists), ready for ``json.dumps``."""
        return {"path": self.path, "type": self.type, "params": self.params, "trainable": self.trainable,
                "shape": _plain(self.shape), "same": self.same}

    def __repr__(self) -> str:
        return (f"LayerRow(path={self.path!r}, type={self.type!r}, params={self.params!r}, "
                f"trainable={self.trainable!r}, shape={self.shape!r}, same={self.same})")

    def __reduce__(self) -> tuple[Callable[..., LayerRow], tuple[object, ...]]:
        return (LayerRow, (self.path, *self))


def _format_shape(shape: ShapeTree) -> str:
    if isinstance(shape, Shape):
        return " x ".join(str(d) for d in shape) if shape else "scalar"
    if isinstance(shape, (tuple, list)):
        return "[" + ", ".join(_format_shape(s) for s in shape) + "]"
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{k}: {_format_shape(v)}" for k, v in shape.items()) + "}"
    return ""


@_frozen.frozen
@attrs.frozen
class ModuleSummary:
    """The result of :func:`module_summary`: ``str()`` is fastai's table with totals,
    :meth:`to_dict` the same as plain data.

    Attributes:
        model: the model's class name.
        input_shapes: the shape of each input (a tree of :class:`Shape`).
        rows: one :class:`LayerRow` per leaf module, in module order.
        total: parameters of the model, each shared parameter counted once.
        trainable: how many of them require grad.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> summary = fh.module_summary(nn.Sequential(nn.Linear(1, 50), nn.ReLU()), torch.randn(16, 1))
        >>> summary.total, summary.trainable, summary.non_trainable, len(summary.rows)
        (100, 100, 0, 2)
    """

    model: str
    input_shapes: tuple[ShapeTree, ...]
    rows: tuple[LayerRow, ...]
    total: int
    trainable: int

    @property
    def non_trainable(self) -> int:
        """Parameters that do not require grad."""
        return self.total - self.trainable

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain Python values, ready for ``json.dumps``."""
        return {"model": self.model, "input_shapes": [_plain(s) for s in self.input_shapes],
                "rows": [r.to_dict() for r in self.rows], "total": self.total,
                "trainable": self.trainable, "non_trainable": self.non_trainable}

    def __str__(self) -> str:
        cells = [(r.type, _format_shape(r.shape), f"{r.params:,}" if r.params != NO_WEIGHT else "", str(r.trainable))
                 for r in self.rows]
        widths = [max([w, *(len(c[i]) + 1 for c in cells)]) for i, (_, w) in enumerate(_COLUMNS)]

        def line(values: Sequence[str]) -> str:
            return " ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

        rule = sum(widths) + len(widths)
        inputs = [_format_shape(s) for s in self.input_shapes]
        out = [f"{self.model} (Input shape: {inputs})", "=" * rule, line([t for t, _ in _COLUMNS]), "=" * rule]
        for c in cells:
            out += [line(c), "_" * rule]
        out += ["", f"Total params: {self.total:,}", f"Total trainable params: {self.trainable:,}",
                f"Total non-trainable params: {self.non_trainable:,}"]
        return "\n".join(out)
