"""Running a benchmark script in its smoke mode (``--quick``) from a test: ``run_quick`` and
``assert_common_keys``, shared by tests/project/test_benchmarks.py and the packages' own
benchmark smoke tests (tests/summary/...), whichever runs first in a process."""

from __future__ import annotations

import getpass
import json
import os
import pathlib
import subprocess
import sys
import tempfile

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"
SMOKE_TIMEOUT_S = 120


def run_quick(script: str, out: pathlib.Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run ``benchmarks/<script> --quick --out <out>`` in a fresh interpreter; its JSON if written.
    Its temporary files go to ``<out>/tmp``, which must be empty when it exits (inductor's
    cache of compiled kernels stays where it always is, shared between runs)."""
    tmp = out / "tmp"
    tmp.mkdir()
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp),
           "TORCHINDUCTOR_CACHE_DIR": inductor}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out)],
        capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, check=False,
    )
    assert not list(tmp.iterdir()), f"{script} left temporary files behind"
    name = script.removeprefix("bench_").removesuffix(".py")
    path = out / f"{name}.json"
    return proc, json.loads(path.read_text()) if path.exists() else None


def assert_common_keys(result: dict, name: str) -> None:
    """Every result names its benchmark and machine, says whether it was quick, and holds results."""
    assert result["benchmark"] == name
    assert {"cpu", "torch", "python", "git_commit"} <= set(result["machine"])
    assert result["quick"] is True
    assert result["conditions"]["torch_threads"] == 1
    assert "results" in result
