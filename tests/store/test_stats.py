"""Activation stores: per-column statistics written with the store, equal to a second pass,
for old stores too, and the normalisation they give."""

from __future__ import annotations

import json
import math
import pathlib
import tempfile

import hypothesis
import pytest
import torch
from store_helpers import expected_rows, feed, streams, writer_for
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    x = x.double().reshape(len(x), -1)
    return x.mean(0), x.var(0, correction=0), float(torch.linalg.vector_norm(x, dim=1).mean())


@hypothesis.given(stream=streams())
def test_stats_written_with_the_store_are_those_of_a_second_pass(stream):
    """Any stream, shard size, mask and cast: the statistics read from the manifests are
    bit-equal to reading every shard again, and agree with a float64 pass over the rows."""
    with tempfile.TemporaryDirectory() as d:
        ds = feed(writer_for(d, stream), stream)
        got, again = ds.stats(), ds.stats(recompute=True)
        assert list(got) == ["a/output"]  # floating-point columns only
        s, r = got["a/output"], again["a/output"]
        assert s.count == r.count
        same = [torch.equal(torch.as_tensor(x).nan_to_num(7.0), torch.as_tensor(y).nan_to_num(7.0))
                for x, y in ((s.mean, r.mean), (s.var, r.var), (s.mean_norm, r.mean_norm))]
        assert same == [True, True, True]
        rows = expected_rows(stream)["a/output"]
        assert s.count == len(rows)
        if len(rows):
            mean, var, norm = _reference(rows)
            assert torch.allclose(s.mean, mean, rtol=1e-5, atol=1e-6)
            assert torch.allclose(s.var, var, rtol=1e-5, atol=1e-6)
            assert math.isclose(s.mean_norm, norm, rel_tol=1e-5, abs_tol=1e-6)


def _store(tmp_path: pathlib.Path, rows_per_shard: int = 5) -> fh.ActivationDataset:
    gen = torch.Generator().manual_seed(0)
    writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tmp_path,
                                 rows_per_shard=rows_per_shard, fsync=False)
    return fh.collect(writer, [3 + 2 * torch.randn(6, 2, 3, generator=gen) for _ in range(4)])


def _edit_lines(directory: pathlib.Path, edit) -> None:
    path = directory / "manifest.rank0.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(edit(line) if i else line) + "\n" for i, line in enumerate(lines)))


def test_stats_keep_the_row_shape_and_count_every_row(tmp_path):
    """A column of (2, 3) rows over 24 rows in 5 shards: mean and var of shape (2, 3), std their root."""
    ds = _store(tmp_path)
    s = ds.stats()["0/output"]
    rows = ds[:]["0/output"]
    assert (s.count, s.mean.shape, s.var.dtype, ds.shards) == (24, (2, 3), torch.float64, 5)
    assert torch.allclose(s.mean, rows.double().mean(0)) and torch.allclose(s.std, rows.double().std(0, correction=0))


def test_stores_written_before_stats_still_give_them(tmp_path):
    """Shard lines without `stats` (an older store): the store opens and its statistics are read from the shards."""
    ds = _store(tmp_path)
    want = ds.stats()["0/output"]
    _edit_lines(tmp_path, lambda line: {k: v for k, v in line.items() if k != "stats"})
    got = fh.ActivationDataset(tmp_path).stats()["0/output"]
    assert torch.equal(got.mean, want.mean) and torch.equal(got.var, want.var) and got.mean_norm == want.mean_norm


def test_a_damaged_stats_field_names_the_shard(tmp_path):
    """A shard line whose `stats` lost a field: a StoreError naming column, shard and how to recover."""
    _store(tmp_path)
    _edit_lines(tmp_path, lambda line: {**line, "stats": {"0/output": {"count": 5}}})
    with pytest.raises(fh.StoreError) as e:
        fh.ActivationDataset(tmp_path).stats()
    assert str(e.value) == (
        "ActivationDataset: a shard line's `stats` give '0/output' a `count` and `mean`, `m2` lists of 6 numbers and "
        f"a `norm_sum`, got {{'count': 5}} in shard 0 of rank 0 (shard.rank0.000000.safetensors) in {str(tmp_path)!r}. "
        "Restore the manifest, or read "
        "the statistics again with `ds.stats(recompute=True)`."
    )
    assert fh.ActivationDataset(tmp_path).stats(recompute=True)["0/output"].count == 24


