"""Model utilities with fastai's names and results: parameter counts, dummy passes, shapes,
per-layer rows and the summary table.

Shapes are computed in one pass: a real one under ``torch.no_grad()`` while it is small (a
budget of FLOPs and tensor bytes; see :mod:`funhooks.summary._shapes`), else on the *meta*
device: for one call, the model's parameters, buffers and inputs are replaced by meta tensors
of the same shapes (and put back after, however the call ends), so no memory is allocated and
no arithmetic is done, however large the model or batch. A model the meta device cannot run (a
kernel without a meta implementation, a real tensor made inside ``forward``, Python control
flow on tensor values) falls back to one real pass without a budget. A tensor that ``forward``
caches as a plain module attribute during a pass is put back as it was; caches kept elsewhere
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

from collections.abc import Sequence
from typing import Any, TypeVar, cast

import attrs
import torch
from torch import nn

from funhooks import _torch
from funhooks._modes import in_mode
from funhooks.records.record import Record
from funhooks.runs.introspect import isolated

from ._shapes import NOT_RUN, Pass, Track, is_leaf, last_shape, nbytes, record_shapes, tracks
from .table import LAYOUTS, NO_WEIGHT, LayerRow, Layout, ModuleSummary, Shape, ShapeTree, SummaryRow, shape_tree

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

_DEFAULT_SIZE = (64, 64)
"""fastai's default spatial size of a dummy batch."""

_DUMMY_RANGE = (-1.0, 1.0)  # a dummy batch is uniform on this interval, as fastai's
_DUMMY_SEED = 0  # the private generator's seed: dummy batches are reproducible
_FEATURE_SIZE_FIRST = 32  # num_features_model tries square inputs of this side...
_FEATURE_SIZE_LAST = 2048  # ...doubling up to this one, for models that need big inputs
_FIRST_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)
_T = TypeVar("_T")


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


def _first_layer(caller: str, m: nn.Module) -> nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d:
    """The first Linear or ConvNd of `m`."""
    for _, layer in _torch.named_modules(m):
        if isinstance(layer, _FIRST_LAYERS):
            return layer
    raise TypeError(
        f"{caller}: the input size is read from the first `Linear` or `Conv1d/2d/3d` layer, got "
        f"{type(m).__name__} with none. Build the input yourself and call the model."
    )


def dummy_batch(m: nn.Module, size: Sequence[int] = _DEFAULT_SIZE) -> torch.Tensor:
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
                f"({type(layer).__name__}: {dims}), got {size!r}. Pass size={(_DEFAULT_SIZE[0],) * dims!r}."
            )
        shape = (1, layer.in_channels, *size)
    weight = layer.weight
    gen = torch.Generator().manual_seed(_DUMMY_SEED)
    low, high = _DUMMY_RANGE
    x = torch.rand(shape, generator=gen) * (high - low) + low
    return x.to(device=weight.device, dtype=weight.dtype)


def dummy_eval(m: nn.Module, size: Sequence[int] = _DEFAULT_SIZE) -> Any:
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
    with in_mode(m, False), torch.no_grad(), isolated(), _torch.sharding_kept(m):  # funhooks' own pass
        return m(x)


# -- shapes ------------------------------------------------------------------------------------


def model_sizes(m: nn.Module, size: Sequence[int] = _DEFAULT_SIZE) -> list[Shape]:
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
    rec = record_shapes(m, [c for _, c in children], (x,)).record
    # a Shape per child returning a tensor (fastai's case); a tree, or None, for any other
    return cast("list[Shape]", [last_shape(rec, name) for name, _ in children])


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
            out = record_shapes(m, None, (dummy_batch(m, (side,) * dims),)).output
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


def _row(path: str, module: nn.Module, calls: tuple[Track, ...],
         counted: tuple[int, bool] | None = None) -> LayerRow:
    """fastai 2.8's ``_track`` row: parameter count and trainable only for a module with a
    ``weight`` attribute (``hasattr``, so a BatchNorm without affine gives ``0, False``).
    `counted`: its :func:`total_params`, where the caller has them."""
    params: int | str
    trainable: bool | str
    if not hasattr(module, "weight"):
        params, trainable = NO_WEIGHT, NO_WEIGHT
    else:
        params, trainable = total_params(module) if counted is None else counted
    track = calls[-1] if calls else NOT_RUN
    return LayerRow(path, _torch.own_class(module).__name__, params, trainable, track.shape, track.same)


