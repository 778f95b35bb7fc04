"""The contract is documented: every public name is in docs/api.md and has a runnable
example in its docstring (the examples themselves run as doctests)."""

import inspect
import re
from pathlib import Path

import pytest
import torch

import funhooks as fh

ROOT = Path(__file__).resolve().parents[2]
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


RANKS_PAGE = ROOT / "docs" / "distributed.md"
SCRIPT = re.compile(r"<!-- run on 2 ranks: (\S+) -->\n```python\n(.*?)```\n\n```text\n(.*?)```", re.S)


@pytest.mark.parametrize("name", [m.group(1) for m in SCRIPT.finditer(RANKS_PAGE.read_text())])
def test_distributed_page_scripts_run_on_two_gloo_ranks(name: str, tmp_path: Path) -> None:
    """Each script of docs/distributed.md runs as two gloo ranks and rank 0 prints what the page shows."""
    import _ranks

    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    if name == "fsdp.py" and torch.__version__ < (2, 7):
        pytest.skip("FSDP2 on the CPU needs a torch newer than 2.6 (tests/fsdp_helpers.py)")
    (match,) = [m for m in SCRIPT.finditer(RANKS_PAGE.read_text()) if m.group(1) == name]
    (tmp_path / name).write_text(match.group(2))
    first, _ = _ranks.spawn([str(tmp_path / name)], 2, cwd=str(tmp_path))
    assert first == match.group(3)
