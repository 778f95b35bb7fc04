"""What the model utilities return: ``Shape`` (a shape that prints as fastai's), ``LayerRow``
(one leaf module's fastai row), ``SummaryRow`` (one module's row of the full layout) and
``ModuleSummary`` (the printed table, in fastai's layout or the full one)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, TypeAlias

import attrs
import torch

from funhooks import _frozen, _html, _torch
from funhooks._frozen import Frozen

__all__ = ["LAYOUTS", "NO_WEIGHT", "LayerRow", "Layout", "ModuleSummary", "Shape", "ShapeTree", "SummaryRow",
           "shape_tree"]

_COLUMNS = (("Layer (type)", 20), ("Output Shape", 20), ("Param #", 10), ("Trainable", 10))
_FULL_COLUMNS = ("Layer (type)", "Input Shape", "Output Shape", "Param #", "MACs", "FLOPs")
_FULL_GAP = 3  # spaces between the full layout's columns
_INDENT = "  "  # per level of depth in the full layout
_NONE = "--"  # an empty cell of the full layout
_MB = 1e6  # torchinfo's megabyte

Layout: TypeAlias = Literal["fastai", "full"]
LAYOUTS: tuple[Layout, ...] = ("fastai", "full")
"""``str()`` of a :class:`ModuleSummary`: fastai's leaf table, or the full tree with input
shapes, MACs, FLOPs and memory estimates."""


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


def _format_full_shape(shape: ShapeTree) -> str:
    """torchinfo's ``[2, 8, 16]``; a 1-tuple (one positional argument) as its item; parts that
    are no tensor left out."""
    if isinstance(shape, Shape):
        return str(list(shape))
    if isinstance(shape, (tuple, list)):
        parts = [_format_full_shape(s) for s in shape]
        parts = [p for p in parts if p != _NONE]
        return _NONE if not parts else parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"
    if isinstance(shape, dict):
        items = [f"{k}: {_format_full_shape(v)}" for k, v in shape.items()]
        items = [i for i in items if not i.endswith(_NONE)]
        return "{" + ", ".join(items) + "}" if items else _NONE
    return _NONE


@_frozen.frozen
@attrs.frozen
class SummaryRow:
    """One module of :func:`module_summary`'s full layout (every module down to `depth`, the
    model itself first, in module order; a shared module once, at its first path).

    Attributes:
        path: the module's path (``""`` for the model).
        type: its class name.
        depth: how many path segments deep it is (0 for the model).
        input_shape: its last call's positional arguments as a tuple of shapes (keyword
            arguments of an inner call are not seen); the model's row holds the inputs you passed
            (a dict of them with keyword inputs). None when it did not run.
        output_shape: its last call's output shape tree; None when it did not run.
        params: the parameters of its whole subtree, each counted once.
        trainable: how many of `params` require grad.
        own_params: the parameters it holds itself (not through a child).
        flops: FLOPs of all its calls, children included, as ``torch.utils.flop_counter``
            counts them (matmuls, convolutions, attention; elementwise ops count 0); None when
            not counted (a sharded model).
        calls: how many times it ran.
    """

    path: str
    type: str
    depth: int
    input_shape: ShapeTree
    output_shape: ShapeTree
    params: int
    trainable: int
    own_params: int
    flops: int | None
    calls: int

    @property
    def macs(self) -> int | None:
        """Multiply-accumulates: half the FLOPs (the counter counts a multiply-add as two)."""
        return None if self.flops is None else self.flops // 2

    def to_dict(self) -> dict[str, Any]:
        """The row as plain Python values, ready for ``json.dumps``."""
        return {**attrs.asdict(self, recurse=False), "input_shape": _plain(self.input_shape),
                "output_shape": _plain(self.output_shape), "macs": self.macs}


def _count(n: int | None) -> str:
    return _NONE if not n else f"{n:,}"


def _full_cells(rows: Sequence[SummaryRow]) -> list[tuple[str, ...]]:
    """One line of cells per row. A row whose children are listed shows the parameters it holds
    itself (``--`` for none), a row at the depth limit its whole subtree's, in parentheses when
    none is trainable (torchinfo's rule); a container's MACs and FLOPs are left to its children."""
    cells: list[tuple[str, ...]] = []
    for i, r in enumerate(rows):
        parent = i + 1 < len(rows) and rows[i + 1].depth > r.depth
        shown = _count(r.own_params if parent else r.params)
        if not parent and r.params and not r.trainable:
            shown = f"({shown})"
        name = _INDENT * r.depth + (f"{r.path.rsplit('.', 1)[-1]} ({r.type})" if r.path else r.type)
        cells.append((name, _format_full_shape(r.input_shape), _format_full_shape(r.output_shape), shown,
                      _NONE if parent else _count(r.macs), _NONE if parent else _count(r.flops)))
    return cells


@_frozen.frozen
@attrs.frozen
class ModuleSummary:
    """The result of :func:`module_summary`: ``str()`` is the table in its `layout`,
    :meth:`to_dict` the same as plain data.

    Attributes:
        model: the model's class name.
        input_shapes: the shape of each positional input (a tree of :class:`Shape`).
        rows: one :class:`LayerRow` per leaf module, in module order (fastai's layout).
        total: parameters of the model, each shared parameter counted once.
        trainable: how many of them require grad.
        kwarg_shapes: ``(name, shape)`` of each keyword input, in the order passed.
        layers: one :class:`SummaryRow` per module down to `depth` (the full layout).
        depth: the depth limit of `layers` (None: every module).
        flops: FLOPs of one forward pass (``torch.utils.flop_counter``); None when not counted.
        param_bytes: bytes of the parameters, each shared one counted once.
        input_bytes: bytes of the inputs' tensors.
        activation_bytes: bytes of every leaf module's outputs in one forward pass, each call
            counted: an estimate of what a training step keeps for backward.
        layout: what ``str()`` prints: ``"fastai"`` or ``"full"``.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> summary = fh.module_summary(nn.Sequential(nn.Linear(1, 50), nn.ReLU()), torch.randn(16, 1))
        >>> summary.total, summary.trainable, summary.non_trainable, len(summary.rows)
        (100, 100, 0, 2)
        >>> summary.macs, summary.param_bytes, summary.activation_bytes
        (800, 400, 6400)
    """

    model: str
    input_shapes: tuple[ShapeTree, ...]
    rows: tuple[LayerRow, ...]
    total: int
    trainable: int
    kwarg_shapes: tuple[tuple[str, ShapeTree], ...] = ()
    layers: tuple[SummaryRow, ...] = ()
    depth: int | None = None
    flops: int | None = None
    param_bytes: int = 0
    input_bytes: int = 0
    activation_bytes: int = 0
    layout: Layout = "fastai"

    @property
    def non_trainable(self) -> int:
        """Parameters that do not require grad."""
        return self.total - self.trainable

    @property
    def macs(self) -> int | None:
        """Multiply-accumulates of one forward pass: half the FLOPs."""
        return None if self.flops is None else self.flops // 2

    @property
    def total_bytes(self) -> int:
        """torchinfo's estimated total size: inputs, parameters, and activations twice (their
        gradients in backward)."""
        return self.input_bytes + self.param_bytes + 2 * self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain Python values, ready for ``json.dumps``."""
        return {"model": self.model, "input_shapes": [_plain(s) for s in self.input_shapes],
                "kwarg_shapes": {k: _plain(s) for k, s in self.kwarg_shapes},
                "rows": [r.to_dict() for r in self.rows], "layers": [r.to_dict() for r in self.layers],
                "depth": self.depth, "flops": self.flops, "macs": self.macs, "param_bytes": self.param_bytes,
                "input_bytes": self.input_bytes, "activation_bytes": self.activation_bytes,
                "total": self.total, "trainable": self.trainable, "non_trainable": self.non_trainable}

    def _header(self) -> str:
        inputs = [_format_shape(s) for s in self.input_shapes] + [f"{k}: {_format_shape(s)}"
                                                                   for k, s in self.kwarg_shapes]
        return f"{self.model} (Input shape: {inputs})"

    def _totals(self) -> list[str]:
        return [f"Total params: {self.total:,}", f"Total trainable params: {self.trainable:,}",
                f"Total non-trainable params: {self.non_trainable:,}"]

    def __str__(self) -> str:
        return self._full() if self.layout == "full" else self._fastai()

    def _fastai(self) -> str:
        cells = [(r.type, _format_shape(r.shape), f"{r.params:,}" if r.params != NO_WEIGHT else "", str(r.trainable))
                 for r in self.rows]
        widths = [max([w, *(len(c[i]) + 1 for c in cells)]) for i, (_, w) in enumerate(_COLUMNS)]

        def line(values: Sequence[str]) -> str:
            return " ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

        rule = sum(widths) + len(widths)
        out = [self._header(), "=" * rule, line([t for t, _ in _COLUMNS]), "=" * rule]
        for c in cells:
            out += [line(c), "_" * rule]
        return "\n".join([*out, "", *self._totals()])

    def __repr__(self) -> str:
        return (f"ModuleSummary(model={self.model!r}, rows={len(self.rows)}, layers={len(self.layers)}, "
                f"total={self.total:,}, trainable={self.trainable:,}, layout={self.layout!r})")

    def _repr_html_(self) -> str:
        """The table as HTML (what a notebook shows), in the summary's `layout`, with the totals in
        its caption. Built from shapes and counts alone: no tensor value is read."""
        caption = " · ".join([self._header(), *self._totals()])
        if self.layout == "full":
            cells = _full_cells(self.layers)
            rows: list[list[_html.Cell | str]] = [[_html.Cell(c[0].strip(), indent=r.depth), *c[1:]]
                                                  for r, c in zip(self.layers, cells)]
            return _html.table(_FULL_COLUMNS, rows, caption=caption)
        fastai = [(r.type, _format_shape(r.shape), f"{r.params:,}" if r.params != NO_WEIGHT else "", str(r.trainable))
                  for r in self.rows]
        return _html.table([t for t, _ in _COLUMNS], fastai, caption=caption)

    def _full(self) -> str:
        cells = _full_cells(self.layers)
        widths = [max(len(c[i]) for c in [_FULL_COLUMNS, *cells]) for i in range(len(_FULL_COLUMNS))]

        def line(values: Sequence[str]) -> str:
            return (" " * _FULL_GAP).join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

        rule = "=" * (sum(widths) + _FULL_GAP * len(widths))
        mb = {name: f"{n / _MB:0.2f}" for name, n in (("input", self.input_bytes), ("params", self.param_bytes),
                                                      ("pass", 2 * self.activation_bytes), ("all", self.total_bytes))}
        return "\n".join([
            self._header(), rule, line(_FULL_COLUMNS), rule, *(line(c) for c in cells), rule, *self._totals(),
            f"Total MACs: {_NONE if self.macs is None else f'{self.macs:,}'}",
            f"Total FLOPs: {_NONE if self.flops is None else f'{self.flops:,}'}",
            f"Input size (MB): {mb['input']}", f"Params size (MB): {mb['params']}",
            f"Forward/backward pass size (MB): {mb['pass']}", f"Estimated total size (MB): {mb['all']}",
        ])
