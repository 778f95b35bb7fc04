"""What a viewer's HTML holds, parsed with the stdlib's ``html.parser``: its tags (with their
attributes), the JSON data it embeds, its visible text outside the scripts; and
``assert_offline``: nothing in it is loaded from anywhere (no ``src``, no ``href``, no URL
in its scripts)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from typing import Any


@dataclass
class Parsed:
    tags: list[tuple[str, dict[str, str | None]]] = field(default_factory=list)
    scripts: list[tuple[dict[str, str | None], str]] = field(default_factory=list)
    text: str = ""

    def data(self) -> Any:
        """The viewer's data: its one ``<script type="application/json">``, parsed."""
        (found,) = [body for attrs, body in self.scripts if attrs.get("type") == "application/json"]
        return json.loads(found)

    def count(self, tag: str) -> int:
        return sum(1 for t, _ in self.tags if t == tag)


class _Parser(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.parsed = Parsed()
        self._script: dict[str, str | None] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.parsed.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._script = dict(attrs)
            self.parsed.scripts.append((self._script, ""))

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._script = None

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            attrs, body = self.parsed.scripts[-1]
            self.parsed.scripts[-1] = (attrs, body + data)
        else:
            self.parsed.text += data


def parsed(html: str) -> Parsed:
    parser = _Parser()
    parser.feed(html)
    parser.close()
    return parser.parsed


def assert_offline(page: Parsed) -> None:
    """Nothing is loaded from a network: no ``src`` or ``href`` attribute, no URL in a script."""
    assert not any("src" in attrs or "href" in attrs for _, attrs in page.tags)
    assert not any(re.search(r"(https?:)?//[\w.-]+\.\w", body) for _, body in page.scripts)
