"""Activation stores: what the writer holds while it writes is bounded (issue 36 item 5).

The store's worker thread writes each piece of rows while the caller takes its checksums
and statistics; ``write`` returns when both are done, and ``collect`` lets go of a batch
(its input, output and Record) before it makes the next. So when batch ``i + 1`` is made,
nothing of batch ``i`` is alive, and the process's peak resident memory stays within about
two batches of where it started, however many batches are written.
"""

from __future__ import annotations

import collections.abc
import json
import os
import pathlib
import subprocess
import sys
import textwrap
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

        self.outputs: list[weakref.ref[np.ndarray]] = []
        """The memory of every output, alive as long as a tensor (or a view) holds it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.lin(x).detach().numpy().copy()
        self.outputs.append(weakref.ref(memory))
        return torch.from_numpy(memory)


class _Inputs(collections.abc.Sequence):
    """Batches made when they are read; each read counts the earlier batches' memory still alive."""

    def __init__(self, model: _Model, n: int) -> None:
        self.model, self.n = model, n
        self.inputs: list[weakref.ref[np.ndarray]] = []
        self.alive: list[tuple[int, int]] = []
        """(earlier inputs alive, earlier outputs alive) when each batch is made."""

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:  # type: ignore[override]
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.alive.append((sum(r() is not None for r in self.inputs), sum(r() is not None for r in self.model.outputs)))
        memory = np.random.default_rng(i).standard_normal((16, 8), dtype=np.float32)
        self.inputs.append(weakref.ref(memory))
        return torch.from_numpy(memory)


@pytest.mark.parametrize("progress", [False, True], ids=["no bar", "progress bar"])
def test_nothing_of_a_batch_is_alive_when_collect_makes_the_next(tmp_path, progress, capsys):
    """Before, batch i's input (the loop's generator), its output (the loop's `_` and the worker,
    digesting it while the next batch ran) were alive when batch i + 1 was made; with a progress
    bar, its loop kept the last step (index, batch) alive too."""
    model = _Model()
    inputs = _Inputs(model, 12)
    writer = fh.ActivationWriter(model, fh.outputs("lin"), tmp_path, rows_per_shard=40, fsync=False)
    ds = fh.collect(writer, inputs, progress=progress)
    assert len(ds) == 12 * 16
    assert inputs.alive == [(0, 0)] * 12
    assert torch.equal(ds[17]["lin/output"], model.lin(inputs[1]).detach()[1])


def test_the_store_written_is_the_same(tmp_path):
    """Rows, checksums and statistics as a sequential pass gives them (the write and digest now run side by side)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5))
    batches = [torch.randn(7, 6) for _ in range(9)]
    writer = fh.ActivationWriter(model, fh.outputs("0"), tmp_path, rows_per_shard=10, fsync=False)
    ds = fh.collect(writer, batches, progress=False)
    with torch.no_grad():
        want = torch.cat([model(b) for b in batches])
    assert torch.equal(ds[:]["0/output"], want)
    ds.verify()
    stats, again = ds.stats()["0/output"], ds.stats(recompute=True)["0/output"]
    assert (stats.count, stats.mean_norm) == (again.count, again.mean_norm) == (63, stats.mean_norm)
    assert torch.equal(stats.mean, again.mean) and torch.equal(stats.var, again.var)
    torch.testing.assert_close(stats.mean, want.double().mean(0), rtol=1e-6, atol=1e-7)


_CHILD = textwrap.dedent("""
    import collections.abc, json, pathlib, sys
    import torch
    from torch import nn
    import funhooks as fh

    def status(field):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024

    class Batches(collections.abc.Sequence):
        def __len__(self):
            return int(sys.argv[2])

        def __getitem__(self, i):
            if not 0 <= i < len(self):
                raise IndexError(i)
            return torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i))  # 4 MiB

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024))
    with torch.no_grad():
        model(Batches()[0])
    writer = fh.ActivationWriter(model, fh.outputs("0"), sys.argv[1], rows_per_shard=16 * 1024, fsync=False)
    start = status("VmRSS")
    ds = fh.collect(writer, Batches(), progress=False)
    assert len(ds) == len(Batches()) * 1024
    print(json.dumps({"start": start, "peak": status("VmHWM")}))
""")

_BATCH_MIB = 4


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak resident memory is read from /proc/self/status (VmHWM), Linux only")
@pytest.mark.parametrize(("allocator", "constant_mib"), [("live bytes", 12), ("default", 32)])
def test_peak_resident_memory_of_collect_is_about_two_batches(tmp_path, allocator, constant_mib):
    """A fresh process collects 100 batches of 4 MiB; its peak resident set (VmHWM) over the
    resident set before (model, writer, one batch run) stays under 2 batches + a constant.

    "live bytes": glibc's malloc maps every block of 128 KiB or more on its own
    (``MALLOC_MMAP_THRESHOLD_``, set for the child only), so the peak counts live memory
    only: 21.2 MiB before (batch i's input and output alive beside batch i + 1's, the
    statistics' 4 MiB working chunk, about 5 MiB of the process's own), 17.1 MiB now.
    "default": the allocator as users run it, where freed blocks it does not reuse count
    too: 20-85 MiB before, 16-29 MiB now (once 33 under load: the bound leaves a block for that).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(pathlib.Path(fh.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    if allocator == "live bytes":
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "store"), "100"], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["peak"] - got["start"] < 2 * _BATCH_MIB + constant_mib, got
