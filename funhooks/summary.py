"""Model utilities with fastai's names and results: parameter counts, dummy passes, shapes,
per-layer rows and the summary table.

Shapes are computed on the *meta* device: for one call, the model's parameters, buffers and
inputs are replaced by meta tensors of the same shapes (and put back after, however the call
ends), so no memory is allocated and no arithmetic is done, however large the model or batch. A
model the meta device cannot run (a kernel without a meta implementation, a real tensor made
inside ``forward``, Python control flow on tensor values) falls back to one real pass under
``torch.no_grad()``; its ``forward`` then runs twice. A tensor that ``forward`` caches as a
plain module attribute during the meta pass is put back as it was; caches kept elsewhere
(in a list or dict, outside the model) can keep a meta tensor.

A sharded model (FSDP2's ``fully_shard``, ``DTensor`` parameters of tensor parallelism) skips
the meta pass, which would swap parameters under FSDP's own swapping, and runs one real pass:
it all-gathers parameters, so every rank must call the function together; afterwards the
parameters are sharded again, as they were. Parameter counts are those of the full
parameters, not of this rank's shards (a ``DTensor``'s ``numel()`` is its global size), and
types are the modules' own (``Linear``, not FSDP's ``FSDPLinear``), so the rows equal those
of the model before sharding.

Unlike fastai, nothing here changes the model: every module's train/eval flag is restored
(passes run in eval mode, as fastai's do), buffers are not updated, and the dummy batch is
drawn from a private generator, so the global random state does not move either.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from . import _torch
from ._frozen import Frozen
from .record import Record
from ._core import scope
from ._modes import in_mode
from .run import with_hooks
from .spec import observe

__all__ = [
    "NO_WEIGHT",
    "LayerRow",
    "ModuleSummary",
    "Shape",
    "dummy_batch",
    "dummy_eval",
    "has_params",
    "layer_info",
    "model_sizes",
    "module_summary",
    "num_features_model",
    "total_params",
]

DEFAULT_SIZE = (64, 64)
"""fastai's default spatial size of a dummy batch."""

_DUMMY_RANGE = (-1.0, 1.0)  # a dummy batch is uniform on this interval, as fastai's
_DUMMY_SEED = 0  # the private generator's seed: dummy batches are reproducible
_FEATURE_SIZE_FIRST = 32  # num_features_model tries square inputs of this side...
_FEATURE_SIZE_LAST = 2048  # ...doubling up to this one, for models that need big inputs
_FIRST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_COLUMNS = (("Layer (type)", 20), ("Output Shape", 20), ("Param #", 10), ("Trainable", 10))


# -- values ---------------------------------------------------------------------------------


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


def _shape_tree(value: Any) -> Any:
    """`value` with every tensor replaced by its :class:`Shape` and anything else by None."""
    if isinstance(value, torch.Tensor):
        return Shape(value.shape)
    return _torch.tree_map(lambda x: Shape(x.shape) if isinstance(x, torch.Tensor) else None, value)


