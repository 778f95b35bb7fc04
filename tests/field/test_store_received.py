"""Activation stores received from others: manifests that point outside the store or are
damaged, shards swapped or rotted, and directories that are files."""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import zlib

import hypothesis
import pytest
import torch
from hypothesis import strategies as st
from store_helpers import (
    FEATURES,
    Two,
    expected_rows,
    feed,
    record_of,
    same_rows,
    writer_for,
)

import funhooks as fh

pytest.importorskip("safetensors")

FIX = "Restore the manifest, or write the store again in a new directory."


def _stream(n: int = 4) -> dict:
    """Batches of 2 rows, shards of 2 rows: every shard is full, so all have one size."""
    gen = torch.Generator().manual_seed(4)
    batches = [(torch.randn(2, FEATURES, generator=gen), torch.arange(2) + 2 * i, None) for i in range(n)]
    return {"batches": batches, "flatten": False, "rows_per_shard": 2, "dtype": None}


def _store(directory) -> dict:
    stream = _stream()
    feed(writer_for(directory, stream), stream)
    return stream


def _lines(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "manifest.rank0.jsonl").read_text().splitlines()]


def _rewrite(directory, lines: list[dict]) -> None:
    (directory / "manifest.rank0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def _refused(directory, stream: dict) -> list[str]:
    """The messages of the reader and of a resuming writer, which must both refuse."""
    messages = []
    for open_it in (lambda: fh.ActivationDataset(directory), lambda: writer_for(directory, stream).init()):
        with pytest.raises(fh.StoreError) as info:
            open_it()
        messages.append(str(info.value))
    return messages


# -- item 1: nothing outside the store is opened -------------------------------------------------


def test_a_manifest_line_naming_a_file_outside_the_store_is_refused(tmp_path):
    """`"file"` is the plain name the writer gives that shard: a path out of the store (even
    to a file of the listed size), an absolute path, a subfolder or another shard's name is
    refused by reader and writer, before any shard is opened."""
    directory = tmp_path / "store"
    stream = _store(directory)
    secret = tmp_path / "secret.safetensors"
    shutil.copy(directory / "shard.rank0.000000.safetensors", secret)  # same size as shard 1
    lines = _lines(directory)
    manifest = directory / "manifest.rank0.jsonl"
    for name in ("../secret.safetensors", str(secret), "sub/shard.rank0.000001.safetensors",
                 "shard.rank0.000000.safetensors", "shard.rank0.1.safetensors"):
        _rewrite(directory, [*lines[:2], {**lines[2], "file": name}, *lines[3:]])
        for message, caller in zip(_refused(directory, stream), ("ActivationDataset", "ActivationWriter"), strict=True):
            assert message == (
                f"{caller}: each shard line names its file as the writer does, 'shard.rank0.000001.safetensors' "
                f"here, got `file` {name!r} on line 3 of {str(manifest)!r}. {FIX}"
            )
    _rewrite(directory, lines)
    assert same_rows(fh.ActivationDataset(directory)[:], expected_rows(stream))


def test_a_shard_or_manifest_that_is_a_link_is_refused(tmp_path):
    """A listed shard that is a symbolic link (to a file outside of the store) is refused at
    open, as is a manifest that is a link."""
    directory = tmp_path / "store"
    stream = _store(directory)
    shard = directory / "shard.rank0.000001.safetensors"
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    for message, caller in zip(_refused(directory, stream), ("ActivationDataset", "ActivationWriter"), strict=True):
        assert message == (
            f"{caller}: every shard a manifest lists is in the store as written, got 'shard.rank0.000001.safetensors' "
            f"(rank 0, shard 1) a symbolic link in {str(directory)!r}. Restore that file, or cut manifest.rank0.jsonl "
            "to its first 2 lines so that a writer rewrites it from batch 1."
        )
    shard.unlink()
    outside.rename(shard)
    manifest = directory / "manifest.rank0.jsonl"
    manifest.rename(tmp_path / "manifest.jsonl")
    manifest.symlink_to(tmp_path / "manifest.jsonl")
    for message, caller in zip(_refused(directory, stream), ("ActivationDataset", "ActivationWriter"), strict=True):
        assert message == (
            f"{caller}: a store's files are regular files in its directory, got {str(manifest)!r}, a symbolic link. "
            "Copy the file it points to in its place, or write the store again in a new directory."
        )


# -- item 2: shards checked by their own metadata and a checksum --------------------------------


def test_swapped_shards_are_refused_when_read_and_by_verify(tmp_path):
    """Two shards of one size swapped by hand: their own rank/index metadata disagrees with
    the manifest, so the first read of either, and `verify()`, name the file."""
    stream = _store(tmp_path)
    one, two = tmp_path / "shard.rank0.000001.safetensors", tmp_path / "shard.rank0.000002.safetensors"
    one.rename(tmp_path / "swap")
    two.rename(one)
    (tmp_path / "swap").rename(two)
    ds = fh.ActivationDataset(tmp_path)
    assert same_rows(ds[:2], {k: v[:2] for k, v in expected_rows(stream).items()})  # shard 0 is fine
    message = (
        "ActivationDataset: a shard file holds the shard its manifest line lists, got shard.rank0.000001.safetensors "
        "holding rank 0 shard 2 where the manifest lists rank 0 shard 1. Put the file back under its name, or write "
        "the store again."
    )
    for read in (lambda: ds[2], lambda: ds[[0, 3]], ds.verify):
        with pytest.raises(fh.StoreError) as info:
            read()
        assert str(info.value) == message


def _regions(path: pathlib.Path) -> dict[str, int]:
    """The CRC-32 of each region of a shard file, read from its safetensors header."""
    data = path.read_bytes()
    size = 8 + int.from_bytes(data[:8], "little")
    header = json.loads(data[8:size])
    return {"header": zlib.crc32(data[:size]),
            **{name: zlib.crc32(data[size + t["data_offsets"][0]:size + t["data_offsets"][1]])
               for name, t in header.items() if name != "__metadata__"}}


def test_bit_rot_inside_a_shard_is_found_by_verify(tmp_path):
    """Each manifest line records the CRC-32 of each region of its shard (header, then each
    column's bytes), taken while writing; `verify()` reads every shard and names the one
    whose bytes changed, and the column (opening stays cheap and does not read them)."""
    stream = _store(tmp_path)
    for line in _lines(tmp_path)[1:]:
        assert line["crc32s"] == _regions(tmp_path / line["file"]) and "crc32" not in line
    assert fh.ActivationDataset(tmp_path).verify() is None
    shard = tmp_path / "shard.rank0.000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10  # one bit of the last row of the float32 column, last in the file (widest dtypes first)
    shard.write_bytes(bytes(data))
    ds = fh.ActivationDataset(tmp_path)
    assert len(ds) == len(expected_rows(stream)["a/output"])
    with pytest.raises(fh.StoreError) as info:
        ds.verify()
    want, got = _lines(tmp_path)[2]["crc32s"]["a/output"], _regions(shard)["a/output"]
    assert str(info.value) == (
        f"ActivationDataset: a shard's bytes have the CRC-32 its manifest line records, got "
        f"shard.rank0.000001.safetensors (column 'a/output') with {got:#010x} where the manifest says {want:#010x}. "
        "Restore the file, or write the store again."
    )


def test_a_shorter_last_shard_has_the_crc32s_of_its_compacted_regions(tmp_path):
    """The last shard of a run holds fewer rows than `rows_per_shard`, so its columns move
    and its header shrinks when it is finished: its checksums are still those of its bytes."""
    stream = {**_stream(3), "rows_per_shard": 4}
    ds = feed(writer_for(tmp_path, stream), stream)
    lines = _lines(tmp_path)[1:]
    assert [line["rows"] for line in lines] == [4, 2]
    assert [line["crc32s"] for line in lines] == [_regions(tmp_path / line["file"]) for line in lines]
    assert ds.verify() is None


def test_stores_with_one_whole_file_crc32_still_verify(tmp_path):
    """Stores written with one `crc32` per shard line (the whole file's) verify as before."""
    _store(tmp_path)
    lines = _lines(tmp_path)
    old = [{**{k: v for k, v in line.items() if k != "crc32s"}, "crc32": zlib.crc32((tmp_path / line["file"]).read_bytes())}
           for line in lines[1:]]
    _rewrite(tmp_path, [lines[0], *old])
    assert fh.ActivationDataset(tmp_path).verify() is None
    shard = tmp_path / "shard.rank0.000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x10
    shard.write_bytes(bytes(data))
    with pytest.raises(fh.StoreError) as info:
        fh.ActivationDataset(tmp_path).verify()
    assert str(info.value) == (
        f"ActivationDataset: a shard's bytes have the CRC-32 its manifest line records, got "
        f"shard.rank0.000001.safetensors with {zlib.crc32(bytes(data)):#010x} where the manifest says "
        f"{old[1]['crc32']:#010x}. Restore the file, or write the store again."
    )


def test_manifests_without_checksums_still_open_read_and_verify(tmp_path):
    """Stores written before checksums: they open and read; `verify()` checks their layout."""
    stream = _store(tmp_path)
    lines = _lines(tmp_path)
    _rewrite(tmp_path, [lines[0], *({k: v for k, v in line.items() if k != "crc32s"} for line in lines[1:])])
    ds = fh.ActivationDataset(tmp_path)
    assert ds.verify() is None
    assert same_rows(ds[:], expected_rows(stream))
    more = {**stream, "batches": stream["batches"] + _stream(2)["batches"]}
    assert same_rows(feed(writer_for(tmp_path, more), more)[:], expected_rows(more))


# -- item 10: damaged or crafted manifests --------------------------------------------------------

DAMAGE = [
    (1, lambda h: h.pop("rank"), "a manifest's header gives the `rank` of its file name, 0, got no `rank` on line 1"),
    (1, lambda h: h.update(rank="0"), "got `rank` '0' on line 1"),
    (1, lambda h: h.update(rank=1), "got `rank` 1 on line 1"),
    (1, lambda h: h.pop("columns"), ("a manifest's header gives `columns`, a non-empty list of {name, dtype, shape} "
     "objects, got no `columns` on line 1")),
    (1, lambda h: h.update(columns={}), "got `columns` {} on line 1"),
    (1, lambda h: h["columns"][0].update(shape=[-2]), ("a column's `shape` is a list of non-negative ints, one row "
     "under 2**63 bytes, got `columns[0].shape` [-2] on line 1")),
    (1, lambda h: h["columns"][0].update(shape=[2**40, 2**40]), ("got `columns[0].shape` [1099511627776, "
     "1099511627776] on line 1")),
    (1, lambda h: h["columns"][1].update(dtype="complex64"), ("a column's `dtype` names a dtype a store holds (bool, "
     "an int or a float type), got `columns[1].dtype` 'complex64' on line 1")),
    (1, lambda h: h["columns"][1].pop("name"), "a column's `name` is a string, got no `columns[1].name` on line 1"),
    (1, lambda h: h.update(rows_per_shard=0), ("a manifest's header gives `rows_per_shard`, a positive int, got "
     "`rows_per_shard` 0 on line 1")),
    (2, lambda s: s.pop("file"), ("each shard line names its file as the writer does, "
     "'shard.rank0.000000.safetensors' here, got no `file` on line 2")),
    (2, lambda s: s.update(file=5), "got `file` 5 on line 2"),
    (3, lambda s: s.update(shard=0), "each shard line gives its place `shard`, 1 here, got `shard` 0 on line 3"),
    (2, lambda s: s.update(rows="2"), "each shard line gives its `rows`, a positive int, got `rows` '2' on line 2"),
    (2, lambda s: s.update(rows=-3), "got `rows` -3 on line 2"),
    (2, lambda s: s.update(rows=10**12), ("each shard line gives its `bytes`, at least the 20000000000008 its rows "
     "take, got `bytes`")),
    (2, lambda s: s.update(bytes=None), "got `bytes` None on line 2"),
    (2, lambda s: s.update(end=[1]), ("each shard line gives its `end`, [batch, row] as two non-negative ints, got "
     "`end` [1] on line 2")),
    (2, lambda s: s.update(crc32=-1), ("each shard line gives its `crc32`, if any, as an int in range(2**32), got "
     "`crc32` -1 on line 2")),
    (2, lambda s: s["crc32s"].pop("header"), ("each shard line gives its `crc32s`, if any, as an int in range(2**32) "
     "for each of ['header', 'a/output', 'b/output'], got `crc32s` {")),
    (3, lambda s: s["crc32s"].update(header=1 << 32), "got `crc32s` {'header': 4294967296"),
]


@pytest.mark.parametrize(("line", "damage", "message"), DAMAGE)
def test_a_damaged_manifest_names_the_file_and_the_field(tmp_path, line, damage, message):
    """Missing fields, fields of the wrong type, negative or huge rows and shapes: reader and
    writer raise a StoreError naming the manifest, the line and the field."""
    stream = _store(tmp_path)
    lines = _lines(tmp_path)
    damage(lines[line - 1])
    _rewrite(tmp_path, lines)
    manifest = str(tmp_path / "manifest.rank0.jsonl")
    for got, caller in zip(_refused(tmp_path, stream), ("ActivationDataset", "ActivationWriter"), strict=True):
        assert got.startswith(f"{caller}: ") and message in got, got
        assert got.endswith(f" of {manifest!r}. {FIX}")


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2**70) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=6)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One store, copied by each example (writing one per example would be slower)."""
    directory = tmp_path_factory.mktemp("pristine")
    _store(directory)
    return directory


@hypothesis.given(line=st.integers(0, 4), data=st.data())
def test_any_damaged_field_is_a_store_error_or_harmless(pristine, line, data):
    """Whatever JSON value replaces (or drops) a field of any manifest line, opening, reading
    and continuing the store either work or raise StoreError, never another exception."""
    with tempfile.TemporaryDirectory() as d:
        directory = pathlib.Path(shutil.copytree(pristine, f"{d}/store"))
        lines = _lines(directory)
        target = lines[line]
        key = data.draw(st.sampled_from(sorted(target)))
        if data.draw(st.booleans()):
            del target[key]
        else:
            target[key] = data.draw(JSON)
        _rewrite(directory, lines)
        try:
            fh.ActivationDataset(directory).verify()
        except fh.StoreError:
            pass
        try:
            writer_for(directory, _stream()).init().sink.close()
        except fh.StoreError:
            pass


# -- item 11: a file as the store's directory ------------------------------------------------------


def test_a_file_given_as_the_store_directory_is_refused(tmp_path):
    """A writer pointed at a file says so, instead of mkdir's FileExistsError; the file stays."""
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    writer = fh.ActivationWriter(Two(), fh.outputs("a"), path)
    with pytest.raises(fh.StoreError) as info:
        writer.init()
    assert str(info.value) == (
        f"ActivationWriter: a store is a directory (created if needed), got {str(path)!r}, a file. Pass the path of "
        "a directory, or of nothing yet."
    )
    with pytest.raises(fh.StoreError, match=f"got {str(path / 'sub')!r}, which cannot be made \\(Not a directory\\)"):
        fh.ActivationWriter(Two(), fh.outputs("a"), path / "sub").init()
    assert path.read_text() == "mine"


def test_a_sparse_column_is_refused(tmp_path):
    """A sparse output is named with the fix, instead of torch's "unsupported memory format"."""
    writer = fh.ActivationWriter(Two(), fh.outputs(["a", "b"]), tmp_path)
    sparse = torch.eye(2, FEATURES).to_sparse()
    with pytest.raises(fh.StoreError) as info:
        writer.write(writer.init(), 0, record_of(sparse, torch.arange(2)))
    assert str(info.value) == (
        "ActivationWriter: columns hold dense (strided) tensors, got a torch.sparse_coo tensor for 'a/output' in "
        "batch 0. Store a dense one (e.g. `.to_dense()` in an fh.observe spec)."
    )