def test_norm_scale_gives_rows_the_target_mean_norm(tmp_path):
    """`x * stats.norm_scale(target)` has mean L2 norm `target` (SAELens: sqrt(d))."""
    ds = _store(tmp_path)
    s = ds.stats()["0/output"]
    target = math.sqrt(6)
    scaled = ds[:]["0/output"].double() * s.norm_scale(target)
    assert math.isclose(float(scaled.flatten(1).norm(dim=1).mean()), target, rel_tol=1e-6)


def test_a_selected_column_has_stats_and_int_columns_have_none(tmp_path):
    """A store opened on some columns gives the statistics of its floating-point ones."""
    model = nn.Sequential(nn.Embedding(10, 4))
    spec = fh.observe("0", lambda m, args, out: args[0], name="ids")
    writer = fh.ActivationWriter(model, [spec, fh.outputs("0")], tmp_path, fsync=False)
    ds = fh.collect(writer, [torch.randint(0, 10, (5,))])
    assert list(ds.stats()) == ["0/output"]
    assert fh.ActivationDataset(tmp_path, columns="0/ids").stats() == {}


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_stats_of_batches_that_cross_chunks_and_shards_equal_a_second_pass(tmp_path, dtype):
    """Statistics are computed while writing, in `STATS_CHUNK_ROWS`-row chunks from each shard's
    first row: batches that end inside a chunk, hold several whole chunks, or cross a shard give
    exactly the numbers of reading every shard again."""
    chunk = fh.store.STATS_CHUNK_ROWS
    gen = torch.Generator().manual_seed(1)
    sizes = [chunk - 300, 200, 2 * chunk + 150, 3, chunk, 700]
    writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tmp_path, dtype=dtype,
                                 rows_per_shard=3 * chunk + 10, fsync=False)
    ds = fh.collect(writer, [1 + torch.randn(n, 5, generator=gen) for n in sizes])
    got, again = ds.stats()["0/output"], ds.stats(recompute=True)["0/output"]
    assert (got.count, ds.shards) == (sum(sizes), 2)
    assert torch.equal(got.mean, again.mean) and torch.equal(got.var, again.var) and got.mean_norm == again.mean_norm


def _set(field, value):
    """An edit of shard 0's line: its `stats` field `field` of column 0/output set to `value(old)`."""
    def edit(line):
        if line["shard"] == 0:
            line["stats"]["0/output"][field] = value(line["stats"]["0/output"][field])
        return line
    return edit


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("count", lambda old: 0, "`count` 0 where the shard holds 5 rows"),
    ("count", lambda old: 10**6, "`count` 1000000 where the shard holds 5 rows"),
    ("count", lambda old: True, None),
    ("m2", lambda old: [-abs(v) - 1.0 for v in old], "a negative `m2`"),
    ("norm_sum", lambda old: -1.0, "a negative `norm_sum` (-1.0)"),
])
def test_stats_that_cannot_be_the_shards_are_refused_by_stats_and_verify(tmp_path, field, value, problem):
    """A shard line's statistics are checked against the shard: a count other than its rows (0, 10**6, `true`)
    or a negative sum of squares gives a StoreError naming column, shard and the fix, from `stats()` and from
    `verify()`, never a wrong mean or variance; `recompute=True` still reads the rows."""
    want = _store(tmp_path).stats()["0/output"]
    _edit_lines(tmp_path, _set(field, value))
    ds = fh.ActivationDataset(tmp_path)
    for check in (ds.stats, ds.verify):
        with pytest.raises(fh.StoreError) as e:
            check()
        message = str(e.value)
        assert "'0/output'" in message and "shard 0 of rank 0 (shard.rank0.000000.safetensors)" in message
        assert message.endswith("Restore the manifest, or read the statistics again with `ds.stats(recompute=True)`.")
        if problem is not None:
            assert problem in message
    again = ds.stats(recompute=True)["0/output"]
    assert again.count == want.count == 24 and torch.equal(again.var, want.var)
