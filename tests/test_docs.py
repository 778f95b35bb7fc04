"""The contract is documented: every public name is in docs/api.md and has a runnable
example in its docstring (the examples themselves run as doctests)."""

import inspect
from pathlib import Path

import pytest

import funhooks as fh

ROOT = Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
PUBLIC = [n for n in fh.__all__ if n != "__version__"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_in_the_api_page(name: str) -> None:
    """docs/api.md names `fh.<name>`."""
    assert f"fh.{name}" in API


@pytest.mark.parametrize(
    "name",
    [n for n in PUBLIC if (inspect.isfunction(getattr(fh, n)) or inspect.isclass(getattr(fh, n)))
     and not (inspect.isclass(getattr(fh, n)) and issubclass(getattr(fh, n), Exception))],
)
def test_every_public_function_and_class_has_a_runnable_example(name: str) -> None:
    """Its docstring (or its class's) holds a `>>>` example."""
    obj = getattr(fh, name)
    assert ">>>" in (obj.__doc__ or ""), f"fh.{name} has no doctest example"


def test_docs_pages_are_linked_from_the_index() -> None:
    """docs/index.md links every page in docs/."""
    index = (ROOT / "docs" / "index.md").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"({page.name})" in index, page.name