def _plain(shape: Any) -> Any:
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

    def __new__(cls, path: str, type: str, params: int | str, trainable: bool | str, shape: Any,  # noqa: A002
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
    def shape(self) -> Any:
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

    def __reduce__(self) -> tuple[Any, ...]:
        return (LayerRow, (self.path, *self))


def _format_shape(shape: Any) -> str:
    if isinstance(shape, Shape):
        return " x ".join(str(d) for d in shape) if shape else "scalar"
    if isinstance(shape, (tuple, list)):
        return "[" + ", ".join(_format_shape(s) for s in shape) + "]"
    if isinstance(shape, dict):
        return "{" + ", ".join(f"{k}: {_format_shape(v)}" for k, v in shape.items()) + "}"
    return ""


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
    input_shapes: tuple[Any, ...]
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


# -- parameters --------------------------------------------------------------------------------


def has_params(m: nn.Module) -> bool:
    """True when `m` has at least one parameter (its submodules' included).

    Args:
        m: a module.

    Returns:
        Whether ``m.parameters()`` is non-empty.

    Example:
        >>> import funhooks as fh
        >>> from torch import nn
        >>> fh.has_params(nn.Linear(3, 4)), fh.has_params(nn.ReLU())
        (True, False)
    """
    return next(iter(m.parameters()), None) is not None


def total_params(m: nn.Module) -> tuple[int, bool]:
    """The number of parameters of `m` and whether it is trainable.

    Args:
        m: a module; shared parameters are counted once.

    Returns:
        ``(count, trainable)``: `trainable` is True when some parameter requires grad
        (fastai looked at the first parameter only), False for a module without parameters.
        A sharded parameter (FSDP2) counts in full, not as this rank's shard.

    Example:
        >>> import funhooks as fh
        >>> from torch import nn
        >>> fh.total_params(nn.Linear(10, 32)), fh.total_params(nn.BatchNorm2d(20, affine=False))
        ((352, True), (0, False))
    """
    params = list(m.parameters())
    return sum(p.numel() for p in params), any(p.requires_grad for p in params)


# -- dummy passes --------------------------------------------------------------------------------


def _first_layer(caller: str, m: nn.Module) -> Any:
    """The first Linear or ConvNd of `m` (typed Any: its `weight`, `in_features` and
    `in_channels` are what callers read)."""
    for _, layer in _torch.named_modules(m):
        if isinstance(layer, _FIRST_LAYERS):
            return layer
    raise TypeError(
        f"{caller}: the input size is read from the first `Linear` or `Conv1d/2d/3d` layer, got "
        f"{type(m).__name__} with none. Build the input yourself and call the model."
    )


def dummy_batch(m: nn.Module, size: Sequence[int] = DEFAULT_SIZE) -> torch.Tensor:
    """A batch of one random input for `m`, shaped from its first conv or linear layer.

    Args:
        m: a model whose first ``Linear`` / ``ConvNd`` layer fixes the input's channels.
        size: the spatial size for a conv model, one entry per spatial dimension
            (ignored for a model whose first layer is ``Linear``).

    Returns:
        ``(1, in_channels, *size)`` for a conv, ``(1, in_features)`` for a linear first
        layer, uniform on [-1, 1), on the device and dtype of that layer's weight. Drawn
        from a private generator: the same every call, and the global random state untouched.

    Raises:
        TypeError: when `m` has no conv or linear layer.
        ValueError: when `size` does not have one entry per spatial dimension of the conv.

    Example:
        >>> import funhooks as fh
        >>> from torch import nn
        >>> fh.dummy_batch(nn.Sequential(nn.Conv2d(3, 8, 3))).shape
        torch.Size([1, 3, 64, 64])
        >>> fh.dummy_batch(nn.Sequential(nn.Linear(5, 2)), size=(32, 32)).shape
        torch.Size([1, 5])
    """
    layer = _first_layer("dummy_batch", m)
    if isinstance(layer, nn.Linear):
        shape: tuple[int, ...] = (1, layer.in_features)
    else:
        dims = layer.weight.ndim - 2
        size = tuple(size)
        if len(size) != dims:
            raise ValueError(
                f"dummy_batch: `size` has one entry per spatial dimension of the first layer "
                f"({type(layer).__name__}: {dims}), got {size!r}. Pass size={(DEFAULT_SIZE[0],) * dims!r}."
            )
        shape = (1, layer.in_channels, *size)
    weight = layer.weight
    gen = torch.Generator().manual_seed(_DUMMY_SEED)
    low, high = _DUMMY_RANGE
    x = torch.rand(shape, generator=gen) * (high - low) + low
    return x.to(device=weight.device, dtype=weight.dtype)


def dummy_eval(m: nn.Module, size: Sequence[int] = DEFAULT_SIZE) -> Any:
    """`m`'s output on :func:`dummy_batch`, computed in eval mode without gradients.

    Args:
        m: the model; every module's train/eval flag is the same afterwards.
        size: passed to :func:`dummy_batch`.

    Returns:
        What ``m`` returns.

    Raises:
        TypeError, ValueError: from :func:`dummy_batch`; whatever `m` raises on the batch.

    Example:
        >>> import funhooks as fh
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(5, 3), nn.Dropout(), nn.BatchNorm1d(3)).train()
        >>> fh.dummy_eval(m).shape, m.training, m[2].training
        (torch.Size([1, 3]), True, True)
    """
    x = dummy_batch(m, size)
    with in_mode(m, False), torch.no_grad(), scope.isolated(), _torch.sharding_kept(m):  # funhooks' own pass
        return m(x)


# -- shapes via hooks -------------------------------------------------------------------------


def _is_leaf(path: str, module: nn.Module) -> bool:
    return not any(c is not None for c in module._modules.values())


def _same(args: tuple[Any, ...], output: Any) -> bool:
    """fastai's ``any(i.shape[1:] == o.shape for i, o in zip(args, output))`` on shapes: a
    tensor output iterates over its first dimension, a tuple or list over its items (an
    item that is no tensor, or a dict or 0-d output, where fastai raises, gives False)."""
    if isinstance(output, torch.Tensor):
        if output.ndim == 0:
            return False
        outs: list[torch.Size | None] = [output.shape[1:]] * min(len(args), output.shape[0])
    elif isinstance(output, (tuple, list)):
        outs = [o.shape if isinstance(o, torch.Tensor) else None for o in output]
    else:
        return False
    return any(isinstance(a, torch.Tensor) and o is not None and a.shape[1:] == o for a, o in zip(args, outs))


def _track(module: nn.Module, args: tuple[Any, ...], output: Any) -> tuple[Any, bool]:
    """What a row needs of one call: the output's shape tree, and fastai's `same`."""
    return _shape_tree(output), _same(args, output)


def _meta(value: Any) -> Any:
    return _torch.tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, value)


