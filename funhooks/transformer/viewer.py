"""An interactive attention-pattern viewer: self-contained HTML and JavaScript written here (no
CDN, no network, no build step), shown by a notebook (``_repr_html_``) or saved as a page
(``save_html``). Choose a layer and a head; the query x key heatmap is drawn; hovering a query
row lists its keys' weights with their tokens in a side panel.

The pattern is embedded as JSON, its values rounded to 4 decimals; tokens reach the page only
through that JSON (written safely by ``funhooks/_viewer.py``, which every viewer shares: a token
``</script>`` cannot end the script) and are set as text, never as markup. Cost: the pattern of one example
is copied to the host once, when the viewer is made.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs
import torch

from funhooks import _html
from funhooks._viewer import Page, Viewer, rounded
from funhooks.errors import RecordError
from funhooks.records import Record

__all__ = ["PatternViewer", "pattern_viewer"]

_DIGITS = 4
"""Decimals of the weights the page holds and shows."""
_PATTERN_PATH = re.compile(r"blocks\.(\d+)\.pattern")
_SCRIPT = """
  const layer = root.querySelector("select.fh-layer"), head = root.querySelector("select.fh-head");
  const grid = root.querySelector("table.fh-grid"), panel = root.querySelector("div.fh-panel");
  const offset = data.keys.length - data.queries;
  data.layers.forEach(function (name, i) { layer.appendChild(new Option(name, i)); });
  for (let h = 0; h < data.heads; h++) head.appendChild(new Option(String(h), h));
  function rows() { return data.pattern[+layer.value][+head.value]; }
  function show(q) {
    const weights = rows()[q];
    panel.replaceChildren();
    panel.appendChild(cell("div", "layer " + data.layers[+layer.value] + ", head " + head.value +
                                  ", query " + (offset + q) + " " + JSON.stringify(data.keys[offset + q]),
                           "font-weight:bold;margin-bottom:4px"));
    const t = document.createElement("table");
    t.className = "fh-weights";
    weights.forEach(function (w, k) {
      const r = document.createElement("tr");
      r.dataset.key = k;
      r.appendChild(cell("td", String(k), "color:#777;padding-right:6px"));
      r.appendChild(cell("td", data.keys[k], "padding-right:6px;white-space:pre"));
      r.appendChild(cell("td", w.toFixed(%(digits)d), "text-align:right;background:rgba(31,119,180," + w + ")"));
      t.appendChild(r);
    });
    panel.appendChild(t);
  }
  function draw() {
    grid.replaceChildren();
    const head_row = document.createElement("tr");
    head_row.appendChild(cell("th", ""));
    data.keys.forEach(function (k) {
      head_row.appendChild(cell("th", k, "writing-mode:vertical-rl;white-space:pre;font-weight:normal"));
    });
    grid.appendChild(head_row);
    rows().forEach(function (weights, q) {
      const r = document.createElement("tr");
      r.className = "fh-query";
      r.dataset.query = q;
      r.appendChild(cell("th", data.keys[offset + q], "text-align:right;white-space:pre;font-weight:normal"));
      weights.forEach(function (w) {
        const c = cell("td", "", "width:14px;height:14px;border:1px solid #eee;background:rgba(31,119,180," + w + ")");
        c.title = w.toFixed(%(digits)d);
        r.appendChild(c);
      });
      r.addEventListener("mouseover", function () {
        grid.querySelectorAll("tr.fh-query").forEach(function (o) { o.style.outline = ""; });
        r.style.outline = "1px solid #d62728";
        show(q);
      });
      grid.appendChild(r);
    });
    panel.replaceChildren(cell("div", "Hover a query row to see its keys' weights.", "color:#777"));
  }
  layer.addEventListener("change", draw);
  head.addEventListener("change", draw);
  draw();
