"""The API site: mkdocs.yml builds docs/ and a reference generated from the docstrings with
`mkdocs build --strict` (a warning, a broken link or cross-reference, a docstring Griffe cannot
read, a page left out of the nav, fails), every public name has its entry, and the front page
shows in Chromium, which draws docs/images/site.png (docs/index.md shows it).

Needs the `docs` extra (in the `test` extra): where mkdocs is not installed these tests skip.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import funhooks as fh
from browser_kit import browser, keep, opened  # noqa: F401  (browser: a fixture)

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "images"
# the faces whose `__all__` the reference covers: fh.*, the subpackages reached as fh.<pkg>,
# the packages whose faces offer more than fh.* re-exports, and fh.lightning / fh.hf
FACES = ("funhooks", "funhooks.transformer", "funhooks.circuits", "funhooks.sae", "funhooks.testing",
         "funhooks.distributed", "funhooks.records", "funhooks.specs", "funhooks.runs", "funhooks.training",
         "funhooks.reducers", "funhooks.store", "funhooks.summary", "funhooks.integrations.lightning",
         "funhooks.integrations.hf")


def _mkdocs() -> None:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason=f"{module} is not installed: the API site needs the `docs` extra "
                                           "(pip install -e '.[docs]')")


def _build(config: Path, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's notice about its successor
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built once for the module's tests."""
    _mkdocs()
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    if done.returncode != 0:
        pytest.fail(f"`mkdocs build --strict` failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return out


def test_the_site_builds_with_warnings_as_errors(site: Path) -> None:
    """Every page of docs/ and of the reference is built, and no page loads anything from the network."""
    pages = {p.relative_to(ROOT / "docs").with_suffix(".html") for p in (ROOT / "docs").rglob("*.md")}
    assert sorted(p for p in pages if not (site / p).exists()) == []
    remote = re.compile(r"""<(?:script|img|iframe)[^>]* src="https?:|<link[^>]* href="https?:[^"]*"[^>]*>""")
    for page in sorted(site.rglob("*.html")):
        found = [m.group(0) for m in remote.finditer(page.read_text()) if 'rel="canonical"' not in m.group(0)]
        assert found == [], f"{page.relative_to(site)} loads {found}"


def _entries(site: Path) -> set[str]:
    """The ids of the reference's headings: one per object, its path (`funhooks.capture`)."""
    return {m.group(1) for p in (site / "reference").glob("*.html")
            for m in re.finditer(r'<h\d id="(funhooks[\w.]*)"', p.read_text())}


def test_every_public_name_has_a_reference_entry(site: Path) -> None:
    """Each name of each face's `__all__` has a heading in the reference, under that face's path
    or another face's that offers the same object (`funhooks.collect` for `funhooks.store.collect`):
    a name added to a face without a place in a docs/reference/ page fails here."""
    entries, missing = _entries(site), []
    faces = {face: importlib.import_module(face) for face in FACES}
    for face, module in faces.items():
        for name in module.__all__:
            value = getattr(module, name)
            homes = [f"{g}.{name}" for g, other in faces.items() if getattr(other, name, None) is value]
            if name != "__version__" and not entries.intersection(homes):
                missing.append(f"{face}.{name}")
    assert missing == [], "add these to a page of docs/reference/ (`::: funhooks.<name>`):\n" + "\n".join(missing)


def test_a_broken_cross_reference_fails_the_build(tmp_path: Path) -> None:
    """The guard is real: the site's own configuration, on a page citing a name funhooks does
    not have, fails to build and names it."""
    _mkdocs()
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.md").write_text("# Broken\n\nSee [`fh.capture`][funhooks.no_such_name].\n")
    handler = config["plugins"][-1]["mkdocstrings"]["handlers"]["python"]
    handler["paths"] = [str(ROOT)]
    handler["options"]["extensions"] = [str(ROOT / e) for e in handler["options"]["extensions"]]
    config.update(docs_dir=str(tmp_path / "docs"), nav=["index.md"])
    (tmp_path / "mkdocs.yml").write_text(json.dumps(config))  # JSON is YAML
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "out")
    assert done.returncode != 0 and "funhooks.no_such_name" in done.stderr, done.stderr


def _wait(devtools: Any, expression: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not devtools.evaluate(expression):
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {expression}"
        time.sleep(0.05)


def test_the_front_page_and_the_reference_in_chromium(site: Path, browser: str, tmp_path: Path) -> None:  # noqa: F811
    """The front page opened from the disk has its title and a nav naming every page; the
    reference shows `funhooks.capture` with its signature; nothing is fetched from the network.
    Draws docs/images/site.png (docs/index.md shows it)."""
    fetched = "performance.getEntriesByType('resource').map(e => e.name)"
    nav = "Array.from(document.querySelectorAll('nav.md-nav--primary a.md-nav__link[href]'), a => a.getAttribute('href'))"
    with opened(browser, site / "index.html", tmp_path, "document.querySelector('nav.md-nav--primary') !== null") as devtools:
        assert devtools.evaluate("document.title") == "funhooks"
        assert devtools.evaluate("document.querySelector('article h1').textContent").rstrip("¶") == "funhooks documentation"
        links = set(devtools.evaluate(nav))
        pages = {str(p.relative_to(ROOT / "docs").with_suffix(".html")) for p in (ROOT / "docs").rglob("*.md")}
        assert sorted(pages - links - {"index.html"}) == []
        devtools.call("Emulation.setDeviceMetricsOverride", width=1280, height=860, deviceScaleFactor=1, mobile=False)
        # a desktop's width: the nav shows as a sidebar, not a drawer
        _wait(devtools, "getComputedStyle(document.querySelector('.md-sidebar--primary')).visibility === 'visible'")
        # the theme fades the nav in: a screenshot taken meanwhile catches it half drawn
        devtools.evaluate("document.head.insertAdjacentHTML('beforeend', "
                          "'<style>*{transition:none!important;animation:none!important}</style>'), true")
        shot = devtools.call("Page.captureScreenshot", format="png",
                             clip=dict(x=0, y=0, width=1280, height=860, scale=1))
        keep(IMAGES / "site.png", base64.b64decode(shot["data"]))

        assert [u for u in devtools.evaluate(fetched) if not u.startswith("file:")] == []
        devtools.call("Page.navigate", url=(site / "reference" / "runs.html").as_uri())
        _wait(devtools, "document.getElementById('funhooks.capture') !== null")
        entry = "document.getElementById('funhooks.capture')"
        assert devtools.evaluate(f"{entry}.textContent").strip().startswith("funhooks.capture")
        assert devtools.evaluate(f"{entry}.nextElementSibling.className") == "doc-signature highlight"
        signature = devtools.evaluate(f"{entry}.nextElementSibling.textContent")
        assert re.sub(r",(?=[)\]])", "", re.sub(r"\s+", "", signature)) == "capture(model:Module,specs:Spec|Iterable[Spec])->Callable[...,tuple[Any,Record]]"
        assert [u for u in devtools.evaluate(fetched) if not u.startswith("file:")] == []
