"""Activation stores and Hugging Face ``datasets``: export to an Arrow-backed
``datasets.Dataset`` and import one back into a store, a chunk at a time.

:func:`to_hf_dataset` writes the store's rows into one Arrow file (the stream format
``datasets`` memory-maps) and opens it with ``datasets.Dataset.from_file``: a column per store
column, of the same name; a row of shape ``()`` is a value, any other a fixed-size list of
its elements (flattened). Arrow has no bfloat16: such columns are exported as float32 (exact)
and come back as bfloat16. The store's metadata (columns with dtypes and shapes, specs,
model) is kept in the dataset's ``info.description`` as JSON, so :func:`from_hf_dataset`
rebuilds the same columns; a dataset from elsewhere gives columns as its rows read.

Costs: memory holds one chunk of :data:`HF_CHUNK_ROWS` rows on either way; disk, one Arrow
copy of the rows (export) or one store (import). Needs the ``hf`` extra (``datasets``) and
``store`` (safetensors).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import platform
import types
from typing import Any

import torch

from funhooks._version import __version__
from funhooks.errors import ExtraError, StoreError

from . import _manifest, _shards, _sink
from .dataset import ActivationDataset, require_safetensors
from .writer import SHARD_BYTES

__all__ = ["HF_CHUNK_ROWS", "from_hf_dataset", "to_hf_dataset"]

HF_CHUNK_ROWS = 4096
"""Rows moved at a time between a store and an Arrow file."""
_META = "funhooks.activations"


def _require(caller: str) -> types.ModuleType:
    if importlib.util.find_spec("datasets") is None:
        raise ExtraError(
            f"{caller}: Hugging Face datasets are made by the `datasets` package, got it not installed. "
            "Install the extra: pip install 'funhooks[hf]'."
        )
    import datasets

    return datasets


def _arrow_dtype(dtype: torch.dtype) -> str:
    return "float32" if dtype == torch.bfloat16 else _shards.dtype_name(dtype)


def to_hf_dataset(dataset: ActivationDataset, path: str | os.PathLike[str] | None = None) -> Any:
    """The rows of `dataset` as a ``datasets.Dataset``, written to an Arrow file chunk by chunk.

    Args:
        dataset: the store (its `columns` choice is kept).
        path: the Arrow file to write; None: ``hf.arrow`` in the store's directory.

    Returns:
        A ``datasets.Dataset`` memory-mapping `path`.

    Raises:
        ExtraError: without ``datasets`` (``funhooks[hf]``).

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tempfile.mkdtemp())
        >>> ds = fh.collect(writer, [torch.ones(3, 2)])
        >>> hf = fh.to_hf_dataset(ds)
        >>> hf.num_rows, hf[0]
        (3, {'0/output': [1.0, 1.0]})
    """
    datasets = _require("to_hf_dataset")
    import pyarrow as pa

    columns = dataset.columns
    features = datasets.Features({
        name: datasets.Value(_arrow_dtype(dtype)) if not shape else
        datasets.List(datasets.Value(_arrow_dtype(dtype)), length=math.prod(shape))
        for name, (dtype, shape) in columns.items()})
    about = {"columns": [{"name": n, "dtype": _shards.dtype_name(d), "shape": list(s)} for n, (d, s) in columns.items()],
             **{k: dataset.metadata.get(k) for k in ("specs", "model", "modules", "flatten", "dtype")}}
    info = datasets.DatasetInfo(description=json.dumps({_META: about}), features=features)
    target = pathlib.Path(os.fspath(path)) if path is not None else dataset.directory / "hf.arrow"
    schema = features.arrow_schema
    with pa.OSFile(str(target), "wb") as sink, pa.ipc.new_stream(sink, schema) as out:
        for start in range(0, len(dataset), HF_CHUNK_ROWS):
            got = dataset[start:start + HF_CHUNK_ROWS]
            got = got if isinstance(got, dict) else {next(iter(columns)): got}
            arrays = []
            for name, (dtype, shape) in columns.items():
                t = got[name].float() if dtype == torch.bfloat16 else got[name]
                flat = pa.array(t.reshape(-1).numpy())
                arrays.append(pa.FixedSizeListArray.from_arrays(flat, math.prod(shape)) if shape else flat)
            out.write_batch(pa.record_batch(arrays, schema=schema))
    return datasets.Dataset.from_file(str(target), info=info)


_FIX = ('Clear stale metadata with `hf.info.description = ""` (columns are then read from the rows), '
        "or export the store again with fh.to_hf_dataset.")
_FIELDS: dict[str, tuple[tuple[type, ...], str]] = {
    "specs": ((list,), "a list"), "model": ((str,), "a string"), "modules": ((list,), "a list"),
    "flatten": ((bool,), "a bool"), "dtype": ((str, type(None)), "a dtype name or null")}
"""The header fields the metadata carries, besides its columns, and their JSON types."""


def _damaged(field: str, rule: str, got: object) -> StoreError:
    return StoreError(
        f"from_hf_dataset: the metadata in `hf.info.description` ({_META!r}) gives {field} {rule}, got {got!r:.80}. "
        + _FIX
    )


def _about(hf: Any) -> dict[str, Any]:
    """The metadata :func:`to_hf_dataset` left in `hf`'s description (``{}`` for a description
    of something else); a StoreError for a damaged one."""
    try:
        described = json.loads(hf.info.description or "{}")
    except (ValueError, TypeError, AttributeError):
        return {}
    if not isinstance(described, dict) or _META not in described:
        return {}
    about = described[_META]
    if not isinstance(about, dict):
        raise _damaged("its entry", "as a JSON object", about)
    for field, (kinds, what) in _FIELDS.items():
        if field in about and not isinstance(about[field], kinds):
            raise _damaged(f"`{field}`", f"as {what}", about[field])
    return about


def _described_columns(described: object, names: list[str]) -> list[_shards.Column]:
    """The columns the metadata names, each checked field by field against the dataset's columns."""
    if not isinstance(described, list) or not described:
        raise _damaged("`columns`", "as a non-empty list of {name, dtype, shape} objects", described)
    columns = []
    for entry in described:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            raise _damaged("a column", "as an object with a `name` string", entry)
        dtype = getattr(torch, str(entry.get("dtype")), None)
        if not isinstance(dtype, torch.dtype) or not _shards.is_storable(dtype):
            raise _damaged(f"column {name!r} its `dtype`", "as a torch dtype name such as 'float32'", entry.get("dtype"))
        shape = entry.get("shape")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise _damaged(f"column {name!r} its `shape`", "as a list of non-negative ints", shape)
        if name not in names:
            raise StoreError(
                f"from_hf_dataset: the metadata in `hf.info.description` names the dataset's columns, got {name!r}, "
                f"which the dataset does not have (it has {names}); was a column renamed or removed? " + _FIX
            )
        columns.append(_shards.Column(name, dtype, tuple(shape)))
    extra = [n for n in names if n not in {c.name for c in columns}]
    if extra:
        raise StoreError(
            f"from_hf_dataset: the metadata in `hf.info.description` names every column of the dataset, got {extra} "
            f"not among them (it names {[c.name for c in columns]}); was a column added or renamed? " + _FIX
        )
    return columns


