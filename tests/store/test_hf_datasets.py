"""Activation stores and Hugging Face datasets: export to Arrow and import back, the same rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")
pytest.importorskip("datasets")


def _store(directory) -> fh.ActivationDataset:
    model = nn.Sequential(nn.Embedding(20, 3))
    ids = fh.observe("0", lambda m, args, out: args[0], name="ids")
    writer = fh.ActivationWriter(model, [ids, fh.outputs("0")], directory, flatten=True, dtype=torch.bfloat16,
                                 rows_per_shard=7, fsync=False)
    gen = torch.Generator().manual_seed(0)
    return fh.collect(writer, [torch.randint(0, 20, (4, 5), generator=gen) for _ in range(3)])


def test_export_and_import_give_back_the_store(tmp_path):
    """Store -> datasets.Dataset -> store: the same columns, dtypes (bfloat16 too) and rows, in order."""
    ds = _store(tmp_path / "store")
    hf = fh.to_hf_dataset(ds, tmp_path / "rows.arrow")
    assert (hf.num_rows, hf.column_names) == (60, ["0/ids", "0/output"])
    assert hf.with_format("torch")[:]["0/ids"].tolist() == ds[:]["0/ids"].tolist()
    back = fh.from_hf_dataset(hf, tmp_path / "back", rows_per_shard=16)
    assert back.columns == ds.columns and back.shards == 4
    assert all(torch.equal(back[:][k], ds[:][k]) for k in ds.columns)
    assert (back.metadata["specs"], back.metadata["model"]) == (ds.metadata["specs"], ds.metadata["model"])


def test_a_plain_hf_dataset_becomes_a_store(tmp_path):
    """A dataset made elsewhere: columns as its rows read, statistics written."""
    import datasets

    hf = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], "y": [0, 1, 0]})
    ds = fh.from_hf_dataset(hf, tmp_path)
    assert ds.columns == {"x": (torch.float32, (2,)), "y": (torch.int64, ())}
    assert ds.stats()["x"].mean.tolist() == [3.0, 4.0]


def test_importing_into_a_store_is_refused(tmp_path):
    """A directory that holds a store: a StoreError, the store unchanged."""
    ds = _store(tmp_path)
    with pytest.raises(fh.StoreError) as e:
        fh.from_hf_dataset(fh.to_hf_dataset(ds, tmp_path / "x.arrow"), tmp_path)
    assert str(e.value) == (
        f"from_hf_dataset: a dataset is imported into a new store, got {str(tmp_path)!r} holding one. "
        "Pass an empty or new directory."
    )
    assert len(fh.ActivationDataset(tmp_path)) == 60
