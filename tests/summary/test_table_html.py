"""`module_summary`'s notebook display: the same rows and totals as the printed table."""

from __future__ import annotations

import torch
from html_kit import assert_self_contained, seen
from torch import nn

import funhooks as fh


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(1, 50), nn.ReLU(), nn.Sequential(nn.Linear(50, 3), nn.BatchNorm1d(3)))


def test_the_fastai_layout_shows_each_leaf_row_and_the_totals() -> None:
    summary = fh.module_summary(_model(), torch.randn(16, 1))
    shown = seen(summary._repr_html_())
    assert shown.texts() == [["Layer (type)", "Output Shape", "Param #", "Trainable"],
                             ["Linear", "16 x 50", "100", "True"], ["ReLU", "16 x 50", "", ""],
                             ["Linear", "16 x 3", "153", "True"], ["BatchNorm1d", "16 x 3", "6", "True"]]
    assert "Total params: 259" in shown.caption and "Input shape: ['16 x 1']" in shown.caption
    assert_self_contained(summary._repr_html_())


def test_the_full_layout_shows_every_module_with_its_shapes_and_counts() -> None:
    summary = fh.module_summary(_model(), torch.randn(16, 1), layout="full")
    rows = seen(summary._repr_html_()).texts()
    assert rows[0] == ["Layer (type)", "Input Shape", "Output Shape", "Param #", "MACs", "FLOPs"]
    assert [r[0] for r in rows[1:]] == ["Sequential", "0 (Linear)", "1 (ReLU)", "2 (Sequential)", "0 (Linear)",
                                        "1 (BatchNorm1d)"]
    assert rows[2] == ["0 (Linear)", "[16, 1]", "[16, 50]", "100", "800", "1,600"]
    printed = str(summary)
    assert all(r[0] in printed and r[2] in printed for r in rows[1:])  # the printed table's cells


def test_a_summary_of_a_meta_model_is_displayed_without_values() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 8))
    summary = fh.module_summary(model, torch.empty(2, 4096, device="meta"))
    rows = seen(summary._repr_html_()).texts()
    assert rows[1] == ["Linear", "2 x 4096", "16,781,312", "True"]


def test_the_plain_repr_stays_one_short_line() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])
    summary = fh.module_summary(model, torch.randn(2, 8), layout="full")
    assert repr(summary) == ("ModuleSummary(model='Sequential', rows=200, layers=201, total=14,400, trainable=14,400, "
                             "layout='full')")
