"""What a person sees in a notebook display: its HTML parsed with the stdlib's ``html.parser``.

``seen(markup)`` gives the caption and the table's rows as the visible text of each cell (the
header row first), with each cell's hover text and background; ``assert_self_contained``
checks a display needs nothing but itself (no script, no stylesheet link, no network).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser


@dataclass
class Cell:
    text: str
    title: str | None
    background: str | None


@dataclass
class Seen:
    caption: str = ""
    rows: list[list[Cell]] = field(default_factory=list)

    def texts(self) -> list[list[str]]:
        """Each row's visible cell texts, the header row first."""
        return [[c.text for c in row] for row in self.rows]

    def text(self) -> str:
        """Everything visible, one cell after another."""
        return " ".join([self.caption, *(c.text for row in self.rows for c in row)])


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.seen = Seen()
        self.cell: Cell | None = None
        self.in_caption = False
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "tr":
            self.seen.rows.append([])
        elif tag in ("td", "th"):
            match = re.search(r"background:([^;]+)", a.get("style") or "")
            self.cell = Cell("", a.get("title"), match.group(1) if match else None)
        elif tag == "caption":
            self.in_caption = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self.cell is not None:
            self.seen.rows[-1].append(self.cell)
            self.cell = None
        elif tag == "caption":
            self.in_caption = False

    def handle_data(self, data: str) -> None:
        if self.cell is not None:
            self.cell.text += data
        elif self.in_caption:
            self.seen.caption += data


def seen(markup: str) -> Seen:
    parser = _Parser()
    parser.feed(markup)
    parser.close()
    assert parser.tags.count("table") == 1, "a display is one table"
    return parser.seen


def assert_self_contained(markup: str) -> None:
    lowered = markup.lower()
    for needle in ("<script", "<link", "http://", "https://", "src=", "@import"):
        assert needle not in lowered, f"a display holds {needle!r}: it must need nothing but itself"
