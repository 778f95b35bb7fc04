"""Activation stores, streamed: `fh.ActivationStream` reads every row once over ranks and
workers, in a seeded order, shuffled across shards, and resumes mid-epoch."""

from __future__ import annotations

import tempfile

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")


def _numbered(directory, sizes: list[int], rows_per_shard: int) -> fh.ActivationDataset:
    """A store whose row i holds (i, -i): its rows name themselves."""
    writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), directory,
                                 rows_per_shard=rows_per_shard, fsync=False)
    at, batches = 0, []
    for n in sizes:
        i = torch.arange(at, at + n, dtype=torch.float64)
        batches.append(torch.stack([i, -i], 1))
        at += n
    fh.collect(writer, batches)
    return fh.ActivationDataset(directory, columns="0/output")


def _ids(items) -> list[int]:
    return [int(x) for item in items for x in item.reshape(-1, 2)[:, 0]]


def test_unshuffled_stream_is_the_store_in_order(tmp_path):
    """shuffle=False, one consumer: rows and batches are exactly `ds[:]`, in order."""
    ds = _numbered(tmp_path, [5, 7, 3], rows_per_shard=4)
    rows = list(fh.ActivationStream(ds, shuffle=False))
    assert torch.equal(torch.stack(rows), ds[:])
    batches = list(fh.ActivationStream(ds, shuffle=False, batch_size=6))
    assert [len(b) for b in batches] == [6, 6, 3] and torch.equal(torch.cat(batches), ds[:])


def _check_split(per_rank: list[list[int]], items: list[int], rows: int, drop_last: bool) -> None:
    """Ranks read the same rows and items; with `drop_last` each row at most once, rows % world of them
    left out; without, every row at least once, rows padded to a multiple of world with the epoch's first."""
    world = len(per_rank)
    assert len(set(items)) == 1, items
    assert len({len(r) for r in per_rank}) == 1, [len(r) for r in per_rank]
    every = sorted(sum(per_rank, []))
    if drop_last:
        assert len(every) == len(set(every)) == rows - rows % world
    else:
        assert set(every) == set(range(rows)) and len(every) == (-(-rows // world) * world if rows else 0)


@hypothesis.settings(deadline=None)
@hypothesis.given(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=5), rows_per_shard=st.integers(1, 6),
                  batch_size=st.one_of(st.none(), st.integers(1, 5)), buffer=st.integers(2, 12),
                  world=st.integers(1, 3), seed=st.integers(0, 3), shuffle=st.booleans(), drop_last=st.booleans())
def test_ranks_read_equal_rows_every_row_once_in_a_seeded_order(sizes, rows_per_shard, batch_size, buffer, world, seed,
                                                                 shuffle, drop_last):
    """Any store, batch size, buffer and world size: every rank yields as many items of as many rows, every row
    exactly once over the ranks but for the padding (`drop_last=False`) or the rows left out (`drop_last=True`),
    fewer than `world_size` of them; and iterating again gives the same order."""
    with tempfile.TemporaryDirectory() as d:
        ds = _numbered(d, sizes, rows_per_shard)
        kw = {"batch_size": batch_size, "buffer": buffer, "seed": seed, "shuffle": shuffle, "world_size": world,
              "drop_last": drop_last}
        items = [list(fh.ActivationStream(ds, rank=r, **kw)) for r in range(world)]
        per_rank = [_ids(i) for i in items]
        _check_split(per_rank, [len(i) for i in items], len(ds), drop_last)
        assert _ids(fh.ActivationStream(ds, rank=0, **kw)) == per_rank[0]


@hypothesis.settings(deadline=None, max_examples=12)
@hypothesis.given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=4), rows_per_shard=st.integers(3, 20),
                  batch_size=st.integers(1, 6), world=st.integers(1, 3), workers=st.integers(0, 2),
                  drop_last=st.booleans())
def test_every_rank_gets_as_many_batches_over_shards_ranks_and_workers(sizes, rows_per_shard, batch_size, world,
                                                                        workers, drop_last):
    """Shard sizes x ranks x DataLoader workers: every rank's loader yields as many batches (DDP would hang
    otherwise), and the rows are split as `drop_last` says."""
    with tempfile.TemporaryDirectory() as d:
        ds = _numbered(d, sizes, rows_per_shard)
        kw = {"batch_size": batch_size, "buffer": 8, "world_size": world, "drop_last": drop_last}
        loaders = [list(torch.utils.data.DataLoader(fh.ActivationStream(ds, rank=r, **kw), batch_size=None,
                                                    num_workers=workers)) for r in range(world)]
        _check_split([_ids(b) for b in loaders], [len(b) for b in loaders], len(ds), drop_last)


