"""The rank runner forgives torch's exit-time abort and nothing else."""

from __future__ import annotations

import pathlib

import _ranks
import pytest

ABORT_AT_EXIT = """\
import atexit, os, sys
def teardown():  # what torch's gloo teardown does at interpreter exit, now and then
    sys.stderr.write("terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()
atexit.register(teardown)
print("done", os.environ["RANK"])
"""

ABORT_EARLY = """\
import os, sys
sys.stderr.write("terminate called without an active exception\\n")
sys.stderr.flush()
os.abort()
"""


def test_an_abort_after_the_script_finished_is_torchs_teardown(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "late.py"
    script.write_text(ABORT_AT_EXIT)
    assert _ranks.spawn([str(script)], 2) == ["done 0\n", "done 1\n"]


def test_an_abort_before_the_script_finished_fails(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(ABORT_EARLY)
    with pytest.raises(AssertionError, match="rank 0 of .* failed"):
        _ranks.spawn([str(script)], 2)
