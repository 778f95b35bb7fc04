"""The attention-pattern viewer: its HTML (parsed), and the page in a real headless Chromium
driven through the DevTools protocol (hover a query, read the side panel, take a screenshot)."""

from __future__ import annotations

import json
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import transformers
from browser_kit import browser, opened, screenshot  # noqa: F401  (browser: a fixture)

import funhooks as fh

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
TOKENS = ["The", " cat", " sat", " on", "</script><b>x</b>", " &amp;"]


class _Page(HTMLParser):
    """The tags of a page, its scripts' text and its visible text."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"
        if self._in_script:
            self.scripts.append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts[-1] += data


def _parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    page.close()
    return page


def _pattern(layers: int = 3, heads: int = 4, positions: int = len(TOKENS)) -> torch.Tensor:
    torch.manual_seed(0)
    scores = torch.randn(layers, heads, positions, positions)
    return scores.masked_fill(~torch.ones(positions, positions, dtype=torch.bool).tril(), float("-inf")).softmax(-1)


def test_the_page_holds_the_pattern_rounded_and_the_tokens_as_data_not_markup() -> None:
    pattern = _pattern()
    html = fh.transformer.pattern_viewer(pattern, tokens=TOKENS)._repr_html_()
    page = _parse(html)
    tags = [tag for tag, _ in page.tags]
    assert tags.count("script") == 2 and tags.count("b") == 1      # the token `</script><b>x</b>` did not break out
    assert not any("src" in attrs or "href" in attrs for _, attrs in page.tags)   # nothing loaded from a network
    data_script = next(i for i, (tag, attrs) in enumerate(t for t in page.tags if t[0] == "script")
                       if attrs.get("type") == "application/json")
    data = json.loads(page.scripts[data_script])
    assert data["keys"] == TOKENS and data["layers"] == ["0", "1", "2"] and data["heads"] == 4
    assert data["pattern"] == [[[[round(w, 4) for w in row] for row in head] for head in layer]
                               for layer in pattern.double().tolist()]
    assert {attrs.get("class") for tag, attrs in page.tags if tag == "select"} == {"fh-layer", "fh-head"}


def test_a_record_of_pattern_points_gives_its_layers_of_one_example() -> None:
    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
    pts = fh.transformer.points(model)
    _, rec = fh.capture(model, fh.outputs(pts.pattern))(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    viewer = fh.transformer.pattern_viewer(rec, tokens=["a", "b", "c"], example=1)
    assert viewer.layers == ("0", "1")
    expected = torch.stack([rec[f"blocks.{i}.pattern"]["output"][1] for i in range(2)])
    assert torch.equal(viewer.pattern, expected.detach())


def test_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"pattern_viewer: `source` is `\(layer, head, query, key\)`, got shape \(4, 3, 3\)"):
        fh.transformer.pattern_viewer(torch.rand(4, 3, 3))
    with pytest.raises(ValueError, match="pattern_viewer: `tokens` has one label per position"):
        fh.transformer.pattern_viewer(torch.rand(1, 1, 3, 3), tokens=["a"])
    with pytest.raises(fh.RecordError, match="holds no `blocks.L.pattern`"):
        fh.transformer.pattern_viewer(fh.Record())


def test_a_12_layer_12_head_32_token_viewer_builds_well_under_a_second() -> None:
    pattern = torch.rand(12, 12, 32, 32).softmax(-1)
    start = time.perf_counter()
    html = fh.transformer.pattern_viewer(pattern, tokens=[f"t{i}" for i in range(32)]).html()
    assert time.perf_counter() - start < 1.0
    assert len(html) < 3_000_000


def test_hovering_a_query_in_chromium_shows_its_keys_weights_and_tokens(browser: str, tmp_path: Path) -> None:
    """Draws docs/images/pattern-viewer.png (docs/logit-lens.md shows it)."""
    pattern = _pattern()
    layer, head, query = 2, 3, 4
    page = fh.transformer.pattern_viewer(pattern, tokens=TOKENS).save_html(tmp_path / "viewer.html")
    ready = "document.readyState === 'complete' && document.querySelector('select.fh-head') !== null"
    with opened(browser, page, tmp_path, ready) as devtools:
        select = ("(function (cls, v) { const s = document.querySelector('select.' + cls); s.value = v;"
                  " s.dispatchEvent(new Event('change')); })")
        devtools.evaluate(f"{select}('fh-layer', '{layer}')")
        devtools.evaluate(f"{select}('fh-head', '{head}')")
        assert devtools.evaluate("document.querySelectorAll('table.fh-grid tr.fh-query').length") == len(TOKENS)
        devtools.evaluate(f"document.querySelector('tr.fh-query[data-query=\"{query}\"]')"
                          ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
        title = devtools.evaluate("document.querySelector('div.fh-panel > div').textContent")
        rows = devtools.evaluate("Array.from(document.querySelectorAll('div.fh-panel table.fh-weights tr'))"
                                 ".map(r => Array.from(r.cells).map(c => c.textContent))")
        assert title == f"layer {layer}, head {head}, query {query} {json.dumps(TOKENS[query])}"
        weights = pattern[layer, head, query].double()
        expected = [[str(k), token, f"{w:.4f}"] for k, (token, w) in
                    enumerate(zip(TOKENS, weights.round(decimals=4).tolist()))]
        assert rows == expected
        assert all(abs(float(shown) - w) <= 5e-5 for (_, _, shown), w in zip(rows, weights.tolist()))
        assert devtools.evaluate("document.querySelectorAll('b').length") == 1   # the viewer's own title only
        screenshot(devtools, "div.fh-pattern-viewer", IMAGES / "pattern-viewer.png")
