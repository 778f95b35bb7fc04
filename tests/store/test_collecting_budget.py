"""Activation stores: `collect(max_rows=)` stops at a budget of rows, and a store refuses to be
continued from inputs other than those it was written from."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(30, 4))


def _batches(seed: int = 0, n: int = 5) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 30, (3, 4), generator=gen)
        ids[:, 3] = 0
        out.append({"input": ids})
    return out


def _writer(directory) -> fh.ActivationWriter:
    return fh.ActivationWriter(_model(), fh.outputs("0"), directory, flatten=True, rows_per_shard=4, fsync=False)


def _collect(directory, batches, **kw) -> fh.ActivationDataset:
    return fh.collect(_writer(directory), batches, mask=lambda b: b["input"] != 0, **kw)


def test_max_rows_keeps_exactly_the_first_rows(tmp_path):
    """A budget of 13 tokens (9 per batch): the store holds the first 13 rows of the whole run."""
    full = _collect(tmp_path / "full", _batches())[:]["0/output"]
    ds = _collect(tmp_path / "cut", _batches(), max_rows=13)
    assert len(ds) == 13 and torch.equal(ds[:]["0/output"], full[:13])


def test_a_larger_budget_goes_on_from_the_next_batch(tmp_path):
    """Budget 13, then none: batch 1's rows past the budget stay out, batches 2.. follow."""
    full = _collect(tmp_path / "full", _batches())[:]["0/output"]
    _collect(tmp_path / "cut", _batches(), max_rows=13)
    ds = _collect(tmp_path / "cut", _batches())
    assert torch.equal(ds[:]["0/output"], torch.cat([full[:13], full[18:]]))


def test_shard_lines_record_the_inputs_consumed(tmp_path):
    """Each committed shard names how many batches its rows come from and their fingerprint."""
    _collect(tmp_path, _batches(), max_rows=13)
    lines = [json.loads(line) for line in (tmp_path / "manifest.rank0.jsonl").read_text().splitlines()[1:]]
    assert [line["inputs"]["batches"] for line in lines] == [1, 1, 2, 2]
    assert len({line["inputs"]["fingerprint"] for line in lines}) == 2


def test_continuing_with_other_inputs_is_refused(tmp_path):
    """A store begun on some batches, continued on others: a StoreError, and nothing written."""
    _collect(tmp_path, _batches(), max_rows=13)
    want = [json.loads(line) for line in (tmp_path / "manifest.rank0.jsonl").read_text().splitlines()][-1]["inputs"]
    before = (tmp_path / "manifest.rank0.jsonl").read_text()
    with pytest.raises(fh.StoreError) as e:
        _collect(tmp_path, _batches(seed=1))
    assert str(e.value).startswith("collect: a store is continued with the inputs that wrote it, got '")
    assert str(e.value).endswith(
        f"' for the first 2 batches where {str(tmp_path)!r} was written from inputs of fingerprint "
        f"{want['fingerprint']!r}. Pass the same inputs in the same order, or write to a new directory."
    )
    with pytest.raises(fh.StoreError, match="got '1 batches' for the first 2 batches"):
        _collect(tmp_path, _batches(n=1))
    assert (tmp_path / "manifest.rank0.jsonl").read_text() == before


def test_the_same_inputs_again_write_nothing(tmp_path):
    """A finished store, collected again from the same inputs: checked, nothing run, nothing added."""
    ds = _collect(tmp_path, _batches())
    calls = []
    model = _model()
    model[0].register_forward_hook(lambda *a: calls.append(1))
    writer = fh.ActivationWriter(model, fh.outputs("0"), tmp_path, flatten=True, rows_per_shard=4, fsync=False)
    again = fh.collect(writer, _batches(), mask=lambda b: b["input"] != 0)
    assert (len(again), calls) == (len(ds), [])


def test_a_bad_budget_is_refused(tmp_path):
    """`max_rows=-1`: a LoopError saying what to pass."""
    with pytest.raises(fh.LoopError) as e:
        _collect(tmp_path, _batches(), max_rows=-1)
    assert str(e.value) == "collect: `max_rows` is a non-negative int or None, got -1. Pass e.g. 1_000_000."


def test_collect_leaves_no_thread_behind_and_fingerprints_as_one_thread_would(tmp_path):
    """The input digests and the shards' checksums and statistics run on worker threads while
    the model runs; when `collect` returns none is left, and each shard line's fingerprint is
    the chain of its batches computed in order."""
    import threading

    from funhooks.store import _fingerprint

    batches = _batches(n=5)
    ds = _collect(tmp_path / "a", batches)
    assert [t.name for t in threading.enumerate() if t.name.startswith("funhooks")] == []
    lines = [json.loads(line) for line in (tmp_path / "a").glob("*.jsonl").__next__().read_text().splitlines()[1:]]
    for line in lines:
        want = _fingerprint.START
        for batch in batches[: line["inputs"]["batches"]]:
            want = _fingerprint.chain(want, batch)
        assert line["inputs"]["fingerprint"] == want
    assert len(ds) == sum(int((b["input"] != 0).sum()) for b in batches)


def test_max_rows_zero_on_a_new_directory_is_a_loop_error(tmp_path):
    """Zero rows asked of a new directory: a LoopError saying so, no model run, no store, no lock left."""
    calls = []
    model = _model()
    model.register_forward_hook(lambda *a: calls.append(1))
    writer = fh.ActivationWriter(model, fh.outputs("0"), tmp_path, flatten=True, rows_per_shard=4, fsync=False)
    with pytest.raises(fh.LoopError, match=r"`max_rows=0` asks for 0 rows for .*holds no store yet. Pass max_rows >= 1"):
        fh.collect(writer, _batches(), max_rows=0)
    assert calls == [] and not list(tmp_path.glob("manifest*"))
    assert len(_collect(tmp_path, _batches(), max_rows=5)) == 5  # the rank is not left locked
    assert len(_collect(tmp_path, _batches(), max_rows=0)) == 5  # an existing store comes back as it is


def test_inputs_without_a_batch_on_a_new_directory_is_a_loop_error(tmp_path):
    with pytest.raises(fh.LoopError, match=r"`inputs` gave no batch"):
        _collect(tmp_path, [])
