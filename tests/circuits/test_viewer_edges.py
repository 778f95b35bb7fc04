"""The edge-score viewer: its HTML (parsed), its speed on a GPT-2-small-sized graph, and the page
in a real headless Chromium driven through the DevTools protocol (choose k, sort, filter by layer
and by name, hover an edge, take a screenshot)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
import transformers
from browser_kit import browser, opened, screenshot  # noqa: F401  (browser: a fixture)
from viewer_kit import assert_offline, parsed

import funhooks as fh

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
READY = "document.readyState === 'complete' && document.querySelector('table.fh-edges tr.fh-edge') !== null"
SELECT = ("(function (cls, v) { const s = document.querySelector('.' + cls); s.value = v;"
          " s.dispatchEvent(new Event(s.tagName === 'INPUT' ? 'input' : 'change')); })")
ROWS = ("Array.from(document.querySelectorAll('table.fh-edges tr.fh-edge'))"
        ".map(r => Array.from(r.cells).map(c => c.textContent))")


def _model(layers: int = 2, heads: int = 4, width: int = 32) -> transformers.GPT2LMHeadModel:
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=width, n_head=heads, vocab_size=50, n_positions=16)).eval()


@pytest.fixture(scope="module")
def edges() -> fh.circuits.Edges:
    model = _model(layers=3)
    clean, corrupt = torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 9, 3, 4, 6]])
    return fh.circuits.eap(model, lambda out: out.logits[:, -1, 7] - out.logits[:, -1, 8])(clean, corrupt)


def _layer(name: str) -> str:
    match = re.match(r"blocks\.(\d+)\.", name)
    return match.group(1) if match else ("logits" if name == "logits" else "embed")


def test_the_page_holds_the_top_edges_rounded_as_data(edges: fh.circuits.Edges) -> None:
    viewer = fh.circuits.edge_viewer(edges, top=40, show=10)
    page = parsed(viewer._repr_html_())
    assert_offline(page)
    assert page.count("script") == 2 and page.count("svg") == 1 and "blocks." not in page.text  # names are data
    data = page.data()
    assert [e[:2] for e in data["edges"]] == [[w, r] for w, r, _ in edges.top(40)]
    assert [e[2] for e in data["edges"]] == [round(s, 4) for _, _, s in edges.top(40)]
    nodes = [n[0] for n in data["nodes"]]
    for writer, reader, _, w, r in data["edges"]:   # a head's writer and its q/k/v readers are one node
        assert nodes[w] == writer.removesuffix("_out") and reader.startswith(nodes[r])
    assert data["layers"] == ["embed", "0", "1", "2", "logits"]
    assert data["caption"] == f"the 40 edges of largest |score| of {edges.n_edges} in all"
    assert viewer.shown == 10 and viewer.title == "EAP edges"


def test_a_gpt2_small_sized_edge_set_builds_well_under_a_second() -> None:
    """12 layers of 12 heads: 32,000-odd edges; the page holds the top 1,000 (the default)."""
    g = fh.circuits.graph(_model(layers=12, heads=12, width=24))
    table = torch.randn(g.upstream.shape) * g.upstream
    scored = fh.circuits.Edges(table, g, torch.tensor(1.0), torch.tensor(0.0), 1)
    assert scored.n_edges > 30_000
    start = time.perf_counter()
    viewer = fh.circuits.edge_viewer(scored)
    html = viewer.html()
    assert time.perf_counter() - start < 1.0
    assert len(viewer.edges) == 1000 and len(html) < 400_000


def test_refusals_name_what_is_wrong(edges: fh.circuits.Edges) -> None:
    with pytest.raises(fh.SpecError, match=r"edge_viewer: `edges` is what fh.circuits.eap returns .* got Tensor"):
        fh.circuits.edge_viewer(edges.table)
    with pytest.raises(fh.SpecError, match=r"edge_viewer: `top` is a positive int \(a number of edges\), got 0"):
        fh.circuits.edge_viewer(edges, top=0)
    with pytest.raises(fh.SpecError, match=r"edge_viewer: `show` is a positive int .* got True"):
        fh.circuits.edge_viewer(edges, show=True)
    assert len(fh.circuits.edge_viewer(edges, top=10**6).edges) == edges.n_edges  # at most the edges scored


def test_in_chromium_the_list_sorts_filters_and_hovering_highlights_the_endpoints(
        edges: fh.circuits.Edges, browser: str, tmp_path: Path) -> None:
    """Draws docs/images/edge-viewer.png (docs/circuits.md shows it)."""
    held = edges.top(60)
    page = fh.circuits.edge_viewer(edges, top=60, show=12).save_html(tmp_path / "edges.html")

    def row(rank: int, edge: tuple[str, str, float]) -> list[str]:
        return [str(rank), edge[0], edge[1], f"{round(edge[2], 4):.4f}"]

    with opened(browser, page, tmp_path, READY) as devtools:
        assert devtools.evaluate(ROWS) == [row(i + 1, e) for i, e in enumerate(held[:12])]
        devtools.evaluate(f"{SELECT}('fh-sort', 'desc')")
        devtools.evaluate(f"{SELECT}('fh-k', '8')")
        by_score = sorted(held, key=lambda e: -round(e[2], 4))
        assert devtools.evaluate(ROWS) == [row(i + 1, e) for i, e in enumerate(by_score[:8])]
        devtools.evaluate(f"{SELECT}('fh-sort', 'asc')")
        assert devtools.evaluate(ROWS)[0] == row(1, min(held, key=lambda e: e[2]))
        devtools.evaluate(f"{SELECT}('fh-layer', '1')")
        in_layer = [e for e in sorted(held, key=lambda e: round(e[2], 4)) if "1" in (_layer(e[0]), _layer(e[1]))]
        assert devtools.evaluate(ROWS) == [row(i + 1, e) for i, e in enumerate(in_layer[:8])]
        devtools.evaluate(f"{SELECT}('fh-layer', 'all')")
        devtools.evaluate(f"{SELECT}('fh-filter', 'heads.2.')")
        named = [e for e in sorted(held, key=lambda e: round(e[2], 4)) if "heads.2." in e[0] + e[1]]
        assert devtools.evaluate(ROWS) == [row(i + 1, e) for i, e in enumerate(named[:8])]
        devtools.evaluate(f"{SELECT}('fh-filter', '')")
        devtools.evaluate(f"{SELECT}('fh-sort', 'abs')")
        devtools.evaluate(f"{SELECT}('fh-k', '12')")
        assert devtools.evaluate("document.querySelectorAll('svg.fh-graph path.fh-link').length") == 12
        writer, reader, score = held[2]
        devtools.evaluate("document.querySelectorAll('table.fh-edges tr.fh-edge')[2]"
                          ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")
        lit = devtools.evaluate("Array.from(document.querySelectorAll('svg.fh-graph rect.fh-on'))"
                                ".map(c => c.textContent).sort()")
        ends = sorted({writer.removesuffix("_out"), re.sub(r"\.[qkv]$", "", reader)})
        assert lit == ends
        assert devtools.evaluate("document.querySelectorAll('svg.fh-graph path.fh-on').length") == 1
        assert devtools.evaluate("document.querySelector('div.fh-panel').textContent") == \
            f"{writer} \u2192 {reader}: {round(score, 4):.4f}"
        screenshot(devtools, "div.fh-edge-viewer", IMAGES / "edge-viewer.png")
        devtools.evaluate("document.querySelector('svg.fh-graph path.fh-link[data-edge=\"0\"]')"
                          ".dispatchEvent(new MouseEvent('mouseover', {bubbles: true}))")   # an edge of the drawing
        first = held[0]
        assert devtools.evaluate("document.querySelector('div.fh-panel').textContent") == \
            f"{first[0]} \u2192 {first[1]}: {round(first[2], 4):.4f}"
        assert devtools.evaluate("document.querySelector('tr.fh-edge.fh-on').dataset.edge") == "0"
