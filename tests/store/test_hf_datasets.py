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


def _exported(tmp_path):
    """Six rows of four values (column `0/output`, rows of shape (4,)), exported."""
    writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tmp_path / "store", fsync=False)
    ds = fh.collect(writer, [torch.arange(24.0).reshape(6, 4)], progress=False)
    return fh.to_hf_dataset(ds, tmp_path / "rows.arrow")


_FIX = ('Clear stale metadata with `hf.info.description = ""` (columns are then read from the rows), or export the '
        "store again with fh.to_hf_dataset.")


def test_rows_a_map_changed_are_refused_not_reshaped(tmp_path):
    """A `map` keeping 2 of the 4 values of each row keeps the description: the 6 rows of 2 are refused (not made
    3 rows of 4); with the stale metadata cleared they come in as 6 rows of 2."""
    hf = _exported(tmp_path).map(lambda row: {"0/output": row["0/output"][:2]})
    with pytest.raises(fh.StoreError) as e:
        fh.from_hf_dataset(hf, tmp_path / "back")
    assert str(e.value) == (
        "from_hf_dataset: the rows of '0/output' hold the shape the metadata in `hf.info.description` gives, (4,) "
        f"(4 values), got 6 rows of shape (2,) from row 0. {_FIX}"
    )
    assert not (tmp_path / "back").exists() or not list((tmp_path / "back").glob("manifest*"))
    hf.info.description = ""
    back = fh.from_hf_dataset(hf, tmp_path / "again")
    assert len(back) == 6 and torch.equal(back[:]["0/output"], torch.arange(24.0).reshape(6, 4)[:, :2].double())


@pytest.mark.parametrize("shape", [[2, 12], [8], [1], [2, 2, 2]])
def test_crafted_shapes_are_refused(tmp_path, shape):
    """Metadata giving rows another shape than the rows have (that would make 24, 3 or 12 rows): a StoreError."""
    import json

    hf = _exported(tmp_path)
    about = json.loads(hf.info.description)
    about["funhooks.activations"]["columns"][0]["shape"] = shape
    hf.info.description = json.dumps(about)
    with pytest.raises(fh.StoreError, match=r"the rows of '0/output' hold the shape the metadata .* got 6 rows of "
                       r"shape \(4,\) from row 0"):
        fh.from_hf_dataset(hf, tmp_path / "back")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda a: 3, "gives its entry as a JSON object, got 3."),
    (lambda a: [a], "gives its entry as a JSON object, got [{"),
    (lambda a: {**a, "columns": 7}, "gives `columns` as a non-empty list of {name, dtype, shape} objects, got 7."),
    (lambda a: {**a, "columns": [5]}, "gives a column as an object with a `name` string, got 5."),
    (lambda a: {**a, "columns": [{**a["columns"][0], "shape": [-4]}]},
     "gives column '0/output' its `shape` as a list of non-negative ints, got [-4]."),
    (lambda a: {**a, "columns": [{**a["columns"][0], "shape": 4}]},
     "gives column '0/output' its `shape` as a list of non-negative ints, got 4."),
    (lambda a: {**a, "columns": [{**a["columns"][0], "dtype": "float31"}]},
     "gives column '0/output' its `dtype` as a torch dtype name such as 'float32', got 'float31'."),
    (lambda a: {**a, "flatten": "yes"}, "gives `flatten` as a bool, got 'yes'."),
    (lambda a: {**a, "specs": 1}, "gives `specs` as a list, got 1."),
])
def test_damaged_metadata_is_a_store_error_naming_the_field(tmp_path, edit, message):
    """Metadata damaged field by field: a StoreError naming the field and the fix, never an AttributeError,
    TypeError, torch's RuntimeError or a bare KeyError."""
    import json

    hf = _exported(tmp_path)
    about = json.loads(hf.info.description)
    hf.info.description = json.dumps({"funhooks.activations": edit(about["funhooks.activations"])})
    with pytest.raises(fh.StoreError) as e:
        fh.from_hf_dataset(hf, tmp_path / "back")
    got = str(e.value)
    assert got.startswith("from_hf_dataset: the metadata in `hf.info.description` ('funhooks.activations') " + message)
    assert got.endswith(_FIX)


def test_a_renamed_column_is_a_store_error_naming_it(tmp_path):
    hf = _exported(tmp_path).rename_column("0/output", "resid")
    with pytest.raises(fh.StoreError) as e:
        fh.from_hf_dataset(hf, tmp_path / "back")
    assert str(e.value) == (
        "from_hf_dataset: the metadata in `hf.info.description` names the dataset's columns, got '0/output', which "
        f"the dataset does not have (it has ['resid']); was a column renamed or removed? {_FIX}"
    )


def test_rows_of_several_lengths_are_a_store_error_naming_the_column(tmp_path):
    import datasets

    hf = datasets.Dataset.from_dict({"x": [[1.0, 2.0], [3.0], [5.0, 6.0]]})
    with pytest.raises(fh.StoreError, match=r"one shape per column, got list rows for 'x' from row 0"):
        fh.from_hf_dataset(hf, tmp_path / "back")
