"""An interactive patching-table viewer: self-contained HTML and JavaScript (``funhooks/_viewer.py``
writes the page; no CDN, no network), for an :class:`~funhooks.runs.Attribution` or a plain
patching table (the tensor :func:`~funhooks.transformer.plot_patching` draws).

The table is drawn as a heatmap, one row per layer (or point), one column per position headed
by its token, red above 0 and blue below on one scale for the whole table; hovering a cell
shows its point, position, token, head and value (4 decimals); a control chooses the head where
the table has a head axis, another sorts the rows by their largest ``|value|``; a list beside
it gives the table's largest cells. Tokens reach the page only as JSON data and are set as
text, never as markup. Cost: the table is copied to the host once, when the viewer is made.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from funhooks import _html
from funhooks._viewer import Page, Viewer, rounded
from funhooks.runs import Attribution

__all__ = ["PatchingViewer", "patching_viewer"]

_CALLER = "patching_viewer"
_DIGITS = 4
"""Decimals of the values the page holds and shows."""
_TOP = 10
"""Cells the list of the largest holds."""
_SCRIPT = """
  const head = root.querySelector("select.fh-head"), sort = root.querySelector("select.fh-sort");
  const grid = root.querySelector("table.fh-grid"), panel = root.querySelector("div.fh-panel");
  const best = root.querySelector("table.fh-top");
  root.querySelector("div.fh-caption").textContent = data.caption;
  function fmt(v) { return v === null ? "nan" : v.toFixed(%(digits)d); }
  function colour(v) {
    if (v === null) return "#ccc";
    const a = data.bound > 0 ? Math.abs(v) / data.bound : 0;
    return (v >= 0 ? "rgba(214,39,40," : "rgba(31,119,180,") + a.toFixed(3) + ")";
  }
  if (data.heads) {
    for (let h = 0; h < data.heads; h++) head.appendChild(new Option(String(h), h));
  } else {
    root.querySelector("label.fh-head-control").style.display = "none";
  }
  function matrix() { return data.values[data.heads ? +head.value : 0]; }
  function facts(r, p) {
    const rows = [["point", data.rows[r]], ["position", String(p)], ["token", JSON.stringify(data.tokens[p])]];
    if (data.heads) rows.push(["head", head.value]);
    rows.push(["value", fmt(matrix()[r][p])]);
    return rows;
  }
  function show(r, p) {
    const t = document.createElement("table");
    t.className = "fh-facts";
    facts(r, p).forEach(function (kv) {
      const tr = document.createElement("tr");
      tr.appendChild(cell("th", kv[0], "text-align:left;font-weight:normal;color:#777;padding-right:8px"));
      tr.appendChild(cell("td", kv[1], "white-space:pre"));
      t.appendChild(tr);
    });
    panel.replaceChildren(t);
  }
  function order() {
    const m = matrix(), rows = m.map(function (_, r) { return r; });
    if (sort.value === "max") {
      const peak = m.map(function (row) {
        return row.reduce(function (a, v) { return v === null ? a : Math.max(a, Math.abs(v)); }, 0);
      });
      rows.sort(function (a, b) { return peak[b] - peak[a] || a - b; });
    }
    return rows;
  }
  function top() {
    const m = matrix(), cells = [];
    m.forEach(function (row, r) { row.forEach(function (v, p) { if (v !== null) cells.push([r, p, v]); }); });
    cells.sort(function (a, b) { return Math.abs(b[2]) - Math.abs(a[2]) || a[0] - b[0] || a[1] - b[1]; });
    best.replaceChildren();
    const header = document.createElement("tr");
    ["#", "point", "pos", "token", "value"].forEach(function (h) {
      header.appendChild(cell("th", h, "text-align:left;font-weight:normal;color:#777;padding-right:6px"));
    });
    best.appendChild(header);
    cells.slice(0, data.top).forEach(function (c, i) {
      const tr = document.createElement("tr");
      tr.dataset.row = c[0];
      tr.dataset.position = c[1];
      tr.appendChild(cell("td", String(i + 1), "color:#777;padding-right:6px"));
      tr.appendChild(cell("td", data.rows[c[0]], "padding-right:6px"));
      tr.appendChild(cell("td", String(c[1]), "padding-right:6px"));
      tr.appendChild(cell("td", JSON.stringify(data.tokens[c[1]]), "padding-right:6px;white-space:pre"));
      tr.appendChild(cell("td", fmt(c[2]), "text-align:right;background:" + colour(c[2])));
      tr.addEventListener("mouseover", function () { show(c[0], c[1]); });
      best.appendChild(tr);
    });
  }
  function draw() {
    grid.replaceChildren();
    const header = document.createElement("tr");
    header.appendChild(cell("th", ""));
    data.tokens.forEach(function (t) {
      header.appendChild(cell("th", t, "writing-mode:vertical-rl;white-space:pre;font-weight:normal;padding:2px 0"));
    });
    grid.appendChild(header);
    const m = matrix();
    order().forEach(function (r) {
      const tr = document.createElement("tr");
      tr.className = "fh-row";
      tr.dataset.row = r;
      tr.appendChild(cell("th", data.rows[r], "text-align:right;white-space:pre;font-weight:normal;padding-right:6px"));
      m[r].forEach(function (v, p) {
        const td = cell("td", "", "width:20px;height:20px;border:1px solid #eee;background:" + colour(v));
        td.dataset.position = p;
        td.title = fmt(v);
        td.addEventListener("mouseover", function () {
          grid.querySelectorAll("td").forEach(function (o) { o.style.outline = ""; });
          td.style.outline = "2px solid #222";
          show(r, p);
        });
        tr.appendChild(td);
      });
      grid.appendChild(tr);
    });
    panel.replaceChildren(cell("div", "Hover a cell to see its point, token and value.", "color:#777"));
    top();
  }
  head.addEventListener("change", draw);
  sort.addEventListener("change", draw);
  draw();
