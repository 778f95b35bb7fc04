"""The one home of what every interactive viewer page shares: a viewer's fragment (its own
element id, its data as JSON, its script), the standalone page ``save_html`` writes and the
notebook's ``_repr_html_``. The viewers themselves (``transformer/viewer.py``,
``transformer/patching.py``, ``circuits/viewer.py``) say only what they show.

Data reaches a page only as JSON inside a ``<script type="application/json">``, with ``<``,
``>`` and ``&`` written as ``\\u003c`` ...: no string in it (a token ``</script>``) can end
the script; the scripts set every user string as text, never as markup. Nothing is loaded from
anywhere: no CDN, no network, no build step, so a page works offline, in JupyterLab, VS Code
and opened from disk.
"""

from __future__ import annotations

import abc
import json
import math
import uuid
from html import escape
from pathlib import Path

import attrs
import torch

from funhooks import _html

__all__ = ["Page", "Viewer", "rounded"]

_STYLE = "display:inline-block;font-family:ui-monospace,SFMono-Regular,Menlo,monospace;font-size:12px"
"""The style of a viewer's outer ``<div>``."""

_RUN = """
(function (root, data) {
  // an element holding `text` as text (never markup), styled by `style`: every viewer's cells
  function cell(tag, text, style) {
    const c = document.createElement(tag);
    c.textContent = text;
    if (style) c.style.cssText = style;
    return c;
  }
%(script)s
})(document.getElementById("%(id)s"),
   JSON.parse(document.getElementById("%(id)s").querySelector("script.fh-data").textContent));
"""


def _json(value: object) -> str:
    """`value` as JSON that is safe inside a ``<script>``: no ``<``, ``>`` or ``&`` is left to end it."""
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def rounded(values: torch.Tensor, digits: int) -> list:
    """`values` as nested lists of floats rounded to `digits` decimals (in float64, so the
    page's numbers are the tensor's rounded); a NaN or an infinity becomes ``None`` (JSON's null)."""
    out = values.detach().double().cpu().round(decimals=digits)
    if bool(out.isfinite().all()):
        return out.tolist()
    return [_finite(v) for v in out.tolist()]


def _finite(value: list | float) -> list | float | None:
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value if math.isfinite(value) else None


@attrs.frozen
class Page:
    """What one viewer shows: its `kind` (the ``fh-<kind>-viewer`` class of its ``<div>``),
    its `title` (bold, and the standalone page's ``<title>``), its `controls` and `body`
    (markup written by funhooks, holding no user string), its `data` (JSON) and its `script`:
    the body of a JavaScript function of ``root`` (the viewer's element) and ``data``, in which
    ``cell(tag, text, style)`` makes an element holding `text` as text."""

    kind: str
    title: str
    controls: str
    body: str
    data: object
    script: str


class Viewer(abc.ABC):
    """What every viewer offers: :meth:`html`, ``_repr_html_`` (a notebook shows it) and
    :meth:`save_html`. A viewer says what it shows in ``page()``."""

    @abc.abstractmethod
    def page(self) -> Page:
        """What the viewer shows: its data, controls and script."""

    def html(self) -> _html.Html:
        """The viewer as an HTML fragment: a ``<div>`` holding its controls, its data (JSON)
        and its script. Each call gets its own element id, so a page can hold several."""
        return _fragment(self.page())

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        """One short line: a tensor by its shape, a long sequence by its length (never the values in full)."""
        fields = ", ".join(f"{f.name}={_brief(getattr(self, f.name))}" for f in attrs.fields(type(self)))  # type: ignore[arg-type]  # every viewer is an attrs class
        return f"{type(self).__name__}({fields})"

    def save_html(self, path: str | Path) -> Path:
        """Write the viewer as a standalone page (it works offline, opened from disk); returns the path."""
        page = self.page()
        text = (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>funhooks: {escape(page.title)}</title>'
                f"</head><body>{_fragment(page)}</body></html>\n")
        target = Path(path)
        target.write_text(text, encoding="utf-8")
        return target


def _brief(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)}"
    if isinstance(value, (tuple, list)) and len(value) > 4:
        return f"<{len(value)} items>"
    return _html.short(repr(value), 40)


def _fragment(page: Page) -> _html.Html:
    """The viewer's ``<div>``: its own element id, its title, controls and body, its data and script."""
    ident = f"fh-{page.kind}-{uuid.uuid4().hex}"
    return _html.Html(
        f'<div id="{ident}" class="fh-{page.kind}-viewer" style="{_STYLE}">'
        f'<div style="margin-bottom:6px"><b>{escape(page.title)}</b> {page.controls}</div>{page.body}'
        f'<script type="application/json" class="fh-data">{_json(page.data)}</script>'
        f"<script>{_RUN % {'script': page.script, 'id': ident}}</script></div>")