def test_two_unequal_shards_over_two_ranks_give_equal_batches(tmp_path):
    """Issue 36: two 10,000-row shards over 2 and 3 ranks gave 16,384 / 3,616 rows (and 16,384 / 1,808 / 1,808)."""
    ds = _numbered(tmp_path, [10_000, 10_000], rows_per_shard=10_000)
    for world, rows in ((2, [10_000, 10_000]), (3, [6_667, 6_667, 6_667])):
        got = [sum(len(b) for b in fh.ActivationStream(ds, batch_size=1000, rank=r, world_size=world))
               for r in range(world)]
        assert got == rows
        batches = [len(list(fh.ActivationStream(ds, batch_size=1000, rank=r, world_size=world))) for r in range(world)]
        assert len(set(batches)) == 1
    dropped = [fh.ActivationStream(ds, batch_size=1000, rank=r, world_size=3, drop_last=True) for r in range(3)]
    assert [s.rows_per_rank for s in dropped] == [6_666] * 3


@hypothesis.settings(deadline=None)
@hypothesis.given(sizes=st.lists(st.integers(1, 9), min_size=1, max_size=5), rows_per_shard=st.integers(1, 6),
                  batch_size=st.one_of(st.none(), st.integers(1, 5)), buffer=st.integers(2, 12),
                  start=st.integers(0, 40), shuffle=st.booleans())
def test_a_resumed_stream_yields_the_rest_of_the_epoch(sizes, rows_per_shard, batch_size, buffer, start, shuffle):
    """`start=k` gives exactly the items after the first k of the same stream, the same tensors."""
    with tempfile.TemporaryDirectory() as d:
        ds = _numbered(d, sizes, rows_per_shard)
        kw = {"batch_size": batch_size, "buffer": buffer, "seed": 1, "shuffle": shuffle}
        full = list(fh.ActivationStream(ds, **kw))
        rest = list(fh.ActivationStream(ds, start=start, **kw))
        assert len(rest) == max(0, len(full) - start)
        assert all(torch.equal(a, b) for a, b in zip(full[start:], rest, strict=True))


def test_shuffling_mixes_shards_and_changes_with_the_epoch(tmp_path):
    """A buffer of several shards mixes their rows in the first batch; another epoch, another order."""
    ds = _numbered(tmp_path, [40] * 5, rows_per_shard=10)
    first = next(iter(fh.ActivationStream(ds, batch_size=10, buffer=60, seed=0)))
    assert len({int(i) // 10 for i in first[:, 0]}) > 2
    orders = [_ids(fh.ActivationStream(ds, batch_size=10, buffer=60, seed=0, epoch=e)) for e in (0, 1)]
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1]) == list(range(200))


def test_dataloader_workers_split_the_rows_and_resume(tmp_path):
    """Two DataLoader workers: every row once; a loader started at k yields what the first yielded after k."""
    ds = _numbered(tmp_path, [9] * 6, rows_per_shard=5)

    def loader(start: int) -> list[torch.Tensor]:
        stream = fh.ActivationStream(ds, batch_size=4, buffer=8, seed=2, start=start)
        return list(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2))

    full = loader(0)
    assert sorted(_ids(full)) == list(range(54))
    rest = loader(5)
    assert len(rest) == len(full) - 5 and all(torch.equal(a, b) for a, b in zip(full[5:], rest, strict=True))


def test_a_bad_argument_is_refused(tmp_path):
    """A one-row buffer and a rank outside the world: a StoreError saying what to pass."""
    ds = _numbered(tmp_path, [3], rows_per_shard=4)
    with pytest.raises(fh.StoreError) as e:
        fh.ActivationStream(ds, buffer=1)
    assert str(e.value) == "ActivationStream: `buffer` is an int >= 2, got 1. Pass one."
    with pytest.raises(fh.StoreError) as e:
        fh.ActivationStream(ds, rank=2, world_size=2)
    assert str(e.value) == (
        "ActivationStream: `rank` is in range(2), got 2. Pass the rank of this process among `world_size`."
    )
