"""The patching-table viewer: its HTML (parsed), and the page in a real headless Chromium driven
through the DevTools protocol (choose a head, sort the rows, hover a cell, read the top cells,
take a screenshot)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from browser_kit import browser, opened, screenshot  # noqa: F401  (browser: a fixture)
from torch import nn
from viewer_kit import assert_offline, parsed

import funhooks as fh

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
TOKENS = ["When", " Mary", " and", " John", "</script><b>x</b>", " &amp;", " gave"]
READY = "document.readyState === 'complete' && document.querySelector('table.fh-grid tr.fh-row') !== null"
SELECT = ("(function (cls, v) { const s = document.querySelector('select.' + cls); s.value = v;"
          " s.dispatchEvent(new Event('change')); })")


def _table(*shape: int) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(*shape) * torch.linspace(0.2, 2.0, shape[0]).view(-1, *[1] * (len(shape) - 1))


def _attribution(heads: bool = True) -> fh.Attribution:
    """An Attribution of a small model: 3 points, 7 positions (and 4 heads)."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    atp = fh.attribution_patching(model, ["0", "2", "4"] if not heads else ["0", "2"], lambda out: out.sum(),
                                  heads=4 if heads else None)
    return atp(torch.randn(1, len(TOKENS), 3), torch.randn(1, len(TOKENS), 3))


def test_the_page_holds_the_table_rounded_and_the_tokens_as_data_not_markup() -> None:
    table = _table(4, len(TOKENS), 3)
    page = parsed(fh.transformer.patching_viewer(table, tokens=TOKENS, layers=["embed", 0, 1, 2])._repr_html_())
    assert page.count("script") == 2 and page.count("b") == 1   # the token `</script><b>x</b>` did not break out
    assert "</script>" not in page.text and "Mary" not in page.text  # tokens are not markup: the script sets them
    assert_offline(page)
    data = page.data()
    assert data["tokens"] == TOKENS and data["rows"] == ["embed", "0", "1", "2"] and data["heads"] == 3
    assert data["values"] == [[[round(v, 4) for v in row] for row in head]
                              for head in table.movedim(2, 0).double().tolist()]
    assert data["bound"] == round(float(table.abs().max()), 4)
    assert {a.get("class") for t, a in page.tags if t == "select"} == {"fh-head", "fh-sort"}


def test_an_attribution_gives_its_points_metrics_and_heads() -> None:
    result = _attribution()
    viewer = fh.transformer.patching_viewer(result, tokens=TOKENS)
    assert viewer.layers == result.points and torch.equal(viewer.table, result.table.detach())
    assert viewer.title == "Attribution patching"
    assert viewer.caption == f"clean {result.clean.item():.4g}, corrupt {result.corrupt.item():.4g}"
    data = parsed(viewer.html()).data()
    assert data["heads"] == 4 and data["caption"].startswith(viewer.caption)
    flat = fh.transformer.patching_viewer(_attribution(heads=False))
    assert parsed(flat.html()).data()["heads"] == 0 and flat.tokens == tuple(map(str, range(len(TOKENS))))


def test_a_nan_is_held_as_null_and_the_scale_ignores_it() -> None:
    table = torch.tensor([[0.5, float("nan")], [-2.0, float("inf")]])
    data = parsed(fh.transformer.patching_viewer(table).html()).data()
    assert data["values"] == [[[0.5, None], [-2.0, None]]] and data["bound"] == 2.0


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"patching_viewer: `source` is a table `\(layers, positions\)`.*shape \(3,\)"):
        fh.transformer.patching_viewer(torch.rand(3))
    with pytest.raises(ValueError, match=r"patching_viewer: `source` .* got shape \(1, 2, 3, 4\)"):
        fh.transformer.patching_viewer(torch.rand(1, 2, 3, 4))
    with pytest.raises(ValueError, match=r"patching_viewer: `tokens` has one label per position \(3\), got 2"):
        fh.transformer.patching_viewer(torch.rand(2, 3), tokens=["a", "b"])
    with pytest.raises(ValueError, match=r"patching_viewer: `layers` has one label per row \(2\), got 3"):
        fh.transformer.patching_viewer(torch.rand(2, 3), layers=["a", "b", "c"])


