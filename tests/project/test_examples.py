"""Every script in examples/ runs to completion, in its fast mode (FUNHOOKS_FAST=1).

The scripts run concurrently in subprocesses, each in its own empty directory (so files
they write land there), then each test checks one script's exit status.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.py"))
TIMEOUT_S = 240
WORKERS = 3


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """Each example's completed process."""
    env = {**os.environ, "FUNHOOKS_FAST": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}

    def run(script: Path) -> subprocess.CompletedProcess[str]:
        cwd = tmp_path_factory.mktemp(script.stem)
        return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {script.name: pool.submit(run, script) for script in EXAMPLES}
        return {name: f.result() for name, f in futures.items()}


def test_there_are_examples() -> None:
    """The examples folder is found and holds the scripts this suite runs."""
    names = {p.name for p in EXAMPLES}
    assert {"feature_extraction.py", "dropout_intervention.py", "grad_clipping.py", "activation_stats.py"} <= names


@pytest.mark.parametrize("name", [p.name for p in EXAMPLES])
def test_example_runs(results: dict[str, subprocess.CompletedProcess[str]], name: str) -> None:
    """The script exits with status 0 and prints something."""
    result = results[name]
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-3000:]}"
    assert result.stdout.strip()
