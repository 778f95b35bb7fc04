"""DataLoader workers and an open run (issue 26, decided and documented in docs/field.md): a
forked worker's calls run under a copy of the run, edited, and their records never reach the
parent's Record; a spawned worker gets the bare model."""

from __future__ import annotations

import multiprocessing

import pytest
import torch
from torch import nn

import funhooks as fh


class ModelFeatures(torch.utils.data.Dataset):
    """A data set whose rows are the model's outputs (features computed in the worker)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> torch.Tensor:
        with torch.no_grad():
            return self.model(torch.zeros(1, 2))[0]


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs the fork start method")
def test_forked_workers_see_the_runs_editors_and_record_nothing_in_it() -> None:
    model = nn.Linear(2, 1)
    nn.init.zeros_(model.weight)
    nn.init.zeros_(model.bias)
    loader = torch.utils.data.DataLoader(ModelFeatures(model), batch_size=2, num_workers=1,
                                         multiprocessing_context="fork")
    with fh.with_hooks(model, [fh.edit("", lambda m, a, o: o + 1), fh.outputs("")]) as run:
        (rows,) = list(loader)
    assert rows.tolist() == [[1.0], [1.0]]  # edited in the worker
    assert "" not in run.record  # the worker's calls stay in the worker
    fh.testing.assert_no_hooks(model)
