"""What the reducer results' notebook displays share: a summary table of the last recorded step
with the result's plot under it (``_repr_html_``, built by :mod:`funhooks._html`).

A display reads the numbers of the last recorded step alone for its table (one small copy to the
host, whatever the number of steps) and the step counts from the paths each step kept (no value
read); the plot under it reads what it draws, every step. Without matplotlib the table comes
alone, with a note naming the extra. There is no ``_repr_png_`` beside the HTML (see NOTE [one
picture per display] in ``funhooks/_html.py``): the plot is drawn once per display.

Cost: one figure drawn and encoded as PNG (a few hundred milliseconds), and the table's copy.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from funhooks import _html
from funhooks.errors import ExtraError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["caption", "html", "steps_per_path", "value"]

_ABSENT = "—"
"""What a table cell shows for a layer that did not run (or had no value) on the last step."""


def steps_per_path(paths_per_step: Iterable[tuple[str, ...]]) -> collections.Counter[str]:
    """How many recorded steps each path has values on (read from the paths alone)."""
    return collections.Counter(p for paths in paths_per_step for p in paths)


def value(v: float | None, iteration: int, *, scale: float = 1.0) -> _html.Cell:
    """A statistic's cell: `v` times `scale` to 4 significant digits, the exact value on hover;
    :data:`_ABSENT` for None (the layer had none on the step of `iteration`)."""
    if v is None:
        return _html.Cell(_ABSENT, title=f"no value at iteration {iteration}")
    return _html.Cell(_html.significant(scale * v), title=repr(scale * v) if not math.isnan(v) else None)


def html(name: str, header: Sequence[str], rows: Sequence[Sequence[_html.Cell | str]], *, caption: str,
         draw: Callable[[], Figure] | None) -> _html.Html:
    """A result's display: the first :data:`~funhooks._html.MAX_ROWS` of `rows` under `header`
    (the count of the rest in a last row), then the figure `draw` makes (None: no steps, no plot),
    or a note when matplotlib is missing."""
    table = _html.table(header, rows[: _html.MAX_ROWS], caption=caption, total=len(rows), row_header=True)
    if draw is None:
        return _html.stack(table)
    try:
        figure = draw()
    except ExtraError:
        return _html.stack(table, _html.note("No plot: it needs matplotlib. Install the extra: pip install 'funhooks[plot]'."))
    return _html.stack(table, _html.image(_html.png(figure), f"{name} plot"))


def caption(name: str, iterations: Sequence[int], layers: int, kind: str) -> str:
    """``GradientStats: 3 recorded step(s), 2 layer(s); values at the last (iteration 2)``."""
    if not iterations:
        return f"{name}: no recorded steps"
    return f"{name}: {len(iterations)} recorded step(s), {layers} {kind}(s); values at the last (iteration {iterations[-1]})"
