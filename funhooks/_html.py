"""The one home of funhooks' notebook displays: the HTML that ``_repr_html_`` methods return.

Every display is a self-contained ``<table>`` with inline CSS: no script, no stylesheet, no
network, so it shows the same in JupyterLab, VS Code, a saved notebook and an offline cluster.
Every string that comes from a user (a module path, a token, a record name) is escaped here,
once, by :func:`table`. Describing a stored value (:func:`describe`) reads only its metadata
(shape, dtype, device): no tensor value is read, so a CUDA tensor never syncs with the host and
a meta tensor describes itself. Shaded cells (:func:`shade`) are for values a display shows.
A picture goes inside the HTML (:func:`image`: a PNG as a ``data:`` URI; :func:`heatmap`: SVG
drawn here), never as a second format beside it (NOTE [one picture per display]).
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

import attrs
import torch

__all__ = ["Cell", "Html", "MAX_ROWS", "Svg", "Vocab", "describe", "heatmap", "image", "label", "labels", "largest", "note",
           "number", "png", "shade", "short", "significant", "stack", "table"]

MAX_ROWS = 400
"""A display lists at most this many rows, then says how many it left out."""
_MAX_TEXT = 80
_STYLE = ("border-collapse:collapse;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;"
          "font-size:12px;text-align:left")
_TD = "padding:2px 8px;border:1px solid #ddd"
_TH = _TD + ";background:#f4f4f4"

Vocab: TypeAlias = Sequence[str] | Callable[[int], str] | None
"""How token ids are written: the vocabulary as a sequence indexed by id, a function of an id
(a Hugging Face tokenizer's ``decode``), or None for the ids themselves."""


class Html(str):
    """Markup that a notebook shows as HTML (``_repr_html_``) and code reads as a ``str``."""

    __slots__ = ()

    def _repr_html_(self) -> str:
        return str(self)


@attrs.frozen
class Cell:
    """One table cell: its text (escaped when written), an optional background colour and hover text."""

    text: str
    background: str | None = None
    title: str | None = None
    indent: int = 0


def short(text: object, limit: int = _MAX_TEXT) -> str:
    """`text` as a str of at most `limit` characters (an ellipsis marks a cut)."""
    s = str(text)
    return s if len(s) <= limit else s[: limit - 1] + "…"


def _td(cell: Cell | str, tag: str) -> str:
    cell = cell if isinstance(cell, Cell) else Cell(cell)
    style = _TH if tag == "th" else _TD
    if cell.background:
        style += f";background:{cell.background}"
    if cell.indent:
        style += f";padding-left:{8 + 14 * cell.indent}px"
    title = f' title="{html.escape(cell.title)}"' if cell.title else ""
    return f'<{tag} style="{style}"{title}>{html.escape(cell.text)}</{tag}>'


def table(header: Sequence[Cell | str], rows: Iterable[Sequence[Cell | str]], *, caption: str = "",
          total: int | None = None, row_header: bool = False) -> Html:
    """A ``<table>`` of `rows` under `header` (the first cell of each row a ``<th>`` with
    `row_header`), with `caption` above it; `total`: how many rows there are in all, when
    `rows` holds only the first of them (a last row says how many were left out)."""
    out = [f'<table style="{_STYLE}">']
    if caption:
        out.append(f'<caption style="text-align:left;font-weight:bold;padding:2px 0">{html.escape(caption)}</caption>')
    out.append("<thead><tr>" + "".join(_td(c, "th") for c in header) + "</tr></thead><tbody>")
    shown = 0
    for row in rows:
        cells = [_td(c, "th" if row_header and i == 0 else "td") for i, c in enumerate(row)]
        out.append("<tr>" + "".join(cells) + "</tr>")
        shown += 1
    if total is not None and total > shown:
        out.append(f'<tr><td style="{_TD};color:#777" colspan="{len(header)}">'
                   f"… {total - shown} more not shown</td></tr>")
    out.append("</tbody></table>")
    return Html("".join(out))


def number(value: float, digits: int = 3) -> str:
    """`value` rounded to `digits` decimals, as a display writes it (``round(value, digits)``)."""
    return f"{round(value, digits):.{digits}f}"


def shade(value: float, scale: float) -> str:
    """A background for `value` on a diverging scale: red above 0, blue below, white at 0,
    full colour at ``abs(value) == scale``."""
    alpha = 0.0 if scale <= 0 or value != value else min(abs(value) / scale, 1.0)
    rgb = "214,39,40" if value > 0 else "31,119,180"
    return f"rgba({rgb},{alpha:.2f})"


def label(token: int, vocab: Vocab) -> str:
    """How a display writes token id `token`, with `vocab` (see :data:`Vocab`)."""
    if vocab is None:
        return str(token)
    return str(vocab(token) if callable(vocab) else vocab[token])


def labels(owner: str, tokens: Sequence[object] | None, count: int) -> list[str]:
    """The label of each of `count` positions: `tokens` as strings, checked to be one per position."""
    if tokens is None:
        return [str(i) for i in range(count)]
    if len(tokens) != count:
        raise ValueError(f"{owner}: `tokens` has one label per position ({count}), got {len(tokens)}: "
                         f"{short(list(tokens))}. Pass one string per position.")
    return [str(t) for t in tokens]


def _dims(shape: Sequence[int]) -> str:
    return "×".join(str(d) for d in shape) if len(shape) else "scalar"


def describe(value: object) -> tuple[str, str, str]:
    """(shape, dtype, device) of a stored value, read from metadata only; a tuple, list or dict
    of tensors gives its structure (``(2×8, None)``) and the dtypes and devices it holds; any
    other object its type's name (its repr might print tensors), a plain number or str itself."""
    dtypes: dict[str, None] = {}
    devices: dict[str, None] = {}

    def walk(v: object) -> str:
        if isinstance(v, torch.Tensor):
            dtypes[str(v.dtype).removeprefix("torch.")] = None
            devices[str(v.device)] = None
            return _dims(v.shape)
        if isinstance(v, tuple):
            return "(" + ", ".join(walk(x) for x in v) + ("," if len(v) == 1 else "") + ")"
        if isinstance(v, list):
            return "[" + ", ".join(walk(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k}: {walk(x)}" for k, x in v.items()) + "}"
        if v is None or isinstance(v, (bool, int, float, str)):
            return short(repr(v), 40)
        return type(v).__name__  # its repr might print tensors

    shape = walk(value)
    return short(shape), ", ".join(dtypes), ", ".join(devices)


# -- pictures: a figure matplotlib drew, embedded; a heatmap drawn here -----------------------------
#
# NOTE [one picture per display]: a display that has a picture puts it inside its HTML (a PNG as a
# base64 `data:` URI, or inline SVG) and offers no `_repr_png_` / `_repr_svg_` beside it. A notebook
# asks an object for every format it has and shows the richest one (HTML before SVG before PNG in
# JupyterLab, the classic notebook and VS Code), so a second format is never shown where HTML is,
# yet it would be drawn again and stored twice in the saved notebook.

_PICTURE = "max-width:100%;height:auto;display:block;margin-top:4px"
_NOTE = "font-family:sans-serif;font-size:12px;color:#777;margin:4px 0"


def significant(value: float, digits: int = 4) -> str:
    """`value` to `digits` significant digits, as a display writes a statistic (``f"{value:.4g}"``):
    a gradient norm of 1e-7 stays readable where :func:`number` would write 0.000."""
    return f"{value:.{digits}g}"


def note(text: str) -> Html:
    """A line of grey text beside a table (escaped)."""
    return Html(f'<p style="{_NOTE}">{html.escape(text)}</p>')


def stack(*parts: str) -> Html:
    """Displays one under the other, as one display."""
    return Html("<div>" + "".join(parts) + "</div>")


def png(figure: object) -> bytes:
    """A matplotlib Figure drawn as PNG bytes (at its own size and dpi). The figure is drawn on
    its own canvas (a funhooks figure is never pyplot's), then cleared: the display keeps the
    bytes, not the figure."""
    import io

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")  # type: ignore[attr-defined]
    figure.clear()  # type: ignore[attr-defined]
    return buffer.getvalue()


def image(data: bytes, alt: str) -> Html:
    """PNG bytes as an ``<img>`` holding them (a base64 ``data:`` URI: nothing is fetched)."""
    import base64

    encoded = base64.b64encode(data).decode("ascii")
    return Html(f'<img alt="{html.escape(alt)}" style="{_PICTURE}" src="data:image/png;base64,{encoded}">')


class Svg(str):
    """An SVG picture that a notebook shows (``_repr_svg_``) and code reads as a ``str``
    (``Path("x.svg").write_text(svg)`` saves it)."""

    __slots__ = ()

    def _repr_svg_(self) -> str:
        return str(self)


_CELL_W, _CELL_H, _CHAR_W, _FONT = 18, 14, 6.6, 11
"""A heatmap cell's size, a label character's width (monospace at `_FONT` px), in px."""
_MAX_LABEL = 40
"""Characters of a heatmap label beyond which it is cut."""


def heatmap(values: Sequence[Sequence[float]], rows: Sequence[str], columns: Sequence[str], *,
            caption: str, total: int | None = None) -> Svg:
    """`values` (one list per row) as an SVG heatmap: one cell per value, coloured as
    :func:`shade` colours a table's (red above 0, blue below, full colour at the largest
    magnitude), the row labels on the left, the column labels (tokens) upright underneath, the
    exact value on hover; `caption` above; `total`: how many rows there are in all when
    `values` holds the first of them (a line says how many were left out). Every label is
    escaped. Self-contained: no script, no font or stylesheet to load."""
    scale = largest(values)
    row_labels = [short(r, _MAX_LABEL) for r in rows]
    col_labels = [short(c, _MAX_LABEL) for c in columns]
    left = 8 + _CHAR_W * max((len(r) for r in row_labels), default=1)
    top = 24
    bottom = 8 + _CHAR_W * max((len(c) for c in col_labels), default=1)
    footer = f"red > 0 > blue; full colour at |value| = {significant(scale)}"
    if total is not None and total > len(row_labels):
        footer += f"; … {total - len(row_labels)} more rows not shown"
    width = max(left + _CELL_W * len(col_labels), _CHAR_W * max(len(caption) + 1, len(footer))) + 8
    height = top + _CELL_H * len(row_labels) + bottom + 18
    text = f'font-family="ui-monospace,Menlo,monospace" font-size="{_FONT}"'
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}"><rect width="100%" height="100%" fill="white"/>',
           f'<text x="4" y="15" {text} font-weight="bold">{html.escape(caption)}</text>']
    for i, (label, row) in enumerate(zip(row_labels, values)):
        y = top + i * _CELL_H
        out.append(f'<text x="{left - 4:.0f}" y="{y + _CELL_H - 3}" text-anchor="end" {text}>{html.escape(label)}</text>')
        for j, v in enumerate(row):
            hover = html.escape(f"{rows[i]} · {columns[j]}: {v!r}")
            out.append(f'<rect x="{left + j * _CELL_W:.0f}" y="{y}" width="{_CELL_W}" height="{_CELL_H}" '
                       f'fill="{shade(v, scale)}" stroke="#eee"><title>{hover}</title></rect>')
    below = top + _CELL_H * len(row_labels) + 4
    for j, label in enumerate(col_labels):
        x = left + j * _CELL_W + _CELL_W / 2 + 4
        out.append(f'<text transform="translate({x:.0f},{below}) rotate(-90)" text-anchor="end" {text}>'
                   f"{html.escape(label)}</text>")
    out.append(f'<text x="4" y="{height - 5:.0f}" {text} fill="#777">{html.escape(footer)}</text></svg>')
    return Svg("".join(out))


def largest(values: Sequence[Sequence[float]]) -> float:
    """The largest magnitude among `values` (rows of numbers; NaN left out, 0 for none): the
    scale at which :func:`shade` gives full colour."""
    return max((abs(v) for row in values for v in row if v == v), default=0.0)