@contextlib.contextmanager
def _on_meta(model: nn.Module) -> Iterator[None]:
    """Inside the block every parameter and buffer of `model` is a meta tensor of its shape;
    the originals are put back after, however the block exits. Each module is visited
    once, so a module shared under several paths is swapped and restored once. A plain
    tensor attribute that ``forward`` set to a meta tensor (a cache) is put back as it was,
    or removed when it is new."""
    saved: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    attributes = [(m, dict(vars(m))) for m in model.modules()]
    try:
        for module in model.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for name, t in list(table.items()):
                    if t is None:
                        continue
                    meta = torch.empty_like(t, device="meta")
                    saved.append((table, name, t))
                    table[name] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t
        for module, before in attributes:
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_meta and value is not before.get(key):
                    if key in before:
                        vars(module)[key] = before[key]
                    else:
                        del vars(module)[key]


def _shapes(model: nn.Module, where: Any, args: tuple[Any, ...]) -> tuple[Record, Any]:
    """Run `model` on `args` in eval mode, storing the output shape of the modules `where`
    selects (none when `where` is None). Returns ``(record, output shape)``: on the meta
    device when it can, else with one real pass. Lazy modules always get the real pass
    (it initialises them, as users of fastai's ``dummy_eval`` expect)."""
    model = _torch.unwrap(model)
    specs = () if where is None else (observe(where, _track, name="shape", detach=False),)
    with_hooks(model, specs)  # validates the selector before anything runs
    lazy = any(nn.parameter.is_lazy(t) for t in itertools.chain(model.parameters(), model.buffers()))
    # a sharded model (FSDP2) swaps its own parameters in and out around each call: it runs for real
    meta = not lazy and not _torch.is_sharded(model)
    with in_mode(model, False), torch.no_grad(), scope.isolated(), _torch.sharding_kept(model):  # funhooks' own pass
        if meta:
            try:
                with _on_meta(model), with_hooks(model, specs) as run:
                    out = model(*_meta(args))
                return run.record, _shape_tree(out)
            except Exception:  # noqa: BLE001 - no meta kernel, real tensors made in forward, data-dependent ops
                pass
        with with_hooks(model, specs) as run:
            out = model(*args)
        return run.record, _shape_tree(out)


def _last_track(rec: Any, path: str) -> tuple[Any, bool]:
    """``(shape, same)`` of the module's last call; ``(None, False)`` when it did not run."""
    calls = rec.calls(path, "shape") if path in rec else ()
    return calls[-1] if calls else (None, False)


def _last_shape(rec: Any, path: str) -> Any:
    return _last_track(rec, path)[0]


def model_sizes(m: nn.Module, size: Sequence[int] = DEFAULT_SIZE) -> list[Shape]:
    """The output shape of each child of `m` on :func:`dummy_batch`.

    Args:
        m: the model; its children are ``m.children()`` (the layers of a Sequential).
        size: passed to :func:`dummy_batch`.

    Returns:
        One :class:`Shape` per child, in order (a tree of shapes for a child returning a
        tuple; None for a child that did not run). Computed on the meta device when it can be.

    Raises:
        TypeError, ValueError: from :func:`dummy_batch`; whatever `m` raises on the batch.

    Example:
        >>> import funhooks as fh
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 3, stride=2, padding=1))
        >>> fh.model_sizes(m)
        [(1, 16, 64, 64), (1, 32, 32, 32)]
    """
    x = dummy_batch(m, size)
    children = list(_torch.unwrap(m).named_children())
    if not children:
        return []
    rec, _ = _shapes(m, [c for _, c in children], (x,))
    return [_last_shape(rec, name) for name, _ in children]