def _tensor(name: str, t: object, start: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise StoreError(
            f"from_hf_dataset: a column's rows are numbers or fixed-length lists of them, one shape per column, got "
            f"{type(t).__name__} rows for {name!r} from row {start}. Make every row of {name!r} one length, or drop it."
        )
    return t


def _rows_of(column: _shards.Column, got: Any, start: int, n: int) -> torch.Tensor:
    """The `n` rows of `column` read from row `start`, in the column's row shape; a StoreError
    for rows that do not match it (never reshaped into other rows)."""
    t = _tensor(column.name, got[column.name], start)
    width = math.prod(column.shape)
    fits = t.shape[:1] == (n,) and (tuple(t.shape[1:]) in {column.shape, (width,)} if column.shape else t.dim() == 1)
    if not fits:
        raise StoreError(
            f"from_hf_dataset: the rows of {column.name!r} hold the shape the metadata in `hf.info.description` gives, "
            f"{column.shape} ({width} values), got {n} rows of shape {tuple(t.shape[1:])} from row {start}. " + _FIX
        )
    return t.reshape(n, *column.shape)


def from_hf_dataset(hf: Any, directory: str | os.PathLike[str], *, rows_per_shard: int | None = None,
                    fsync: bool = True) -> ActivationDataset:
    """A new store in `directory` holding the rows of a ``datasets.Dataset``, chunk by chunk.

    Columns, dtypes and row shapes come from the metadata :func:`to_hf_dataset` left in
    ``hf.info.description``, or else from the rows as ``with_format("torch")`` reads them.

    Args:
        hf: a ``datasets.Dataset`` of numeric columns with one shape per column.
        directory: where the store is written (it must hold no store yet).
        rows_per_shard: rows per shard; None: shards of about 128 MiB.
        fsync: as for :class:`~funhooks.ActivationWriter`.

    An import that fails leaves no store in `directory`. Rows that do not match the metadata
    are refused, not reshaped: after a ``map`` that
    changed a column's rows (``map`` keeps ``info.description``), clear the stale metadata
    (``hf.info.description = ""``) to import the columns as the rows read, or export the
    store again.

    Raises:
        StoreError: for a directory that holds a store, an empty dataset, damaged metadata
            (naming the field), or rows that do not match their column's metadata or one
            shape (naming the column).
        ExtraError: without ``datasets`` (``funhooks[hf]``) or safetensors (``funhooks[store]``).

    Example:
        >>> import tempfile, torch, funhooks as fh
        >>> from torch import nn
        >>> writer = fh.ActivationWriter(nn.Sequential(nn.Identity()), fh.outputs("0"), tempfile.mkdtemp(),
        ...                              dtype=torch.bfloat16)
        >>> ds = fh.collect(writer, [torch.randn(5, 2, 3)])
        >>> back = fh.from_hf_dataset(fh.to_hf_dataset(ds), tempfile.mkdtemp())
        >>> back.columns, torch.equal(back[:]["0/output"], ds[:]["0/output"])
        ({'0/output': (torch.bfloat16, (2, 3))}, True)
    """
    _require("from_hf_dataset")
    safetensors = require_safetensors("from_hf_dataset")
    target = pathlib.Path(os.fspath(directory))
    if _manifest.ranks_in(target):
        raise StoreError(
            f"from_hf_dataset: a dataset is imported into a new store, got {str(target)!r} holding one. "
            "Pass an empty or new directory."
        )
    if not len(hf):
        raise StoreError("from_hf_dataset: a store holds rows, got a dataset of 0 rows. Pass a non-empty dataset.")
    about = _about(hf)
    rows = hf.with_format("torch")
    if about.get("columns") is not None:
        columns = _described_columns(about["columns"], list(hf.column_names))
    else:
        first = rows[:1]
        columns = [_shards.Column(n, _tensor(n, t, 0).dtype, t.shape[1:]) for n, t in first.items()]
    capacity = rows_per_shard or max(1, SHARD_BYTES // max(1, sum(c.row_bytes for c in columns)))
    header = {
        "format": _manifest.FORMAT, "version": _manifest.FORMAT_VERSION, "rank": 0,
        "columns": [c.to_json() for c in columns], "specs": about.get("specs", []),
        "model": about.get("model", "datasets.Dataset"), "modules": about.get("modules", []),
        "flatten": about.get("flatten", False), "masked": False, "dtype": about.get("dtype"),
        "rows_per_shard": capacity,
        "versions": {"funhooks": __version__, "torch": torch.__version__, "safetensors": safetensors.__version__,
                     "python": platform.python_version()},
    }
    sink = _sink.Sink(target, 0, fsync=fsync)
    try:
        sink.start(header, columns)
        chunks = range(0, len(hf), HF_CHUNK_ROWS)
        for i, start in enumerate(chunks):
            got = rows[start:start + HF_CHUNK_ROWS]
            n = min(HF_CHUNK_ROWS, len(hf) - start)
            sink.append({c.name: _rows_of(c, got, start, n).to(c.dtype).contiguous() for c in columns}, i, 0)
        sink.flush(len(chunks))
    except BaseException:  # the directory held no store: leave none, so that the import can be run again
        sink.close()
        for made in [_manifest.manifest_path(target, 0), *_shards.rank_files(target, 0)]:
            made.unlink(missing_ok=True)
        raise
    finally:
        sink.close()
    return ActivationDataset(target)
