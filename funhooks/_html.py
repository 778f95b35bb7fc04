"""The one home of funhooks' notebook displays: the HTML that ``_repr_html_`` methods return.

Every display is a self-contained ``<table>`` with inline CSS: no script, no stylesheet, no
network, so it shows the same in JupyterLab, VS Code, a saved notebook and an offline cluster.
Every string that comes from a user (a module path, a token, a record name) is escaped here,
once, by :func:`table`. Describing a stored value (:func:`describe`) reads only its metadata
(shape, dtype, device): no tensor value is read, so a CUDA tensor never syncs with the host and
a meta tensor describes itself. Shaded cells (:func:`shade`) are for values a display shows.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from typing import TypeAlias

import attrs
import torch

__all__ = ["Cell", "Html", "MAX_ROWS", "Vocab", "describe", "label", "labels", "number", "shade", "short", "table"]

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
