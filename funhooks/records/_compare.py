"""Comparing stored values exactly, whatever their layout: what ``Record.equal`` uses.

Dense tensors compare with ``torch.allclose`` (exact by default); sparse tensors by layout
and values; meta tensors by shape and dtype; quantized tensors by scheme, scales, zero
points and integer values; containers by type and structure (namedtuples by name and
fields, as a loaded Record rebuilds them); other values by type and ``==``.

Cost: one pass over both values; a sparse pair with different indices is densified.
"""

from __future__ import annotations

import cmath
import collections

import torch

from funhooks import _torch

from .node import StoredValue

__all__ = ["PLAIN", "DICTS", "TENSORS", "is_namedtuple", "same"]

PLAIN = frozenset({int, float, complex, str, bool, type(None), torch.dtype, torch.device, torch.Size})
"""Leaf types, besides tensors, that ``torch.load(weights_only=True)`` reads back without running code."""
TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
"""Tensor types it reads back; other subclasses need their class imported (nested tensors excepted)."""
DICTS = frozenset({dict, collections.OrderedDict})


def is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple) and hasattr(cls, "_make")



def same(x: StoredValue, y: StoredValue, rtol: float, atol: float) -> bool:
    """`x` and `y` are equal values in the sense of :meth:`Record.equal`."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and _same_tensor(x, y, rtol, atol)
    if isinstance(x, tuple) and isinstance(y, tuple):
        return (_same_tuple_type(type(x), type(y)) and len(x) == len(y)
                and all(same(a, b, rtol, atol) for a, b in zip(x, y)))
    if type(x) is not type(y):
        return False
    if type(x) is list:
        return len(x) == len(y) and all(same(a, b, rtol, atol) for a, b in zip(x, y))
    if type(x) in (dict, collections.OrderedDict):
        return x.keys() == y.keys() and all(same(x[k], y[k], rtol, atol) for k in x)
    x_leaves, x_spec = _torch.pytree.tree_flatten(x)
    if len(x_leaves) == 1 and x_leaves[0] is x:  # not a container
        return _same_plain(x, y)
    y_leaves, y_spec = _torch.pytree.tree_flatten(y)
    return x_spec == y_spec and all(same(a, b, rtol, atol) for a, b in zip(x_leaves, y_leaves))


def _same_tuple_type(a: type, b: type) -> bool:
    """Same tuple type; namedtuples match by name and fields, as :meth:`Record.load` rebuilds them."""
    return a is b or (is_namedtuple(a) and is_namedtuple(b) and a.__name__ == b.__name__
                      and getattr(a, "_fields") == getattr(b, "_fields"))


def _same_plain(x: StoredValue, y: StoredValue) -> bool:
    if x is y:
        return True
    if isinstance(x, (float, complex)) and cmath.isnan(x) and cmath.isnan(y):
        return True
    if getattr(x, "shape", None) != getattr(y, "shape", None):  # arrays: `==` would broadcast
        return False
    same = x == y
    if isinstance(same, bool):
        return same
    reduce = getattr(same, "all", None)
    return bool(reduce() if callable(reduce) else same)


_COMPRESSED = {
    torch.sparse_csr: ("crow_indices", "col_indices"),
    torch.sparse_bsr: ("crow_indices", "col_indices"),
    torch.sparse_csc: ("ccol_indices", "row_indices"),
    torch.sparse_bsc: ("ccol_indices", "row_indices"),
}
"""Sparse compressed layouts and the methods giving their two index tensors."""


def _same_tensor(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    if x.is_nested or y.is_nested:
        if not (x.is_nested and y.is_nested and x.layout == y.layout and x.dtype == y.dtype):
            return False
        xs, ys = x.unbind(), y.unbind()
        return len(xs) == len(ys) and all(_same_tensor(a, b, rtol, atol) for a, b in zip(xs, ys))
    if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout or x.is_meta != y.is_meta:
        return False
    if x.is_meta:
        return True
    y = y.to(x.device)
    if x.is_quantized:
        return _same_quantized(x, y, rtol, atol)
    if x.layout == torch.sparse_coo:
        x, y = x.coalesce(), y.coalesce()
        if torch.equal(x.indices(), y.indices()):
            return _same_dense(x.values(), y.values(), rtol, atol)
        return _same_dense(x.to_dense(), y.to_dense(), rtol, atol)
    if x.layout in _COMPRESSED:
        compressed, plain = _COMPRESSED[x.layout]
        if (x.values().shape == y.values().shape and torch.equal(getattr(x, compressed)(), getattr(y, compressed)())
                and torch.equal(getattr(x, plain)(), getattr(y, plain)())):
            return _same_dense(x.values(), y.values(), rtol, atol)
        return _same_dense(x.to_dense(), y.to_dense(), rtol, atol)
    return _same_dense(x, y, rtol, atol)


def _same_quantized(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    scheme = x.qscheme()
    if scheme != y.qscheme():
        return False
    if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
        scales = torch.tensor([x.q_scale()]), torch.tensor([y.q_scale()])
        zero_points = torch.tensor([x.q_zero_point()]), torch.tensor([y.q_zero_point()])
    else:
        if x.q_per_channel_axis() != y.q_per_channel_axis():
            return False
        scales = x.q_per_channel_scales(), y.q_per_channel_scales()
        zero_points = x.q_per_channel_zero_points(), y.q_per_channel_zero_points()
    return (_same_dense(*scales, rtol, atol) and torch.equal(*zero_points)
            and _same_dense(x.int_repr(), y.int_repr(), rtol, atol))


def _same_dense(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    try:
        return torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    except (NotImplementedError, RuntimeError):  # float8 and bit-packed dtypes lack kernels for `isclose`
        pass  # (torch < 2.5 says so with a RuntimeError)
    wide = torch.complex64 if x.is_complex() else torch.float32
    try:
        return torch.allclose(x.to(wide), y.to(wide), rtol=rtol, atol=atol, equal_nan=True)
    except NotImplementedError:  # no conversion either: compare the bits
        return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
