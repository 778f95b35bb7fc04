"""Running a script as several `torch.distributed` ranks on the CPU, bounded in time.

Each rank is a subprocess with the environment `torchrun` would give it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), so the same script runs
under ``torchrun --nproc-per-node 2``. Every wait is bounded: a rank stuck in a collective
fails the test instead of hanging CI.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

SPAWN_TIMEOUT_S = 180
"""The whole run, start-up included, on a loaded CPU."""


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], world: int = 2, *, timeout: float = SPAWN_TIMEOUT_S, cwd: str | None = None) -> list[str]:
    """Run ``python *argv`` as `world` ranks; return each rank's standard output, failing the
    test (with the rank's standard error) when a rank fails or the run outlasts `timeout` s.

    The port comes free from the OS but is only bound later by rank 0's store, so another
    process can take it in between (other test runs on the machine): a run whose ranks fail
    with "address already in use" is started again on a new port, up to three times."""
    for _ in range(3):
        logs, codes = _spawn_once(argv, world, timeout, cwd)
        if not any(code and _PORT_TAKEN in err.lower() for code, (_, err) in zip(codes, logs)):
            break
    for rank, (code, (out, err)) in enumerate(zip(codes, logs)):
        assert code == 0 or _aborted_after_finishing(code, err), f"rank {rank} of {argv} failed:\n{out}\n{err}"
    return [out for out, _ in logs]


_PORT_TAKEN = "address already in use"

_FINISHED = "[rank script finished]\n"
_RUNNER = (
    "import os, runpy, sys\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))\n"
    f"sys.path.insert(1, {os.path.dirname(os.path.abspath(__file__))!r})\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    f"sys.stderr.write({_FINISHED!r})\n"
)
"""Runs a rank's script as ``python script`` would, with the helpers shared by the tests (in
tests/, above the script's own folder) importable as in pytest, then says on stderr that it
returned."""

_TEARDOWN_ABORT = "terminate called without an active exception\n"


def _aborted_after_finishing(code: int, err: str) -> bool:
    """True for torch's abort at interpreter exit, after the whole script ran and
    `destroy_process_group()` returned: with gloo, a C++ thread still joinable when the
    process tears down its statics calls ``std::terminate`` (SIGABRT). It happens to a few
    percent of runs on a loaded machine, with the docs' scripts and outside pytest too, never
    before the script's last line; any other failure still fails the test."""
    return code == -6 and err.endswith(_FINISHED + _TEARDOWN_ABORT)


def _spawn_once(argv: list[str], world: int, timeout: float, cwd: str | None) -> tuple[list[tuple[str, str]], list[int]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen([sys.executable, "-c", _RUNNER, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), cwd=cwd)
        for rank in range(world)
    ]
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for proc in procs:
            try:
                logs.append(proc.communicate(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {world} gloo ranks of {argv} did not finish within {timeout} s")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return logs, [proc.returncode for proc in procs]
