"""An interactive viewer of edge scores (:func:`~funhooks.circuits.eap`'s :class:`Edges`):
self-contained HTML and JavaScript (``funhooks/_viewer.py`` writes the page; no CDN, no network).

The page holds the `top` edges of largest ``|score|`` (a GPT-2-small graph has about 32,000
edges: the page holds 1,000 by default and says how many there are in all). It lists the `k`
first of them (k chosen in the page) sorted by ``|score|``, by score or by score ascending,
filtered by a node's name or by a layer, and draws them as a layered graph (an SVG written by
the page's script): the embeddings at the top, then each layer's heads and its MLP, the logits
at the bottom; a head is one node, its writer and its q, k and v readers (under grouped-query
attention a k or v reader is drawn at its key-value head's index). Hovering an edge (in
the list or the drawing) highlights it and its two endpoints and shows its score (4
decimals). Node names reach the page only as JSON data and are set as text, never as markup.
Cost: the `top` scores are read to the host once, when the viewer is made.
"""

from __future__ import annotations

import re

import attrs
import torch

from funhooks._viewer import Page, Viewer, rounded
from funhooks.errors import SpecError

from .edge_attribution import Edges

__all__ = ["EdgeViewer", "edge_viewer"]

_CALLER = "edge_viewer"
_DIGITS = 4
"""Decimals of the scores the page holds and shows."""
_NODE = re.compile(r"blocks\.(\d+)\.(?:heads\.(\d+)|mlp)(?:_out|\.[qkv])?")
_SCRIPT = """
  const list = root.querySelector("table.fh-edges"), svg = root.querySelector("svg.fh-graph");
  const panel = root.querySelector("div.fh-panel"), count = root.querySelector("input.fh-k");
  const sort = root.querySelector("select.fh-sort"), layer = root.querySelector("select.fh-layer");
  const filter = root.querySelector("input.fh-filter"), NS = svg.namespaceURI;
  root.querySelector("div.fh-caption").textContent = data.caption;
  function el(tag, attrs) {
    const e = document.createElementNS(NS, tag);
    Object.keys(attrs).forEach(function (k) { e.setAttribute(k, attrs[k]); });
    return e;
  }
  function fmt(s) { return s === null ? "nan" : s.toFixed(%(digits)d); }
  function colour(s, alpha) { return (s >= 0 ? "rgba(214,39,40," : "rgba(31,119,180,") + alpha + ")"; }
  layer.appendChild(new Option("all", "all"));
  data.layers.forEach(function (name) { layer.appendChild(new Option(name, name)); });
  count.max = data.edges.length;
  function node(e, end) { return data.nodes[e[end]]; }
  function chosen() {
    const text = filter.value.trim(), at = layer.value;
    const picked = data.edges.map(function (e, i) { return i; }).filter(function (i) {
      const e = data.edges[i];
      const names = [e[0], e[1]], layers = [node(e, 3)[3], node(e, 4)[3]];
      return (at === "all" || layers.indexOf(at) >= 0) &&
             (text === "" || names.some(function (n) { return n.indexOf(text) >= 0; }));
    });
    const key = {abs: function (i) { return -Math.abs(data.edges[i][2]); },
                 desc: function (i) { return -data.edges[i][2]; },
                 asc: function (i) { return data.edges[i][2]; }}[sort.value];
    picked.sort(function (a, b) { return key(a) - key(b) || a - b; });
    return picked.slice(0, Math.max(0, +count.value || 0));
  }
  function highlight(i) {
    root.querySelectorAll(".fh-on").forEach(function (o) { o.classList.remove("fh-on"); });
    root.querySelectorAll('[data-edge="' + i + '"]').forEach(function (o) { o.classList.add("fh-on"); });
    const e = data.edges[i];
    [e[3], e[4]].forEach(function (n) {
      const c = svg.querySelector('rect[data-node="' + n + '"]');
      if (c) c.classList.add("fh-on");
    });
    panel.replaceChildren(cell("div", e[0] + " \\u2192 " + e[1] + ": " + fmt(e[2]),
                               "font-weight:bold"));
  }
  function drawList(shown) {
    list.replaceChildren();
    const header = document.createElement("tr");
    ["#", "writer", "reader", "score"].forEach(function (h) {
      header.appendChild(cell("th", h, "text-align:left;padding:1px 6px;border-bottom:1px solid #ccc"));
    });
    list.appendChild(header);
    const peak = shown.reduce(function (a, i) { return Math.max(a, Math.abs(data.edges[i][2])); }, 0) || 1;
    shown.forEach(function (i, rank) {
      const e = data.edges[i], tr = document.createElement("tr");
      tr.className = "fh-edge";
      tr.dataset.edge = i;
      tr.appendChild(cell("td", String(rank + 1), "color:#777;padding:1px 6px"));
      tr.appendChild(cell("td", e[0], "padding:1px 6px"));
      tr.appendChild(cell("td", e[1], "padding:1px 6px"));
      tr.appendChild(cell("td", fmt(e[2]), "text-align:right;padding:1px 6px;background:" +
                          colour(e[2], (Math.abs(e[2]) / peak).toFixed(3))));
      tr.addEventListener("mouseover", function () { highlight(i); });
      list.appendChild(tr);
    });
  }
  function rowName(d) {
    if (d === 0) return "embed";
    if (d === 2 * data.n_layers + 1) return "logits";
    return d %% 2 ? (d - 1) / 2 + " heads" : (d - 2) / 2 + " mlp";
  }
  function drawGraph(shown) {
    svg.replaceChildren();
    const used = {};
    shown.forEach(function (i) { used[data.edges[i][3]] = true; used[data.edges[i][4]] = true; });
    const ids = Object.keys(used).map(Number);
    const depths = Array.from(new Set(ids.map(function (n) { return data.nodes[n][2]; })));
    depths.sort(function (a, b) { return a - b; });
    const left = 64, right = 80, width = left + Math.max(300, 44 * data.slots) + right;
    const height = 52 + 46 * Math.max(0, depths.length - 1);
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    const at = {};
    ids.forEach(function (n) {
      at[n] = [left + (data.nodes[n][4] + 0.5) * (width - left - right) / data.slots,
               26 + 46 * depths.indexOf(data.nodes[n][2])];
    });
    depths.forEach(function (d, y) {
      const t = el("text", {x: 4, y: 30 + 46 * y, "font-size": 10, fill: "#777"});
      t.textContent = rowName(d);
      svg.appendChild(t);
    });
    const peak = shown.reduce(function (a, i) { return Math.max(a, Math.abs(data.edges[i][2])); }, 0) || 1;
    shown.slice().reverse().forEach(function (i, k) {
      const e = data.edges[i], a = at[e[3]], b = at[e[4]], span = (b[1] - a[1]) / 46;
      const bend = span > 1 ? (k %% 2 ? 1 : -1) * 16 * Math.min(span, 5) : 0;
      const third = (b[1] - a[1]) / 3;
      const path = el("path", {d: "M" + a[0] + "," + a[1] + " C" + (a[0] + bend) + "," + (a[1] + third) + " " +
                                  (b[0] + bend) + "," + (b[1] - third) + " " + b[0] + "," + b[1],
                               fill: "none", stroke: colour(e[2], 0.75),
                               "stroke-width": (1 + 5 * Math.abs(e[2]) / peak).toFixed(2), "data-edge": i});
      path.classList.add("fh-link");
      const title = el("title", {});
      title.textContent = e[0] + " \\u2192 " + e[1] + ": " + fmt(e[2]);
      path.appendChild(title);
      path.addEventListener("mouseover", function () { highlight(i); });
      svg.appendChild(path);
    });
    ids.forEach(function (n) {
      const label = data.nodes[n][1], w = 8 + 6.5 * label.length;
      const box = el("rect", {x: at[n][0] - w / 2, y: at[n][1] - 9, width: w, height: 18, rx: 5, "data-node": n});
      box.classList.add("fh-node");
      const title = el("title", {});
      title.textContent = data.nodes[n][0];
      box.appendChild(title);
      const t = el("text", {x: at[n][0], y: at[n][1] + 4, "text-anchor": "middle", "font-size": 10});
      t.textContent = label;
      svg.appendChild(box);
      svg.appendChild(t);
    });
  }
  function draw() {
    const shown = chosen();
    drawList(shown);
    drawGraph(shown);
    panel.replaceChildren(cell("div", "Hover an edge to see its endpoints and score.", "color:#777"));
  }
  [count, filter].forEach(function (c) { c.addEventListener("input", draw); });
  [sort, layer].forEach(function (c) { c.addEventListener("change", draw); });
  draw();
"""
_CSS = ("<style>.fh-edge-viewer .fh-node{fill:#fff;stroke:#555;stroke-width:1}"
        ".fh-edge-viewer .fh-node.fh-on{fill:#ffd54f;stroke:#000;stroke-width:2.5}"
        ".fh-edge-viewer path.fh-on{stroke:#000;stroke-opacity:1}"
        ".fh-edge-viewer tr.fh-on{outline:2px solid #000}"
        ".fh-edge-viewer text{pointer-events:none}</style>")


