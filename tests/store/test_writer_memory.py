"""Activation stores: what the writer's worker thread holds is bounded (issue 36 item 5).

The worker digests written rows (checksums, statistics) and ``collect``'s input batches
(fingerprints) while the caller makes the next batch. However slow it is, it may hold only
about two batches: the caller waits for it rather than queue more.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")


class _Gate:
    """A batch item whose fingerprint (its ``repr``, taken on the worker thread) waits for the gate."""

    def __init__(self, gate: threading.Event | None) -> None:
        self.gate = gate

    def __repr__(self) -> str:
        if self.gate is not None:
            self.gate.wait()
        return "gate"


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

        self.rows: list[weakref.ref[np.ndarray]] = []
        """The memory of every output, alive as long as a tensor (or a view) holds it."""

    def forward(self, x: torch.Tensor, tag: object) -> torch.Tensor:
        memory = self.lin(x).detach().numpy().copy()
        self.rows.append(weakref.ref(memory))
        return torch.from_numpy(memory)


def test_a_stalled_worker_holds_at_most_two_batches(tmp_path):
    """The worker stalls on batch 0's fingerprint: the caller runs no batch beyond the next while
    it does, so no more than one earlier batch's rows are alive when a batch runs."""
    model = _Model()
    gate, alive_while_stalled = threading.Event(), []

    def before(module, args):
        if not gate.is_set():
            alive_while_stalled.append(sum(r() is not None for r in model.rows))

    model.register_forward_pre_hook(before)
    batches = [{"x": torch.randn(16, 8), "tag": _Gate(gate if i == 0 else None)} for i in range(8)]
    release = threading.Timer(1.0, gate.set)  # only so that a caller that never waits ends
    release.start()
    try:
        writer = fh.ActivationWriter(model, fh.outputs(""), tmp_path, rows_per_shard=1000, fsync=False)
        ds = fh.collect(writer, batches, progress=False)
    finally:
        gate.set()
        release.cancel()
    assert len(ds) == 8 * 16
    assert alive_while_stalled and max(alive_while_stalled) <= 1, alive_while_stalled
