"""Activation stores, read: `fh.ActivationDataset` random access, batches, DataLoader
workers, pickling, the bounded set of open shards, and the errors of a damaged store."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")

ROWS, BATCH = 4, 6  # rows per shard, rows per batch


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh())


def _xs(n: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(BATCH, 3, generator=gen) for _ in range(n)]


@pytest.fixture
def store(tmp_path) -> tuple[fh.ActivationDataset, dict[str, torch.Tensor]]:
    """A store of 30 rows in 8 shards, and the rows it must hold."""
    model = _model()
    writer = fh.ActivationWriter(model, [fh.outputs("0"), fh.outputs("1")], tmp_path, rows_per_shard=ROWS, fsync=False)
    ds = fh.collect(writer, _xs())
    with torch.no_grad():
        want = {"0/output": torch.cat([model[0](x) for x in _xs()]), "1/output": torch.cat([model(x) for x in _xs()])}
    return ds, want


def test_random_access_returns_the_recorded_rows(store):
    """Ints (negative too), 0-d tensors, slices with steps, lists and tensors of indices
    (a batch has the index's shape)."""
    ds, want = store
    assert isinstance(ds, torch.utils.data.Dataset) and len(ds) == 30 and ds.shards == 8
    for i in (0, 3, 4, 17, 29, -1, -30, torch.tensor(5)):
        row = ds[i]
        assert all(torch.equal(row[k], want[k][int(i)]) for k in want)
    for index in (slice(None), slice(25, 3, -3), [29, 0, 4, 4], torch.tensor([[1, 2], [28, -2]])):
        got = ds[index]
        flat = torch.tensor(list(range(30))[index]) if isinstance(index, slice) else torch.as_tensor(index)
        assert all(torch.equal(got[k], want[k][flat]) for k in want)
    assert ds[[]]["1/output"].shape == (0, 5)


def test_rows_are_copies_not_views_of_the_files(store):
    """Changing a returned row changes nothing in the store."""
    ds, want = store
    ds[7]["0/output"].zero_()
    ds[[7, 8]]["0/output"].zero_()
    assert torch.equal(ds[7]["0/output"], want["0/output"][7])


def test_columns_select_what_a_row_is(store):
    """`columns="name"` gives bare tensors, a list gives dicts of those columns."""
    ds, want = store
    tanh = fh.ActivationDataset(ds.directory, columns="1/output")
    assert torch.equal(tanh[3], want["1/output"][3]) and torch.equal(tanh[1:3], want["1/output"][1:3])
    assert tanh.columns == {"1/output": (torch.float32, (5,))}
    both = fh.ActivationDataset(ds.directory, columns=["1/output", "0/output"])
    assert list(both[0]) == ["1/output", "0/output"]
    with pytest.raises(fh.StoreError) as info:
        fh.ActivationDataset(ds.directory, columns=["1/output", "2/output"])
    assert str(info.value) == (
        "ActivationDataset: `columns` names columns of the store, got ['2/output']; the store has "
        "['0/output', '1/output']. Pick some of those, or pass None for all."
    )


def test_out_of_range_indices_raise_index_error(store):
    """Rows outside range(-len, len) are IndexErrors, so iteration protocols stop cleanly."""
    ds, _ = store
    for index in (30, -31, [0, 30]):
        with pytest.raises(IndexError) as info:
            ds[index]
        assert str(info.value).startswith("ActivationDataset: an index is in range(-30, 30), got ")
    assert len(list(ds)) == 30  # iteration falls back to ds[0], ds[1], ... until IndexError


def test_a_dataloader_with_workers_reads_every_row_once(store):
    """Two worker processes, shuffled batches through `__getitems__`: every row exactly once."""
    ds, want = store
    tanh = fh.ActivationDataset(ds.directory, columns="1/output")
    loader = torch.utils.data.DataLoader(tanh, batch_size=7, shuffle=True, num_workers=2,
                                         generator=torch.Generator().manual_seed(0))
    got = torch.cat(list(loader))
    assert got.shape == (30, 5)
    key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
    assert key(got) == key(want["1/output"])
    ordered = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2)
    assert torch.equal(torch.cat([b["0/output"] for b in ordered]), want["0/output"])


def test_a_dataset_pickles_without_its_open_files(store):
    """A pickled dataset (a spawned worker's copy) reopens shards itself."""
    ds, want = store
    ds[0]
    back = pickle.loads(pickle.dumps(ds))
    assert torch.equal(back[29]["1/output"], want["1/output"][29])