@attrs.frozen(repr=False)
class EdgeViewer(Viewer):
    """An interactive view of edge scores: a notebook shows it (``_repr_html_``),
    :meth:`save_html` writes it as a standalone page. Made by :func:`edge_viewer`.

    Attributes:
        edges: the edges the page holds, ``(writer, reader, score)``, largest ``|score|`` first
            (``Edges.top(top)``).
        n_edges: the number of edges scored in all.
        shown: how many edges the page lists and draws when it opens.
        title: the viewer's title.
        n_layers: the model's layers (the layer filter's choices and the drawing's rows).
        n_heads: the heads per layer (the drawing's columns, and one for the MLP).
    """

    edges: tuple[tuple[str, str, float], ...]
    n_edges: int
    shown: int
    title: str
    n_layers: int
    n_heads: int

    def page(self) -> Page:
        """What the page shows: the controls, the list of edges, the graph, the hover panel, the data."""
        nodes: dict[str, int] = {}
        table = []
        for writer, reader, score in self.edges:
            ends = [nodes.setdefault(_node(name), len(nodes)) for name in (writer, reader)]
            table.append([writer, reader, score, *ends])
        for row, score in zip(table, rounded(torch.tensor([e[2] for e in self.edges], dtype=torch.float64), _DIGITS)):
            row[2] = score
        layers = ["embed", *map(str, range(self.n_layers)), "logits"]
        embeds = ["embed", "pos_embed"]
        data = {"edges": table, "nodes": [[key, *self._place(key, embeds)] for key in nodes], "layers": layers,
                "n_layers": self.n_layers, "slots": self.n_heads + 1,
                "caption": f"the {len(self.edges)} edges of largest |score| of {self.n_edges} in all"}
        return Page("edge", self.title,
                    f'<label>show <input class="fh-k" type="number" min="0" value="{self.shown}" style="width:4em">'
                    '</label> <label>sorted <select class="fh-sort"><option value="abs">by |score|</option>'
                    '<option value="desc">by score, largest first</option>'
                    '<option value="asc">by score, smallest first</option></select></label> '
                    '<label>layer <select class="fh-layer"></select></label> '
                    '<label>node <input class="fh-filter" type="text" placeholder="name contains" '
                    'style="width:9em"></label>',
                    _CSS + '<div class="fh-caption" style="color:#555;margin-bottom:6px"></div>'
                    '<div style="display:flex;gap:16px;align-items:flex-start">'
                    '<div><div class="fh-panel" style="min-height:18px;margin-bottom:4px"></div>'
                    '<svg class="fh-graph" style="border:1px solid #eee"></svg></div>'
                    '<table class="fh-edges" style="border-collapse:collapse"></table></div>',
                    data, _SCRIPT % {"digits": _DIGITS})

    def _place(self, key: str, embeds: list[str]) -> tuple[str, int, str, int]:
        """A node's label, depth (its row in the drawing), layer and slot (its column)."""
        match = _NODE.fullmatch(key)
        if key == "logits":
            return "logits", 2 * self.n_layers + 1, "logits", self.n_heads // 2
        if match is None:
            return key, 0, "embed", embeds.index(key) if key in embeds else 0
        layer, head = int(match.group(1)), match.group(2)
        if head is None:
            return f"mlp {layer}", 2 * layer + 2, str(layer), self.n_heads
        return f"{layer}.{head}", 2 * layer + 1, str(layer), int(head)


