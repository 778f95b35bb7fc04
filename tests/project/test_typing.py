"""The public types hold under mypy: the library's own reducers are `fh.Reducer`s.

The whole package checks under the project's mypy settings; small snippets run against the
package's own source (torch skipped: seconds), and a snippet that breaks the protocol must fail.
mypy runs in a subprocess: in the test process it would leave millions of objects alive, which
every later `gc.collect()` of the suite, and the interpreter's exit, would walk again.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

import funhooks as fh

SOURCE_ROOT = pathlib.Path(fh.__file__).resolve().parents[1]
CONFIG = """\
[mypy]
mypy_path = {root}
follow_imports = silent
ignore_missing_imports = True
[mypy-torch.*,transformers.*,lightning.*,sklearn.*,matplotlib.*,hypothesis.*,safetensors.*,tqdm.*]
follow_imports = skip
"""

REDUCERS = """\
import attrs
import funhooks as fh


@attrs.frozen
class Count:
    specs: tuple[fh.Spec, ...] = ()

    def init(self) -> int:
        return 0

    def step(self, state: int, step: fh.Step) -> int:
        return state + 1

    def result(self, state: int) -> int:
        return state


reducers: list[fh.Reducer] = [
    fh.ActivationStats(),
    fh.HookCallback(print),
    fh.GradientStats(),
    fh.UpdateRatio(),
    fh.DeadUnits(),
    fh.LossCurve(),
    Count(),
]
"""

NOT_A_REDUCER = """\
import funhooks as fh

class NoResult:
    specs = ()
    def init(self) -> int:
        return 0
    def step(self, state: int, step: fh.Step) -> int:
        return state

reducer: fh.Reducer = NoResult()
"""


MYPY_TIMEOUT_S = 900
"""The whole package, torch's types included, from a cold cache on a loaded CPU."""


def _run_mypy(args: list[str]) -> tuple[int, str]:
    """mypy's exit status and its output, run as ``python -m mypy`` in a subprocess."""
    pytest.importorskip("mypy.api", reason="mypy is not installed (it is in the `test` extra)")
    result = subprocess.run([sys.executable, "-m", "mypy", *args], capture_output=True, text=True,
                            timeout=MYPY_TIMEOUT_S)
    return result.returncode, result.stdout + result.stderr


@pytest.fixture(scope="module")
def snippet_cache(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One mypy cache for the snippets (they share their settings): the second reuses funhooks' analysis."""
    return tmp_path_factory.mktemp("mypy-snippets")


def _mypy(tmp_path: pathlib.Path, cache: pathlib.Path, code: str) -> tuple[int, str]:
    config = tmp_path / "mypy.ini"
    config.write_text(CONFIG.format(root=SOURCE_ROOT))
    snippet = tmp_path / "snippet.py"
    snippet.write_text(textwrap.dedent(code))
    return _run_mypy([str(snippet), "--config-file", str(config), "--cache-dir", str(cache / "cache"),
                      "--no-error-summary"])


def test_library_reducers_satisfy_the_reducer_protocol(tmp_path: pathlib.Path, snippet_cache: pathlib.Path) -> None:
    """ActivationStats (`specs` a property), HookCallback, the gradient, update, dead-unit and
    loss reducers and a frozen attrs reducer (`specs` a field) all type-check as `fh.Reducer`:
    the protocol declares `specs` read-only."""
    status, out = _mypy(tmp_path, snippet_cache, REDUCERS)
    assert status == 0, out


def test_a_value_without_the_protocol_is_not_a_reducer(tmp_path: pathlib.Path, snippet_cache: pathlib.Path) -> None:
    """The check can fail: a class without `result` is rejected, naming the missing member."""
    status, out = _mypy(tmp_path, snippet_cache, NOT_A_REDUCER)
    assert status == 1 and '"NoResult" is missing following "Reducer" protocol member' in out, out


def test_the_whole_package_type_checks(tmp_path: pathlib.Path) -> None:
    """mypy with the project's own settings (pyproject.toml's [tool.mypy]) finds nothing in
    funhooks/, torch's types included: an annotation that lies fails the suite, not a review."""
    pyproject = SOURCE_ROOT / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("funhooks is installed without its repository (pip install -e . from a checkout)")
    import torch

    # torch's annotations change between releases: the ignores that 2.13's need may be unused on older ones
    older = ["--no-warn-unused-ignores"] if torch.__version__ < (2, 13) else []
    status, out = _run_mypy(["--config-file", str(pyproject), "--cache-dir", str(tmp_path / "cache"),
                             *older, str(SOURCE_ROOT / "funhooks")])
    assert status == 0, out