"""


@attrs.frozen(repr=False)
class PatternViewer(Viewer):
    """An interactive view of attention patterns: a notebook shows it (``_repr_html_``),
    :meth:`save_html` writes it as a standalone page. Made by :func:`pattern_viewer`.

    Attributes:
        pattern: ``(layer, head, query, key)`` on the host, in float32.
        tokens: the text of each key position (the queries are the last ``query`` of them).
        layers: the label of each layer (the layer numbers of a Record's paths).
    """

    pattern: torch.Tensor
    tokens: tuple[str, ...]
    layers: tuple[str, ...]

    def page(self) -> Page:
        """What the page shows: the layer and head controls, the heatmap, the side panel, the data."""
        layers, heads, queries, _ = self.pattern.shape
        data = {"layers": list(self.layers), "heads": heads, "queries": queries, "keys": list(self.tokens),
                "pattern": rounded(self.pattern, _DIGITS)}
        return Page("pattern", "Attention pattern",
                    '<label>layer <select class="fh-layer"></select></label> '
                    '<label>head <select class="fh-head"></select></label>',
                    '<div style="display:flex;gap:16px;align-items:flex-start">'
                    '<table class="fh-grid" style="border-collapse:collapse"></table>'
                    '<div class="fh-panel" style="min-width:220px"></div></div>',
                    data, _SCRIPT % {"digits": _DIGITS})


def _from_record(source: Record, example: int) -> tuple[torch.Tensor, tuple[str, ...]]:
    found = sorted((int(m.group(1)), path) for path in source if (m := _PATTERN_PATH.fullmatch(path)))
    if not found:
        raise RecordError(f"pattern_viewer: the Record holds no `blocks.L.pattern`, got paths {list(source)}. "
                          "Record the patterns, e.g. `fh.outputs(points.pattern)`.")
    rows = []
    for _, path in found:
        value = source[path]["output"]
        if not isinstance(value, torch.Tensor) or value.ndim != 4:
            raise ValueError(f"pattern_viewer: `{path}`'s \"output\" is `(batch, head, query, key)`, got "
                             f"{_html.describe(value)[0]}. Record the standard `pattern` point.")
        rows.append(value.detach()[example])
    return torch.stack(rows), tuple(str(layer) for layer, _ in found)


def pattern_viewer(source: Record | torch.Tensor, tokens: Sequence[str] | None = None, *,
                   example: int = 0) -> PatternViewer:
    """An interactive viewer of attention patterns (layer and head chosen in the page, a query's
    keys' weights shown on hover), self-contained HTML and JavaScript that works offline.

    Args:
        source: a tensor ``(layer, head, query, key)``, or a Record of standard ``pattern``
            points (every ``blocks.L.pattern``, value name ``"output"``, ``(batch, head, query,
            key)``, ordered by layer).
        tokens: the text of each key position (the queries are the last positions); None: the indices.
        example: the batch row shown, for a Record.

    Returns:
        A :class:`PatternViewer`: ``_repr_html_`` for a notebook, ``save_html(path)`` for a page.

    Raises:
        RecordError: for a Record holding no pattern.
        ValueError: for a tensor of another rank, or `tokens` of another length than the keys.

    Example:
        >>> import torch, funhooks as fh
        >>> pattern = torch.tril(torch.ones(2, 4, 3, 3)) / torch.arange(1, 4).view(3, 1)
        >>> viewer = fh.transformer.pattern_viewer(pattern, tokens=["The", " cat", "</script>"])
        >>> html = viewer._repr_html_()
        >>> '<script' in html, 'src=' in html, '</script>"' in html, '0.3333' in html
        (True, False, False, True)
    """
    if isinstance(source, Record):
        values, layers = _from_record(source, example)
    else:
        tensor = source.detach() if isinstance(source, torch.Tensor) else torch.as_tensor(source)
        if tensor.ndim != 4:
            raise ValueError(f"pattern_viewer: `source` is `(layer, head, query, key)`, got shape "
                             f"{tuple(tensor.shape)}. Stack the layers' patterns of one example, or pass the Record.")
        values, layers = tensor, tuple(str(i) for i in range(tensor.shape[0]))
    keys = _html.labels("pattern_viewer", tokens, values.shape[-1])
    return PatternViewer(values.float().cpu(), tuple(keys), layers)
