"""`funhooks.records.merge`: several Records as one, public (what the Recorder merges the
optimizer watches' values with; issue 37)."""

from __future__ import annotations

import pytest
import torch

import funhooks as fh
from funhooks.records import merge


def test_calls_of_one_name_are_concatenated_in_the_records_order() -> None:
    a = fh.Record({"fc": {"output": (torch.zeros(1),)}})
    b = fh.Record({"fc": {"output": (torch.ones(1), torch.full((1,), 2.0))}, "act": {"output": (torch.ones(2),)}})
    both = merge([a, b])
    assert list(both) == ["fc", "act"]
    assert [float(t) for t in both.calls("fc", "output")] == [0.0, 1.0, 2.0]
    assert list(a["fc"]) == ["output"] and len(a.calls("fc", "output")) == 1  # the inputs are left as they were
    assert merge([b, a]).calls("fc", "output")[0] is b.calls("fc", "output")[0]  # nothing copied


def test_order_sorts_the_paths_stably() -> None:
    rec = merge([fh.Record({"2": {"x": (1,)}, "0": {"x": (2,)}}), fh.Record({"1": {"y": (3,)}})], order=int)
    assert list(rec) == ["0", "1", "2"]


def test_empty_and_single_records() -> None:
    only = fh.Record({"fc": {"output": (1,)}})
    assert merge([]).equal(fh.Record())
    assert merge([fh.Record(), only, fh.Record()]).equal(only)


def test_notes_on_absences_are_kept() -> None:
    noted = fh.records.record.trusted({}, {("fc", None): "fc never ran."})
    rec = merge([noted, fh.Record({"act": {"output": (1,)}})])
    with pytest.raises(fh.RecordKeyError, match="fc never ran"):
        rec["fc"]


def test_a_value_that_is_not_a_record_is_refused() -> None:
    with pytest.raises(TypeError, match=r"merge: `records` are Records, got dict\. Pass e\.g\."):
        merge([fh.Record(), {"fc": {}}])  # type: ignore[list-item]