def test_a_12_layer_table_builds_well_under_a_second() -> None:
    table = torch.randn(12, 64, 12)  # 12 layers, 64 positions, 12 heads
    start = time.perf_counter()
    html = fh.transformer.patching_viewer(table, tokens=[f"t{i}" for i in range(64)]).html()
    assert time.perf_counter() - start < 1.0
    assert len(html) < 1_000_000


def test_in_chromium_a_cell_shows_its_point_token_head_and_value(browser: str, tmp_path: Path) -> None:
    """Draws docs/images/patching-viewer.png (docs/logit-lens.md shows it)."""
    tokens = ["When", " Mary", " and", " John", " went", " to", " the", " store", ",", " John", " gave"]
    table = _table(6, len(tokens), 4)
    layers = ["embed", *map(str, range(5))]
    viewer = fh.transformer.patching_viewer(table, tokens=tokens, layers=layers, title="Head patching")
    page = viewer.save_html(tmp_path / "patching.html")
    head = 2
    shown = table[:, :, head].double()
    with opened(browser, page, tmp_path, READY) as devtools:
        devtools.evaluate(f"{SELECT}('fh-head', '{head}')")
        devtools.evaluate(f"{SELECT}('fh-sort', 'max')")
        order = devtools.evaluate("Array.from(document.querySelectorAll('tr.fh-row')).map(r => +r.dataset.row)")
        peaks = shown.abs().amax(1)
        assert order == sorted(range(6), key=lambda r: (-round(float(peaks[r]), 4), r))
        headers = devtools.evaluate("Array.from(document.querySelector('table.fh-grid tr').cells)"
                                    ".map(c => c.textContent)")
        assert headers == ["", *tokens]
        row, position = 3, 4
        devtools.evaluate(f"document.querySelector('tr.fh-row[data-row=\"{row}\"] td[data-position=\"{position}\"]')"
                          ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
        facts = devtools.evaluate("Array.from(document.querySelectorAll('div.fh-panel table.fh-facts tr'))"
                                  ".map(r => [r.cells[0].textContent, r.cells[1].textContent])")
        assert facts == [["point", layers[row]], ["position", str(position)], ["token", json.dumps(tokens[position])],
                         ["head", str(head)], ["value", f"{round(float(shown[row, position]), 4):.4f}"]]
        assert abs(float(facts[-1][1]) - float(shown[row, position])) <= 5e-5
        top = devtools.evaluate("Array.from(document.querySelectorAll('table.fh-top tr[data-row]'))"
                                ".map(r => Array.from(r.cells).map(c => c.textContent))")
        cells = sorted(((r, p) for r in range(6) for p in range(len(tokens))),
                       key=lambda c: (-abs(round(float(shown[c]), 4)), c))[:10]
        assert top == [[str(i + 1), layers[r], str(p), json.dumps(tokens[p]), f"{round(float(shown[r, p]), 4):.4f}"]
                       for i, (r, p) in enumerate(cells)]
        screenshot(devtools, "div.fh-patching-viewer", IMAGES / "patching-viewer.png")


def test_plain_text_reprs_of_the_viewers_are_one_short_line() -> None:
    """A notebook's text/plain of a viewer (and `print`) names shapes, never the values in full."""
    viewers = [fh.transformer.pattern_viewer(torch.rand(12, 12, 32, 32), tokens=[f"t{i}" for i in range(32)]),
               fh.transformer.patching_viewer(torch.rand(12, 32, 12), tokens=[f"t{i}" for i in range(32)])]
    for viewer in viewers:
        text = repr(viewer)
        assert "\n" not in text and len(text) < 200, text
        assert "Tensor(12, " in text and "<32 items>" in text