"""


@attrs.frozen(repr=False)
class PatchingViewer(Viewer):
    """An interactive view of a patching table: a notebook shows it (``_repr_html_``),
    :meth:`save_html` writes it as a standalone page. Made by :func:`patching_viewer`.

    Attributes:
        table: ``(rows, positions)`` or ``(rows, positions, heads)`` on the host, in float32.
        tokens: the text of each position (the column headers).
        layers: the label of each row (an Attribution's points, or the layers).
        title: the viewer's title.
        caption: the line under it (an Attribution's clean and corrupted metrics), or ``""``.
    """

    table: torch.Tensor
    tokens: tuple[str, ...]
    layers: tuple[str, ...]
    title: str
    caption: str

    def page(self) -> Page:
        """What the page shows: the head and sort controls, the heatmap, the hover panel, the top cells."""
        headed = self.table.ndim == 3
        table = self.table.movedim(2, 0) if headed else self.table.unsqueeze(0)  # (heads, rows, positions)
        finite = self.table.nan_to_num(0.0, posinf=0.0, neginf=0.0).abs()
        bound = round(float(finite.max()), _DIGITS) if finite.numel() else 0.0
        data = {"rows": list(self.layers), "tokens": list(self.tokens), "heads": self.table.shape[2] if headed else 0,
                "values": rounded(table, _DIGITS), "bound": bound, "top": _TOP,
                "caption": " · ".join([*([self.caption] if self.caption else []),
                                       f"red above 0, blue below, on one scale ±{bound:g}"])}
        return Page("patching", self.title,
                    '<label class="fh-head-control">head <select class="fh-head"></select></label> '
                    '<label>rows <select class="fh-sort"><option value="order">in order</option>'
                    '<option value="max">by max |value|</option></select></label>',
                    '<div class="fh-caption" style="color:#555;margin-bottom:6px"></div>'
                    '<div style="display:flex;gap:16px;align-items:flex-start">'
                    '<table class="fh-grid" style="border-collapse:collapse"></table>'
                    '<div style="min-width:240px"><div class="fh-panel" style="min-height:90px"></div>'
                    f'<div style="margin:8px 0 2px;font-weight:bold">top {_TOP} cells by |value|</div>'
                    '<table class="fh-top" style="border-collapse:collapse"></table></div></div>',
                    data, _SCRIPT % {"digits": _DIGITS})


def patching_viewer(source: Attribution | torch.Tensor, tokens: Sequence[object] | None = None, *,
                    layers: Sequence[object] | None = None, title: str | None = None) -> PatchingViewer:
    """An interactive viewer of a patching table (a heatmap with the tokens as column headers;
    hover a cell for its point, token, head and value; choose the head; sort the rows by their
    largest ``|value|``; the largest cells listed), self-contained HTML and JavaScript that
    works offline.

    Args:
        source: an :class:`~funhooks.runs.Attribution` (``fh.attribution_patching``'s result:
            its table, points and metrics), or a tensor ``(layers, positions)`` (what
            :func:`~funhooks.transformer.plot_patching` draws) or ``(layers, positions, heads)``.
        tokens: the text of each position; None: the indices.
        layers: the label of each row; None: an Attribution's points, or ``0, 1, ...``.
        title: the viewer's title; None: ``"Attribution patching"`` or ``"Activation patching"``.

    Returns:
        A :class:`PatchingViewer`: ``_repr_html_`` for a notebook, ``save_html(path)`` for a page.

    Raises:
        ValueError: for a table that is not 2-D or 3-D, or `tokens` or `layers` that do not
            match its positions or rows.

    Example:
        >>> import torch, funhooks as fh
        >>> table = torch.tensor([[0.0, 1.0, -0.5], [0.2, 2.0, 0.0]])
        >>> viewer = fh.transformer.patching_viewer(table, tokens=["The", " cat", "</script>"], layers=["embed", 0])
        >>> viewer.layers, tuple(viewer.table.shape)
        (('embed', '0'), (2, 3))
        >>> html = viewer._repr_html_()
        >>> '<script' in html, 'src=' in html, '"</script>"' in html, '"values": [[[0.0, 1.0, -0.5]' in html
        (True, False, False, True)
    """
    caption = ""
    if isinstance(source, Attribution):
        tensor, names, default = source.table.detach(), source.points, "Attribution patching"
        caption = f"clean {_metric(source.clean)}, corrupt {_metric(source.corrupt)}"
    else:
        tensor = source.detach() if isinstance(source, torch.Tensor) else torch.as_tensor(source)
        names, default = tuple(str(i) for i in range(tensor.shape[0])) if tensor.ndim else (), "Activation patching"
    if tensor.ndim not in (2, 3):
        raise ValueError(f"{_CALLER}: `source` is a table `(layers, positions)` or `(layers, positions, heads)`, "
                         f"or an Attribution, got shape {tuple(tensor.shape)}. Pass one table.")
    if layers is not None:
        if len(layers) != tensor.shape[0]:
            raise ValueError(f"{_CALLER}: `layers` has one label per row ({tensor.shape[0]}), got {len(layers)}: "
                             f"{_html.short(list(layers))}. Pass one label per row.")
        names = tuple(str(layer) for layer in layers)
    labels = _html.labels(_CALLER, tokens, tensor.shape[1])
    return PatchingViewer(tensor.float().cpu(), tuple(labels), names, default if title is None else title, caption)


def _metric(value: torch.Tensor) -> str:
    """A metric as the caption writes it: its value when it is one number, else its shape."""
    return f"{value.item():.4g}" if value.numel() == 1 else f"Tensor{tuple(value.shape)}"