def _rows(model: nn.Module, rec: Record) -> tuple[LayerRow, ...]:
    return tuple(_row(path, mod, tracks(rec, path))
                 for path, mod in _torch.named_modules(_torch.unwrap(model)) if is_leaf(path, mod))


def _first_example(value: _T) -> _T:
    return _torch.tree_map(lambda x: x[:1] if isinstance(x, torch.Tensor) and x.ndim else x, value)


def layer_info(model: nn.Module, *xb: object) -> list[LayerRow]:
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
        Exception: whatever `model` raises on the inputs.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))
        >>> fh.layer_info(m, torch.randn(16, 1))[:2]
        [LayerRow(path='0', type='Linear', params=100, trainable=True, shape=(1, 50), same=False), LayerRow(path='1', type='ReLU', params='', trainable='', shape=(1, 50), same=True)]
    """
    return list(_rows(model, record_shapes(model, is_leaf, _first_example(xb)).record))


def _depth(path: str) -> int:
    return path.count(".") + 1 if path else 0


class _Sizes:
    """Each parameter's size, read once, by id; and those that require no grad (usually none):
    a subtree's counts are then two sums over the ids it holds, at C speed."""

    __slots__ = ("frozen", "sizes")

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.sizes = {id(p): p.numel() for p in params}
        self.frozen = {id(p) for p in params if not p.requires_grad}

    def count(self, ids: set[int]) -> tuple[int, int]:
        """``(count, trainable count)`` of the parameters `ids` (each once)."""
        total = sum(map(self.sizes.__getitem__, ids))
        return total, total - sum(map(self.sizes.__getitem__, ids & self.frozen)) if self.frozen else total


def _subtree_ids(model: nn.Module, own: dict[int, list[nn.Parameter]]) -> dict[int, set[int]]:
    """Per module (by id), the ids of the parameters of its subtree: each module's `own` added to
    its ancestors' in one walk of the tree, not one walk per module."""
    below: dict[int, set[int]] = {}

    def gather(module: nn.Module) -> set[int]:
        key = id(module)
        if key not in below:
            found = below[key] = set(map(id, own[key]))  # a module met again (shared) adds nothing twice, nor a cycle
            for child in _torch.children(module).values():
                if child is not None:
                    found |= gather(_torch.unwrap(child))  # a compiled submodule: the module it wraps
        return below[key]

    gather(model)
    return below


def _layer(path: str, module: nn.Module, found: Pass, root_inputs: ShapeTree, calls: tuple[Track, ...],
           params: tuple[int, int], own: int) -> SummaryRow:
    last = calls[-1] if calls else NOT_RUN
    return SummaryRow(
        path=path, type=_torch.own_class(module).__name__, depth=_depth(path),
        input_shape=root_inputs if not path else last.inputs,
        output_shape=found.output if not path else last.shape,
        params=params[0], trainable=params[1], own_params=own,
        flops=None if found.flops is None else found.flops.get(path, 0), calls=len(calls),
    )


@attrs.frozen
class _Within:
    """Selects the leaves and every module down to `depth` (None: every module). A value, so
    that the same summary asked twice reuses the run's plan."""

    depth: int | None

    def __call__(self, path: str, module: nn.Module) -> bool:
        return self.depth is None or _depth(path) <= self.depth or is_leaf(path, module)


def _check_options(depth: int | None, layout: Layout | None) -> None:
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 0):
        raise ValueError(f"module_summary: `depth` is None or an int >= 0, got {depth!r}. "
                         "Pass depth=0 for the model alone.")
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"module_summary: `layout` is 'fastai' or 'full' (or None: 'fastai' for positional inputs "
                         f"alone), got {layout!r}. Pick one of those.")


