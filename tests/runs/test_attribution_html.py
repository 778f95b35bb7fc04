"""An Attribution's notebook display: a heatmap whose numbers are the table's, rounded as shown,
labelled by point and token, coloured by sign."""

from __future__ import annotations

import pytest
import torch
from html_kit import assert_self_contained, seen
from torch import nn

import funhooks as fh


def _result(heads: int | None = None) -> fh.Attribution:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    atp = fh.attribution_patching(model, ["0", "1"], lambda out: out.sum(), heads=heads)
    return atp(torch.randn(1, 5, 3), torch.randn(1, 5, 3))


def test_the_heatmap_shows_each_value_rounded_under_its_token() -> None:
    result = _result()
    markup = result.html(tokens=["The", " cat", " sat", " on", " mat"])
    shown = seen(markup)
    assert shown.texts()[0] == ["point", "The", " cat", " sat", " on", " mat"]
    assert [r[0] for r in shown.texts()[1:]] == ["0", "1"]
    expected = [[f"{round(v, 3):.3f}" for v in row] for row in result.table.tolist()]
    assert [r[1:] for r in shown.texts()[1:]] == expected
    for row, values in zip(shown.rows[1:], result.table.tolist()):
        for cell, v in zip(row[1:], values):
            assert float(cell.title) == pytest.approx(v)  # the exact value on hover
            assert cell.background.startswith("rgba(214,39,40" if v > 0 else "rgba(31,119,180")
    assert f"clean {result.clean.item():.3f}" in shown.caption and f"corrupt {result.corrupt.item():.3f}" in shown.caption
    assert_self_contained(markup)
    assert result._repr_html_() == result.html()  # a notebook shows positions by index
    assert seen(result._repr_html_()).texts()[0] == ["point", "0", "1", "2", "3", "4"]


def test_with_heads_each_point_and_head_is_a_row() -> None:
    result = _result(heads=2)
    rows = seen(result._repr_html_()).texts()[1:]
    assert [r[0] for r in rows] == ["0 · head 0", "0 · head 1", "1 · head 0", "1 · head 1"]
    assert rows[3][1:] == [f"{round(v, 3):.3f}" for v in result.table[1, :, 1].tolist()]


def test_tokens_are_escaped_and_must_be_one_per_position() -> None:
    result = _result()
    markup = result.html(tokens=["<script>alert(1)</script>", "&", "<b>", "x", "y"])
    assert "<script" not in markup and "<b>" not in markup
    assert seen(markup).texts()[0][1:4] == ["<script>alert(1)</script>", "&", "<b>"]
    with pytest.raises(ValueError, match=r"Attribution.html: `tokens` has one label per position \(5\), got 2"):
        result.html(tokens=["a", "b"])


def test_a_large_table_is_cut_and_its_repr_stays_short() -> None:
    points = tuple(f"transformer.h.{i}.attn" for i in range(500))
    result = fh.Attribution(torch.randn(500, 20), points, torch.tensor(1.0), torch.randn(64))
    rows = seen(result._repr_html_()).texts()
    assert rows[-1][0].startswith("… 100 more") and len(rows) == 1 + 400 + 1
    assert len(repr(result)) < 250 and "Tensor(500, 20)" in repr(result) and "Tensor(64,)" in repr(result)