def _node(name: str) -> str:
    """The node a writer or reader belongs to: a head's writer and its q, k, v readers are one."""
    match = _NODE.fullmatch(name)
    if match is None:
        return name
    return f"blocks.{match.group(1)}." + ("mlp" if match.group(2) is None else f"heads.{match.group(2)}")


def edge_viewer(edges: Edges, *, top: int = 1000, show: int = 20, title: str | None = None) -> EdgeViewer:
    """An interactive viewer of edge scores (a sortable, filterable list of the top edges and
    a layered drawing of them; hover an edge to highlight its endpoints), self-contained HTML
    and JavaScript that works offline.

    Args:
        edges: what :func:`~funhooks.circuits.eap` returns.
        top: the number of edges the page holds, those of largest ``|score|`` (at most the
            edges scored): the page sorts and filters among them.
        show: how many of them the page lists and draws when it opens (changed in the page).
        title: the viewer's title; None: ``"EAP edges"`` or ``"EAP-IG edges (k steps)"``.

    Returns:
        An :class:`EdgeViewer`: ``_repr_html_`` for a notebook, ``save_html(path)`` for a page.

    Raises:
        SpecError: for `edges` that are not an :class:`Edges`, or a `top` or `show` that is not
            a positive int.

    Example:
        >>> import torch, transformers, funhooks as fh
        >>> transformers.logging.set_verbosity_error()
        >>> model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        ...     n_layer=2, n_embd=32, n_head=4, vocab_size=50, n_positions=16)).eval()
        >>> clean, corrupt = torch.tensor([[1, 2, 3, 4]]), torch.tensor([[1, 9, 3, 4]])
        >>> edges = fh.circuits.eap(model, lambda out: out.logits[:, -1, 7] - out.logits[:, -1, 8])(clean, corrupt)
        >>> viewer = fh.circuits.edge_viewer(edges, top=50, show=10)
        >>> len(viewer.edges), viewer.n_edges, viewer.edges[0] == edges.top(1)[0]
        (50, 137, True)
        >>> html = viewer._repr_html_()
        >>> '<svg class="fh-graph"' in html, 'src=' in html
        (True, False)
    """
    if not isinstance(edges, Edges):
        raise SpecError(f"{_CALLER}: `edges` is what fh.circuits.eap returns (an Edges), got "
                        f"{type(edges).__name__}. Pass `fh.circuits.eap(model, metric)(clean, corrupt)`.")
    for name, value in (("top", top), ("show", show)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"{_CALLER}: `{name}` is a positive int (a number of edges), got {value!r}. Pass one.")
    held = edges.top(min(top, edges.n_edges))
    kind = "EAP edges" if edges.steps == 1 else f"EAP-IG edges ({edges.steps} steps)"
    return EdgeViewer(tuple(held), edges.n_edges, min(show, len(held)), kind if title is None else title,
                      edges.graph.points.n_layers, edges.graph.points.n_heads)