def module_summary(model: nn.Module, *xb: object, depth: int | None = None, layout: Layout | None = None,
                   **kwargs: object) -> ModuleSummary:
    """A summary of `model` on the inputs `xb` and `kwargs`: ``print`` it for the table.

    Output shapes are those of the whole batch you pass (a big batch is computed on the meta
    device, so it costs nothing); fastai ran one example and wrote the batch size in front.
    Totals count every parameter of the model once, including those of non-leaf modules and
    weights tied between modules. FLOPs are counted with ``torch.utils.flop_counter``'s formulas
    in the same pass, attention included on every path (the CPU's fused attention kernel too).

    Args:
        model: the model.
        *xb: the model's positional inputs.
        depth: list the modules down to this many path segments in :attr:`ModuleSummary.layers`
            (0: the model alone; None: every module).
        layout: what ``str()`` prints: ``"fastai"`` (fastai's leaf table) or ``"full"`` (every
            module down to `depth` with input and output shapes, parameters, MACs and FLOPs, and
            memory estimates). None: ``"fastai"`` when called as fastai's ``module_summary(model,
            *xb)``, ``"full"`` when `kwargs` or `depth` are given.
        **kwargs: the model's keyword inputs (``input_ids=...``, ``attention_mask=...``; a
            tokenizer's output as ``**batch``). A model keyword named ``depth`` or ``layout``
            cannot be passed here: wrap the model.

    Returns:
        A :class:`ModuleSummary`.

    Raises:
        ValueError: for a `depth` or `layout` outside those above, before the model runs.
        Exception: whatever `model` raises on the inputs.

    Example:
        >>> import torch, funhooks as fh
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.BatchNorm1d(50), nn.Linear(50, 1))
        >>> s = fh.module_summary(m, torch.randn(16, 1))
        >>> s.total, s.trainable, s.rows[-1]
        (251, 251, LayerRow(path='3', type='Linear', params=51, trainable=True, shape=(16, 1), same=False))
        >>> s.flops, s.macs, s.layout
        (3200, 1600, 'fastai')
        >>> [(r.path, r.input_shape, r.output_shape) for r in fh.module_summary(m, torch.randn(16, 1), depth=0).layers]
        [('', ((16, 1),), (16, 1))]
    """
    _check_options(depth, layout)
    inner = _torch.unwrap(model)
    found = record_shapes(model, _Within(depth), xb, kwargs, count_flops=True)
    root_inputs = shape_tree(xb if not kwargs else {**{str(i): x for i, x in enumerate(xb)}, **kwargs})
    modules = list(_torch.named_modules(inner))
    calls = {p: tracks(found.record, p) for p, _ in modules}
    # each module's own parameters, each once (`parameters(recurse=False)`, without its generators)
    own = {id(m): list({id(p): p for p in _torch.own_parameters(m).values() if p is not None}.values())
           for _, m in modules}
    params = list({id(p): p for found_here in own.values() for p in found_here}.values())  # every module's: each once
    sizes = _Sizes(params)
    subtree = _subtree_ids(inner, own)
    layers = tuple(_layer(p, m, found, root_inputs, calls[p], sizes.count(subtree[id(m)]),
                          sum(map(sizes.sizes.__getitem__, map(id, own[id(m)]))))
                   for p, m in modules if depth is None or _depth(p) <= depth)
    leaves = [(p, m) for p, m in modules if is_leaf(p, m)]
    # a leaf's `parameters()` are its own: `total_params` from the sizes read above
    rows = tuple(_row(p, m, calls[p], (sum(map(sizes.sizes.__getitem__, map(id, own[id(m)]))),
                                        any(q.requires_grad for q in own[id(m)])))
                 for p, m in leaves)
    return ModuleSummary(
        model=_torch.own_class(inner).__name__,
        input_shapes=tuple(shape_tree(x) for x in xb),
        rows=rows,
        total=sum(p.numel() for p in params),
        trainable=sum(p.numel() for p in params if p.requires_grad),
        kwarg_shapes=tuple((k, shape_tree(v)) for k, v in kwargs.items()),
        layers=layers,
        depth=depth,
        flops=None if found.flops is None else found.flops[""],
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        input_bytes=nbytes((xb, kwargs)),
        activation_bytes=sum(t.output_bytes for p, _ in leaves for t in calls[p]),
        layout=layout or ("fastai" if depth is None and not kwargs else "full"),
    )