def test_at_most_max_open_shards_stay_mapped(store, monkeypatch):
    """With room for two open shards, reading all eight in any order still gives the rows."""
    ds, want = store
    monkeypatch.setattr(fh.store.dataset, "MAX_OPEN_SHARDS", 2)
    fresh = fh.ActivationDataset(ds.directory)
    order = torch.randperm(30, generator=torch.Generator().manual_seed(1))
    assert torch.equal(fresh[order]["0/output"], want["0/output"][order])
    assert len(fresh._cache) <= 2


def test_a_replaced_shard_is_named(store):
    """A shard file replaced by another of a different size is refused at open, with the fix."""
    ds, _ = store
    shutil.copy(ds.directory / "shard.rank0.000007.safetensors", ds.directory / "shard.rank0.000002.safetensors")
    with pytest.raises(fh.StoreError) as info:
        fh.ActivationDataset(ds.directory)
    size = (ds.directory / "shard.rank0.000002.safetensors").stat().st_size
    assert str(info.value).startswith(
        "ActivationDataset: every shard a manifest lists is in the store as written, got "
        f"'shard.rank0.000002.safetensors' (rank 0, shard 2) {size} bytes where the manifest says "
    )


def test_ranks_that_disagree_are_refused(store, tmp_path_factory):
    """A rank written by other specs, copied in by hand, is named with both manifests."""
    ds, _ = store
    other = tmp_path_factory.mktemp("other")
    writer = fh.ActivationWriter(_model(), fh.outputs("1"), other, rank=1, fsync=False)
    fh.collect(writer, _xs(1))
    for f in other.iterdir():
        shutil.copy(f, ds.directory / f.name)
    with pytest.raises(fh.StoreError) as info:
        fh.ActivationDataset(ds.directory)
    assert str(info.value) == (
        "ActivationDataset: the ranks of a store agree on their columns, got manifest.rank1.jsonl with "
        "[{'name': '1/output', 'dtype': 'float32', 'shape': [5]}] and manifest.rank0.jsonl with "
        "[{'name': '0/output', 'dtype': 'float32', 'shape': [5]}, {'name': '1/output', 'dtype': 'float32', "
        f"'shape': [5]}}] in {str(ds.directory)!r}. Write every rank with one writer, or keep them in separate "
        "directories."
    )


def test_a_directory_without_a_store_is_named(tmp_path):
    """No manifest: the error says what a store directory holds."""
    with pytest.raises(fh.StoreError) as info:
        fh.ActivationDataset(tmp_path / "nothing")
    assert str(info.value) == (
        "ActivationDataset: a store's directory holds a manifest.rank<r>.jsonl per rank, got none with a header in "
        f"{str(tmp_path / 'nothing')!r}. Write one with fh.ActivationWriter or fh.collect, or check the path."
    )


NARROW = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.bfloat16]


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_every_storable_dtype_reads_by_indices_slices_and_dataloader(tmp_path, dtype):
    """float8, unsigned and other columns the writer accepts read back in batches exactly as
    row by row: by a list of indices, a slice, and a DataLoader."""
    values = torch.arange(24).reshape(12, 2) % 7
    writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tmp_path, rows_per_shard=5, fsync=False)
    state = writer.init()
    for i, rows in enumerate(values.to(dtype).split(4)):
        state = writer.write(state, i, fh.Record({"0": {"output": (rows,)}}))
    ds = fh.ActivationDataset(writer.result(state).directory, columns="0/output")
    want = values.to(dtype)
    assert all(torch.equal(ds[i].view(torch.uint8), want[i].view(torch.uint8)) for i in range(12))
    assert torch.equal(ds[[11, 0, 6]].view(torch.uint8), want[[11, 0, 6]].view(torch.uint8))
    assert torch.equal(ds[2:9].view(torch.uint8), want[2:9].view(torch.uint8))
    loaded = torch.cat(list(torch.utils.data.DataLoader(ds, batch_size=5)))
    assert loaded.dtype == dtype and torch.equal(loaded.view(torch.uint8), want.view(torch.uint8))


def test_indices_that_are_not_ints_are_refused(store):
    """A column name says how to read a column; floats, bools and strings are not rounded or
    taken as masks but refused, whether alone, in a list or a tensor."""
    ds, _ = store
    with pytest.raises(TypeError) as info:
        ds["0/output"]
    assert str(info.value) == (
        "ActivationDataset: an index picks rows by position, got '0/output'. To read one column, open the store with "
        "`columns='0/output'`: fh.ActivationDataset(directory, columns='0/output')."
    )
    for index in (1.5, [1.5, 2.0], torch.tensor([0.0, 1.0]), torch.tensor([True, False]), True, ["a"], None):
        with pytest.raises(TypeError) as info:
            ds[index]
        assert str(info.value) == (
            f"ActivationDataset: an index is an int, a slice, or a list or tensor of ints, got {index!r}. "
            "Pass row numbers (int(x) rounds a float towards zero)."
        )
