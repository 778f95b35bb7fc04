"""Every notebook in examples/ runs in a real Jupyter kernel, and its displays are HTML.

Each notebook is executed once, top to bottom, by ``nbclient`` in an IPython kernel (ipykernel's
own ``python3`` kernel spec, resolved to this interpreter: no kernel registered on the machine is
used), in an empty directory, with the Hugging Face hub offline. A cell that raises fails the run. Cells tagged
``display`` must show HTML (a ``text/html`` output: funhooks' ``_repr_html_``), cells tagged
``figure`` a picture (``image/png``); no cell writes to stderr (a warning a user would see). The
notebooks are stored without outputs: the suite makes them.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="the `notebook` extra is not installed")
nbclient = pytest.importorskip("nbclient", reason="the `notebook` extra is not installed")
pytest.importorskip("ipykernel", reason="the `notebook` extra is not installed")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402  # nbclient's own dependency
from jupyter_client.manager import AsyncKernelManager  # noqa: E402

import funhooks  # noqa: E402

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.ipynb"))
CELL_TIMEOUT_S = 180
STARTUP_TIMEOUT_S = 120
ANSI = r"\x1b\[[0-9;]*m"
"""The colours of IPython's tracebacks."""
WHERE = "import sys, funhooks; print(sys.executable); print(funhooks.__file__)"
"""A last cell the test adds to its copy of a notebook: which interpreter and funhooks the kernel ran."""


def _kernel() -> AsyncKernelManager:
    """ipykernel's ``python3`` kernel on this interpreter: no kernel directory is searched, so
    a kernel spec registered for the user or the system (another Python) is never picked."""
    specs = KernelSpecManager(kernel_dirs=[], ensure_native_kernel=True)
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)


def _stored(path: Path) -> object:
    return nbformat.read(path, as_version=4)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Each notebook, executed (its cells with their outputs), by file name."""
    # the kernel's environment: one thread (the CI machine is shared), the backend a notebook
    # uses (ipykernel's inline one; CI exports MPLBACKEND=Agg for the scripts), and an IPython
    # profile of its own (no startup file or config of the user's, nothing written to their home);
    # the Hugging Face hub offline: a notebook that would download something fails
    env = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    env.update(OMP_NUM_THREADS="1", IPYTHONDIR=str(tmp_path_factory.mktemp("ipython")), HF_HUB_OFFLINE="1")
    done = {}
    for path in NOTEBOOKS:
        nb = _stored(path)
        nb.cells.append(nbformat.v4.new_code_cell(WHERE))
        cwd = tmp_path_factory.mktemp(path.stem)
        client = nbclient.NotebookClient(nb, km=_kernel(), timeout=CELL_TIMEOUT_S, startup_timeout=STARTUP_TIMEOUT_S,
                                         resources={"metadata": {"path": str(cwd)}})
        try:
            client.execute(env=env, cleanup_kc=True)  # shut the kernel down: the test owns the kernel manager
        except nbclient.exceptions.CellExecutionError as error:
            done[path.name] = error
            continue
        done[path.name] = nb
    return done


def _ran(executed: dict[str, object], name: str) -> object:
    nb = executed[name]
    if isinstance(nb, Exception):
        pytest.fail(f"{name} failed in the kernel:\n{re.sub(ANSI, '', str(nb))}")
    return nb


def _tagged(nb: object, tag: str) -> list[object]:
    return [c for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


def _mimes(cell: object) -> set[str]:
    return {m for o in cell.outputs if o.output_type in ("display_data", "execute_result") for m in o.data}


def test_there_is_a_notebook() -> None:
    """The examples folder holds the tour, and it tags the displays this suite checks."""
    assert "tour.ipynb" in {p.name for p in NOTEBOOKS}
    tour = _stored(next(p for p in NOTEBOOKS if p.name == "tour.ipynb"))
    assert len(_tagged(tour, "display")) >= 6 and _tagged(tour, "figure")
    assert tour.metadata.kernelspec.name == "python3"  # the kernel Jupyter opens it with


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_stored_without_outputs(path: Path) -> None:
    """A notebook is stored as its code alone: no outputs, no execution counts (the suite makes them)."""
    nb = _stored(path)
    nbformat.validate(nb)
    kept = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not kept, f"{path.name}: code cells {kept} hold outputs; clear them (Jupyter: Edit > Clear Outputs) and save"


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_notebook_runs(executed: dict[str, object], name: str) -> None:
    """Every cell runs without an error, and none writes to stderr (a warning a user would see)."""
    nb = _ran(executed, name)
    streams = [(i, o.text) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.outputs
               if o.output_type == "stream" and o.name == "stderr"]
    assert not streams, f"{name}: cells wrote to stderr: {streams}"


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_kernel_is_this_python(executed: dict[str, object], name: str) -> None:
    """The kernel ran this interpreter (the test's venv) and imported the funhooks under test."""
    nb = _ran(executed, name)
    printed = "".join(o.text for o in nb.cells[-1].outputs if o.output_type == "stream").split("\n")
    assert printed[:2] == [sys.executable, funhooks.__file__]


@pytest.mark.parametrize("name", [p.name for p in NOTEBOOKS])
def test_displays_are_html(executed: dict[str, object], name: str) -> None:
    """Each cell tagged ``display`` shows HTML, each tagged ``figure`` a PNG."""
    nb = _ran(executed, name)
    for tag, mime in (("display", "text/html"), ("figure", "image/png")):
        for cell in _tagged(nb, tag):
            found = _mimes(cell)
            assert mime in found, f"{name}: the `{tag}` cell\n{cell.source}\nshowed {sorted(found) or 'nothing'}"
            shown = [o.data[mime] for o in cell.outputs if mime in o.data.keys()]
            assert all(s.strip() for s in shown)
