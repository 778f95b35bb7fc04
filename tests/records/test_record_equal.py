"""Record.equal on every kind of tensor: dense, sparse, meta, quantized, and container types."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import funhooks as fh

Pair = collections.namedtuple("Pair", "left right")


def quantized(values: torch.Tensor, scale: float = 0.5, zero_point: int = 3) -> torch.Tensor:
    return torch.quantize_per_tensor(values, scale, zero_point, torch.quint8)


# -- equal on every kind of tensor (issue 11, item 18) -------------------------------------

exotic_tensors = pytest.mark.filterwarnings(
    "ignore:Sparse .* tensor support is in beta state:UserWarning",
    "ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning",
)


def one(value: Any) -> fh.Record:
    return fh.Record({"m": {"v": (value,)}})


@exotic_tensors
def test_equal_answers_for_sparse_tensors_by_layout_and_values() -> None:
    """Sparse tensors are equal when layout, shape, dtype and values agree, whatever their index layout."""
    dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    other = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 5.0]])
    uncoalesced = torch.sparse_coo_tensor([[0, 1, 1], [1, 0, 0]], [1.0, 1.5, 0.5], (2, 3), check_invariants=True)
    explicit_zero = torch.sparse_coo_tensor([[0, 1, 1], [1, 0, 2]], [1.0, 2.0, 0.0], (2, 3), check_invariants=True)
    assert one(dense.to_sparse()).equal(one(dense.to_sparse()))
    assert one(dense.to_sparse()).equal(one(uncoalesced)) and one(dense.to_sparse()).equal(one(explicit_zero))
    assert not one(dense.to_sparse()).equal(one(other.to_sparse()))
    assert not one(dense.to_sparse()).equal(one(dense)) and not one(dense.to_sparse()).equal(one(dense.to_sparse_csr()))
    for layout in ("to_sparse_csr", "to_sparse_csc"):
        assert one(getattr(dense, layout)()).equal(one(getattr(dense, layout)()))
        assert not one(getattr(dense, layout)()).equal(one(getattr(other, layout)()))
    block = torch.zeros(4, 4)
    block[:2, 2:] = 1.0
    assert one(block.to_sparse_bsr((2, 2))).equal(one(block.to_sparse_bsr((2, 2))))
    assert one(block.to_sparse_bsr((2, 2))).equal(one(block.to_sparse_bsr((1, 1))))  # same values, other blocks
    assert not one(block.to_sparse_bsr((2, 2))).equal(one((block * 2).to_sparse_bsr((2, 2))))


def test_equal_answers_for_meta_tensors_by_shape_and_dtype() -> None:
    """Meta tensors hold no values: equal when shape and dtype agree; never equal to a real tensor."""
    meta = torch.empty(2, 3, device="meta")
    assert one(meta).equal(one(torch.empty(2, 3, device="meta")))
    assert not one(meta).equal(one(torch.empty(3, 2, device="meta")))
    assert not one(meta).equal(one(torch.empty(2, 3, device="meta", dtype=torch.float16)))
    assert not one(meta).equal(one(torch.zeros(2, 3))) and not one(torch.zeros(2, 3)).equal(one(meta))


@exotic_tensors
def test_equal_answers_for_quantized_tensors_by_scheme_parameters_and_int_values() -> None:
    """Quantized tensors are equal when qscheme, scales, zero points and int values agree."""
    values = torch.tensor([0.0, 1.0, 2.5])
    assert one(quantized(values)).equal(one(quantized(values)))
    assert not one(quantized(values)).equal(one(quantized(values + 1)))
    assert not one(quantized(values)).equal(one(quantized(values, scale=0.25)))
    assert not one(quantized(values)).equal(one(quantized(values, zero_point=4)))
    assert not one(quantized(values)).equal(one(values))
    scales, zero_points = torch.tensor([0.5, 0.25]), torch.tensor([0, 1])
    channels = torch.quantize_per_channel(torch.ones(2, 3), scales, zero_points, 0, torch.qint8)
    assert one(channels).equal(one(torch.quantize_per_channel(torch.ones(2, 3), scales, zero_points, 0, torch.qint8)))
    assert not one(channels).equal(one(torch.quantize_per_channel(torch.ones(2, 3), scales, zero_points * 2, 0, torch.qint8)))
    assert not one(channels).equal(one(torch.quantize_per_channel(torch.ones(2, 3), scales * 2, zero_points, 0, torch.qint8)))


def test_equal_answers_for_dtypes_without_comparison_kernels() -> None:
    """float8 tensors (no kernel for a tolerant `isclose`) compare by value, with a tolerance too."""
    x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert one(x).equal(one(x.clone())) and not one(x).equal(one((x.float() * 2).to(torch.float8_e4m3fn)))
    assert one(x).equal(one(x.clone()), rtol=1e-3) and not one(x).equal(one((x.float() * 2).to(torch.float8_e4m3fn)), rtol=1e-3)


def test_equal_compares_the_structure_of_each_value(device: torch.device) -> None:
    """Containers must match too: other dict keys, a list for a tuple or another type of leaf are not equal."""
    t = torch.ones(2, device=device)
    assert not one({"a": t}).equal(one({"b": t}))
    assert not one((t, 1)).equal(one([t, 1]))
    assert not one((1, 2)).equal(one((1, 2.0)))
    assert one({"a": (t, [1, None])}).equal(one({"a": (t.clone(), [1, None])}))
    assert one(float("nan")).equal(one(float("nan")))  # as tensors compare with equal_nan=True


# Drawn pairs of tensors of one kind, the second often a re-encoding of the first's values.
cells = st.lists(st.sampled_from([0.0, 1.0, -2.0, 0.5]), min_size=6, max_size=6).map(
    lambda xs: torch.tensor(xs).reshape(2, 3))


@st.composite
def dense_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    a = draw(cells)
    b = draw(st.one_of(st.just(a.clone()), cells))
    return a, b


def _sparse(draw: st.DrawFn, dense: torch.Tensor) -> torch.Tensor:
    layout = draw(st.sampled_from(["coo", "uncoalesced", "csr", "csc"]))
    if layout == "uncoalesced":  # every cell split into two entries that add up to it
        idx = torch.cartesian_prod(torch.arange(2), torch.arange(3)).T
        half = dense.reshape(-1) / 2
        return torch.sparse_coo_tensor(torch.cat([idx, idx], 1), torch.cat([half, half]), (2, 3),
                                       check_invariants=True)
    return {"coo": dense.to_sparse, "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc}[layout]()


@exotic_tensors
@given(dense_pairs(), st.data())
def test_equal_on_sparse_tensors_is_equality_of_layout_and_dense_values(pair: tuple, data: st.DataObject) -> None:
    """For sparse tensors `equal` answers (never raises) and agrees with comparing layouts and dense values."""
    a, b = (_sparse(data.draw, t) for t in pair)
    expected = a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())
    assert one(a).equal(one(b)) == expected == one(b).equal(one(a))
    assert one(a).equal(one(a))


@exotic_tensors
@given(dense_pairs(), st.sampled_from([0.5, 0.25]), st.sampled_from([0.5, 0.25]), st.sampled_from([0, 3]),
       st.sampled_from([0, 3]), st.booleans())
def test_equal_on_quantized_tensors_is_equality_of_parameters_and_int_values(
    pair: tuple, scale_a: float, scale_b: float, zero_a: int, zero_b: int, per_channel: bool
) -> None:
    """For quantized tensors `equal` agrees with comparing qscheme, scales, zero points and int values."""
    if per_channel:
        a = torch.quantize_per_channel(pair[0], torch.tensor([scale_a, 0.5]), torch.tensor([zero_a, 0]), 0, torch.quint8)
        b = torch.quantize_per_channel(pair[1], torch.tensor([scale_b, 0.5]), torch.tensor([zero_b, 0]), 0, torch.quint8)
    else:
        a, b = quantized(pair[0], scale_a, zero_a), quantized(pair[1], scale_b, zero_b)
    expected = scale_a == scale_b and zero_a == zero_b and torch.equal(a.int_repr(), b.int_repr())
    assert one(a).equal(one(b)) == expected == one(b).equal(one(a))


@given(st.sampled_from([(2, 3), (3, 2), (6,)]), st.sampled_from([(2, 3), (3, 2), (6,)]),
       st.sampled_from([torch.float32, torch.int64]), st.sampled_from([torch.float32, torch.int64]))
def test_equal_on_meta_tensors_is_equality_of_shape_and_dtype(shape_a: tuple, shape_b: tuple, dtype_a: torch.dtype,
                                                              dtype_b: torch.dtype) -> None:
    """For meta tensors `equal` agrees with comparing shape and dtype."""
    a, b = torch.empty(shape_a, dtype=dtype_a, device="meta"), torch.empty(shape_b, dtype=dtype_b, device="meta")
    assert one(a).equal(one(b)) == (shape_a == shape_b and dtype_a == dtype_b)
