"""An Attribution's notebook display: a heatmap whose numbers are the table's, rounded as shown,
labelled by point and token, coloured by sign; and its picture, an SVG heatmap of the same."""

from __future__ import annotations

from xml.etree import ElementTree

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


_SVG = "{http://www.w3.org/2000/svg}"


def _picture(svg: str) -> tuple[list[tuple[str, float]], list[str], str]:
    """What the SVG heatmap shows: each cell's fill and its exact value (read from the hover
    text), the labels written, and the whole text; checked to be well-formed standalone SVG that
    needs nothing but itself."""
    root = ElementTree.fromstring(svg)
    assert root.tag == f"{_SVG}svg" and int(root.get("width")) > 50 and int(root.get("height")) > 50
    cells = [(r.get("fill"), float(r.find(f"{_SVG}title").text.rsplit(": ", 1)[1]))
             for r in root.iter(f"{_SVG}rect") if r.find(f"{_SVG}title") is not None]
    labels = ["".join(t.itertext()) for t in root.iter(f"{_SVG}text")]
    lowered = svg.lower().replace('xmlns="http://www.w3.org/2000/svg"', "")
    for needle in ("<script", "href", "http://", "https://", "@import", "<image", "<foreignobject"):
        assert needle not in lowered, f"the picture holds {needle!r}"
    return cells, labels, svg


def test_the_picture_colours_each_value_under_its_token_with_the_exact_value_on_hover() -> None:
    result = _result()
    tokens = ["The", "cat", "sat", "on", "mat"]
    cells, labels, _ = _picture(result.svg(tokens=tokens))
    values = result.table.flatten().tolist()
    assert [v for _, v in cells] == pytest.approx(values)
    scale = max(abs(v) for v in values)
    for (fill, _), v in zip(cells, values):
        assert fill == f"rgba({'214,39,40' if v > 0 else '31,119,180'},{min(abs(v) / scale, 1):.2f})"
    assert labels[0] == f"Attribution patching: clean {result.clean.item():.3f}, corrupt {result.corrupt.item():.3f}"
    assert labels[1:3] == ["0", "1"] and labels[3:8] == tokens
    assert labels[-1] == f"red > 0 > blue; full colour at |value| = {scale:.4g}"
    assert isinstance(result.svg(), str) and result.svg()._repr_svg_() == str(result.svg())
    assert _picture(result.svg())[1][3:8] == ["0", "1", "2", "3", "4"]  # positions by index


def test_the_picture_has_a_row_per_point_and_head_and_escapes_tokens() -> None:
    result = _result(heads=2)
    cells, labels, svg = _picture(result.svg(tokens=["<script>alert(1)</script>", "&", "<b>", "x", "y"]))
    assert labels[1:5] == ["0 · head 0", "0 · head 1", "1 · head 0", "1 · head 1"]
    assert labels[5:8] == ["<script>alert(1)</script>", "&", "<b>"] and "<b>" not in svg
    assert [v for _, v in cells[15:20]] == pytest.approx(result.table[1, :, 1].tolist())
    with pytest.raises(ValueError, match=r"Attribution.svg: `tokens` has one label per position \(5\), got 2"):
        result.svg(tokens=["a", "b"])


def test_a_large_tables_picture_is_cut_to_the_row_cap() -> None:
    points = tuple(f"transformer.h.{i}.attn" for i in range(500))
    result = fh.Attribution(torch.randn(500, 20), points, torch.tensor(1.0), torch.randn(64))
    cells, labels, svg = _picture(result.svg())
    assert len(cells) == 400 * 20 and labels[-1].endswith("; … 100 more rows not shown")
    assert len(svg) < 2_000_000