def num_features_model(m: nn.Module) -> int:
    """The number of output features (channels) of `m`: dimension 1 of its output.

    Tries square inputs of side 32, 64, ... up to 2048 for models that need a big input.

    Args:
        m: the model.

    Returns:
        ``output.shape[1]`` on a dummy batch.

    Raises:
        TypeError: when the model has no conv or linear layer, or returns no tensor.
        RuntimeError: what the model raised on the largest size tried.

    Example:
        >>> import funhooks as fh
        >>> from torch import nn
        >>> fh.num_features_model(nn.Sequential(nn.Conv2d(5, 4, 3), nn.Conv2d(4, 3, 3)))
        3
    """
    dims = _first_layer("num_features_model", m).weight.ndim - 2  # 0 for a Linear first layer
    side = _FEATURE_SIZE_FIRST
    while True:
        try:
            _, out = _shapes(m, None, (dummy_batch(m, (side,) * dims),))
            break
        except (RuntimeError, ValueError):
            if side >= _FEATURE_SIZE_LAST or dims == 0:
                raise
            side *= 2
    if not isinstance(out, Shape) or len(out) < 2:
        raise TypeError(
            f"num_features_model: the model's output is a tensor with a feature dimension 1, got shape "
            f"{out!r}. Pass the part of the model that returns features."
        )
    return out[1]


def _row(path: str, module: nn.Module, track: tuple[Any, bool]) -> LayerRow:
    """fastai 2.8's ``_track`` row: parameter count and trainable only for a module with a
    ``weight`` attribute (``hasattr``, so a BatchNorm without affine gives ``0, False``)."""
    params, trainable = total_params(module) if hasattr(module, "weight") else (NO_WEIGHT, NO_WEIGHT)
    return LayerRow(path, _torch.own_class(module).__name__, params, trainable, *track)


def _rows(model: nn.Module, args: tuple[Any, ...]) -> tuple[LayerRow, ...]:
    rec, _ = _shapes(model, _is_leaf, args)
    return tuple(_row(path, mod, _last_track(rec, path))
                 for path, mod in _torch.named_modules(_torch.unwrap(model)) if _is_leaf(path, mod))


def _first_example(value: Any) -> Any:
    return _torch.tree_map(lambda x: x[:1] if isinstance(x, torch.Tensor) and x.ndim else x, value)


def layer_info(model: nn.Module, *xb: Any) -> list[LayerRow]:
    """One row per leaf module of `model`, run on the first example of `xb`, as fastai's.

    Args:
        model: the model (wrappers such as ``torch.compile`` are looked through).
        *xb: the model's inputs, batch first; only the first example is used.

    Returns:
        A list of :class:`LayerRow` ``(type, params, trainable, shape, same)`` with
        ``.path``, in module order, equal to fastai 2.8's rows: `params` and `trainable` are
        ``''`` for a module without a ``weight``; `shape` is the last call's output shape
        (batch dimension 1); `same` says whether that call kept its input's size.

    Raises:
        Whatever `model` raises on the inputs.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))
        >>> fh.layer_info(m, torch.randn(16, 1))[:2]
        [LayerRow(path='0', type='Linear', params=100, trainable=True, shape=(1, 50), same=False), LayerRow(path='1', type='ReLU', params='', trainable='', shape=(1, 50), same=True)]
    """
    return list(_rows(model, _first_example(xb)))


def module_summary(model: nn.Module, *xb: Any) -> ModuleSummary:
    """A summary of `model` on the inputs `xb`: ``print`` it for fastai's table.

    Output shapes are those of the whole batch you pass (computed on the meta device, so a
    big batch costs nothing); fastai ran one example and wrote the batch size in front.
    Totals count every parameter of the model once, including those of non-leaf modules.

    Args:
        model: the model.
        *xb: the model's inputs.

    Returns:
        A :class:`ModuleSummary`.

    Raises:
        Whatever `model` raises on the inputs.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))
        >>> s = fh.module_summary(m, torch.randn(16, 1))
        >>> s.total, s.trainable, s.rows[-1]
        (251, 251, LayerRow(path='3', type='Linear', params=51, trainable=True, shape=(16, 1), same=False))
    """
    inner = _torch.unwrap(model)
    params = list(inner.parameters())
    return ModuleSummary(
        model=_torch.own_class(inner).__name__,
        input_shapes=tuple(_shape_tree(x) for x in xb),
        rows=_rows(model, xb),
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
    )
