"""Activation stores, bad input: one-line errors, and committed shards left intact."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from store_helpers import (
    FEATURES,
    Two,
    contents,
    expected_rows,
    feed,
    record_of,
    same_rows,
    writer_for,
)

import funhooks as fh

pytest.importorskip("safetensors")


# -- bad input: one-line errors, committed shards intact ---------------------------------------


def _stream(n: int = 4, rows_per_shard: int = 3) -> dict:
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, FEATURES, generator=gen), torch.arange(2) + 2 * i, None) for i in range(n)]
    return {"batches": batches, "flatten": False, "rows_per_shard": rows_per_shard, "dtype": None}


def test_a_store_continued_with_other_specs_or_options_is_refused(tmp_path):
    """`init` compares the directory's header with the writer's: other specs, `flatten`,
    `dtype` or `rows_per_shard` are one-line errors before anything runs."""
    stream = _stream()
    feed(writer_for(tmp_path, stream), stream)
    cases = {
        "specs": (fh.ActivationWriter(Two(), fh.outputs("a"), tmp_path),
                  "the specs that started it, got [\"outputs('a')\"] for {d}, written with [\"outputs(['a', 'b'])\"]"),
        "dtype": (writer_for(tmp_path, {**stream, "dtype": torch.float16}),
                  "the `dtype` that started it, got 'float16' for {d}, written with None"),
        "rows": (writer_for(tmp_path, {**stream, "rows_per_shard": 5}),
                 "the `rows_per_shard` that started it, got 5 for {d}, written with 3. Pass that, or None."),
    }
    for writer, middle in cases.values():
        with pytest.raises(fh.StoreError) as info:
            writer.init()
        end = "" if middle.endswith("None.") else ". Pass those, or write to a new directory."
        where = middle.format(d=repr(str(tmp_path)))
        assert str(info.value) == f"ActivationWriter: a store is continued with {where}{end}"
    assert same_rows(contents(tmp_path), expected_rows(stream))


def test_another_format_version_is_refused_by_writer_and_reader(tmp_path):
    """A manifest of format version 2 is named, with the release that wrote it."""
    stream = _stream()
    feed(writer_for(tmp_path, stream), stream)
    manifest = tmp_path / "manifest.rank0.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header.update(version=2, versions={**header["versions"], "funhooks": "9.0"})
    manifest.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    for open_it, caller in ((lambda: writer_for(tmp_path, stream).init(), "ActivationWriter"),
                            (lambda: fh.ActivationDataset(tmp_path), "ActivationDataset")):
        with pytest.raises(fh.StoreError) as info:
            open_it()
        assert str(info.value) == (
            f"{caller}: this funhooks reads and writes store format version 1, got version 2 in {str(manifest)!r}. "
            "Read it with the funhooks that wrote it (9.0), or write the store again in a new directory."
        )


def test_shape_or_dtype_changes_between_batches_are_refused(tmp_path):
    """A batch whose column has another row shape or dtype stops the writer with the rule;
    the store keeps what was committed and a fixed restart completes it."""
    stream = _stream(rows_per_shard=2)
    bad = [stream["batches"][0], (torch.randn(2, FEATURES + 1), torch.arange(2), None)]
    writer = writer_for(tmp_path, stream)
    with pytest.raises(fh.StoreError) as info:
        feed(writer, {**stream, "batches": bad})
    assert str(info.value) == (
        "ActivationWriter: every batch gives column 'a/output' float32 rows of shape (3,), got float32 rows of shape "
        "(4,) in batch 1. Give every batch one shape (with flatten=True a row is one position, and a mask drops "
        "padding) and one dtype, or write to a new directory."
    )
    wrong_dtype = [stream["batches"][0], (torch.randn(2, FEATURES, dtype=torch.float64), torch.arange(2), None)]
    with pytest.raises(fh.StoreError, match="got float64 rows of shape \\(3,\\) in batch 1"):
        feed(writer, {**stream, "batches": wrong_dtype})
    assert same_rows(contents(tmp_path), {k: v[:2] for k, v in expected_rows(stream).items()})
    assert same_rows(feed(writer, stream)[:], expected_rows(stream))


def test_a_deleted_shard_is_named_with_the_fix(tmp_path):
    """A shard deleted by hand: reader and writer name it and the fix; cutting the manifest
    as told makes the writer rewrite it, and the later shards, exactly."""
    stream = _stream(n=5)
    feed(writer_for(tmp_path, stream), stream)
    (tmp_path / "shard.rank0.000001.safetensors").unlink()
    for open_it, caller in ((lambda: fh.ActivationDataset(tmp_path), "ActivationDataset"),
                            (lambda: writer_for(tmp_path, stream).init(), "ActivationWriter")):
        with pytest.raises(fh.StoreError) as info:
            open_it()
        assert str(info.value) == (
            f"{caller}: every shard a manifest lists is in the store as written, got 'shard.rank0.000001.safetensors' "
            f"(rank 0, shard 1) missing in {str(tmp_path)!r}. Restore that file, or cut manifest.rank0.jsonl to its "
            "first 2 lines so that a writer rewrites it from batch 1."
        )
    manifest = tmp_path / "manifest.rank0.jsonl"
    manifest.write_text("".join(manifest.read_text().splitlines(keepends=True)[:2]))
    assert same_rows(feed(writer_for(tmp_path, stream), stream)[:], expected_rows(stream))


def test_a_torn_manifest_line_and_stray_files_are_not_part_of_the_store(tmp_path):
    """What a killed writer can leave (half a manifest line, a shard renamed but not listed,
    a temporary) is ignored by the reader and cleaned by the next writer."""
    stream = _stream()
    feed(writer_for(tmp_path, stream), stream)
    want = expected_rows(stream)
    with (tmp_path / "manifest.rank0.jsonl").open("a") as f:
        f.write('{"shard": 3, "file": "shard.rank0.0000')
    (tmp_path / "shard.rank0.000003.safetensors").write_bytes(b"half")
    (tmp_path / ".shard.rank0.000003.safetensors.0a1b2c3d.tmp").write_bytes(b"half")
    assert same_rows(contents(tmp_path), want)
    more = {**stream, "batches": stream["batches"] + _stream(2)["batches"]}
    assert same_rows(feed(writer_for(tmp_path, more), more)[:], expected_rows(more))
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_manifest_that_is_not_a_store_is_named(tmp_path):
    """A manifest whose header is another format, or with an unreadable line, is refused."""
    manifest = tmp_path / "manifest.rank0.jsonl"
    manifest.write_text('{"format": "something.else"}\n')
    with pytest.raises(fh.StoreError) as info:
        fh.ActivationDataset(tmp_path)
    assert str(info.value) == (
        "ActivationDataset: a manifest starts with a header of format 'funhooks.activations', got 'something.else' in "
        f"{str(manifest)!r}. Point to a directory written by fh.ActivationWriter, or move that file away."
    )
    manifest.write_text('{"format": "funhooks.activations", "version": 1}\n[1, 2]\n')
    with pytest.raises(fh.StoreError) as info:
        writer_for(tmp_path, _stream()).init()
    assert str(info.value) == (
        f"ActivationWriter: each line of a manifest is one JSON object, got line 2 of {str(manifest)!r} unreadable "
        "(a JSON list). Restore the file, or write the store again in a new directory."
    )


def test_a_corrupted_shard_is_refused_when_read(tmp_path):
    """A shard of the right size whose bytes were overwritten fails at its first read, named."""
    stream = _stream()
    feed(writer_for(tmp_path, stream), stream)
    shard = tmp_path / "shard.rank0.000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    ds = fh.ActivationDataset(tmp_path)
    assert torch.equal(ds[0]["b/output"], expected_rows(stream)["b/output"][0])  # shard 0 is fine
    with pytest.raises(fh.StoreError) as info:
        ds[3]
    assert str(info.value).startswith("ActivationDataset: a shard holds the rows its manifest line says, got "
                                      "shard.rank0.000001.safetensors unreadable (")
    assert str(info.value).endswith("where the manifest says 3 rows of ['float32 rows of shape (3,)', 'int64 rows of "
                                    "shape ()']. Restore the file, or write the store again.")


def test_a_restarted_batch_with_fewer_rows_is_refused(tmp_path):
    """After a restart, the batch a shard ended in must give at least the rows written of it."""
    stream = _stream(rows_per_shard=3)
    with pytest.raises(RuntimeError):
        feed(writer_for(tmp_path, stream), stream, stop=2)  # shard 0 ends one row into batch 1
    shorter = {**stream, "batches": [stream["batches"][0], (torch.randn(0, FEATURES), torch.arange(0), None)]}
    with pytest.raises(fh.StoreError) as info:
        feed(writer_for(tmp_path, stream), shorter)
    assert str(info.value) == (
        "ActivationWriter: a restarted batch gives the rows it gave before, got 0 rows in batch 1 of which 1 were "
        "written before the restart. Feed the same inputs, or write to a new directory."
    )


def test_complex_columns_are_refused(tmp_path):
    """safetensors has no complex dtype: the error says what to store instead."""
    writer = fh.ActivationWriter(Two(), fh.outputs("a"), tmp_path)
    with pytest.raises(fh.StoreError) as info:
        writer.write(writer.init(), 0, fh.Record({"a": {"output": (torch.zeros(2, 3, dtype=torch.complex64),)}}))
    assert str(info.value) == (
        "ActivationWriter: columns hold bool, integer or floating-point tensors, got torch.complex64 for 'a/output' in "
        "batch 0. Store a real tensor (e.g. `.real` or `.abs()` in an fh.observe spec)."
    )


def test_bad_batches_name_the_column_and_the_rule(tmp_path):
    """A column not recorded, recorded twice or not a tensor; columns of different lengths;
    a mask of another shape; a skipped batch; a stale state: one-line StoreErrors."""
    writer = fh.ActivationWriter(Two(), fh.outputs(["a", "b"]), tmp_path)
    state = writer.init()
    a, b = torch.randn(2, FEATURES), torch.arange(2)
    cases = [
        (fh.Record({"a": {"output": (a,)}}), None, "one (batch, ...) tensor per batch, got 0 calls for 'b/output' in "
         "batch 0. Run the steps with `specs=writer.specs`, and store a tensor (fh.observe(where, fn) can pick one "
         "from a tuple)."),
        (fh.Record({"a": {"output": (a, a)}, "b": {"output": (b,)}}), None, "got 2 calls for 'a/output'"),
        (fh.Record({"a": {"output": ((a,),)}, "b": {"output": (b,)}}), None, "got a tuple for 'a/output'"),
        (record_of(a, torch.arange(3)), None, "the columns of a batch share their leading batch dimensions, got "
         "{'a/output': (2,), 'b/output': (3,)} in batch 0. Write modules with other shapes to another store."),
        (record_of(a, b), torch.ones(3, dtype=torch.bool),
         "a mask has the columns' leading shape (2,), got (3,) in batch 0. Pass a (batch,) mask of the same batch."),
    ]
    for record, mask, message in cases:
        with pytest.raises(fh.StoreError) as info:
            writer.write(state, 0, record, mask=mask)
        assert str(info.value).startswith("ActivationWriter: ") and message in str(info.value)
    with pytest.raises(fh.StoreError) as info:
        writer.write(state, 1, record_of(a, b))
    assert str(info.value) == (
        f"ActivationWriter: batches come in order, each once, got batch 1 where batch 0 was next in {str(tmp_path)!r}. "
        "Feed every batch (a restart feeds them all from the first; the written ones are skipped), or fh.collect the "
        "inputs."
    )
    writer.write(state, 0, record_of(a, b))
    with pytest.raises(fh.StoreError) as info:
        writer.write(state, 1, record_of(a, b))
    assert str(info.value) == (
        "ActivationWriter: a state is used once, each step taking the one the last returned, got a state that is stale "
        "(it was used already). Start again from `writer.init()`: committed shards are kept."
    )
    writer.init()
    with pytest.raises(fh.StoreError, match="stale \\(a later `init\\(\\)` reopened its rank\\)"):
        writer.result(state)


def test_bad_arguments_are_reducer_errors():
    """Writer arguments are checked when it is built, with the rule and a fix."""
    model = Two()
    cases = [
        (dict(specs=fh.edit("a", lambda m, a, o: o)), "`specs` store one value per module call on this rank, got "
         "edit('a', <lambda>). Pass observers such as fh.outputs(...) or fh.observe(...), without `gather=True` (each "
         "rank writes its own rows)."),
        (dict(specs=fh.outputs("a", gather=True)), "got outputs('a', gather=True)."),
        (dict(specs=[]), "`specs` say what to write, got none. Pass e.g. fh.outputs('blocks.*')."),
        (dict(dtype=torch.int8), "`dtype` is a floating-point dtype to cast floating-point columns to, got torch.int8. "
         "Pass torch.bfloat16, torch.float16, torch.float32, or None to keep the recorded dtypes."),
        (dict(rows_per_shard=0), "`rows_per_shard` is a positive int or None, got 0. Pass e.g. 65536, or None for "
         "shards of about 128 MiB."),
        (dict(rank=-1), "`rank` is a non-negative int or None, got -1. Pass None to take torch.distributed's rank (0 "
         "without a process group)."),
        (dict(mask="attention_mask"), "`mask` is a function of a Step or None, got str. Pass e.g. `mask=lambda step: "
         "step.record['embed']['ids'] != PAD`, or give `fh.collect(..., mask=)` a batch key."),
    ]
    for kw, message in cases:
        kw = {"specs": fh.outputs("a"), **kw}
        with pytest.raises(fh.ReducerError) as info:
            fh.ActivationWriter(model, kw.pop("specs"), "unused", **kw)
        assert str(info.value).startswith("ActivationWriter: ") and message in str(info.value)
    with pytest.raises(fh.SelectorError):
        fh.ActivationWriter(model, fh.outputs("c"), "unused")


def test_collect_mask_errors_are_loop_errors(tmp_path):
    """`mask=` names a key of dict batches; a writer's own (Step) mask does not go to collect."""
    model = Two()
    writer = fh.ActivationWriter(model, fh.outputs("a"), tmp_path)
    with pytest.raises(fh.LoopError) as info:
        fh.collect(writer, [torch.randn(2, FEATURES)], mask="attention_mask")
    assert str(info.value) == (
        "collect: `mask='attention_mask'` names a key of every batch, got batch 0 with keys Tensor. Yield dicts "
        "holding it (e.g. a tokenizer's `attention_mask`), or pass `mask=lambda batch: ...`."
    )
    with pytest.raises(fh.LoopError) as info:
        fh.collect(fh.ActivationWriter(model, fh.outputs("a"), tmp_path, mask=lambda step: None), [])
    assert str(info.value).startswith("collect: the rows to keep are `collect(..., mask=)`")


def test_without_safetensors_the_extra_is_named(tmp_path, monkeypatch):
    """Writing and reading need safetensors; without it, ExtraError names `funhooks[store]`."""
    monkeypatch.setitem(sys.modules, "safetensors", None)
    for open_it, caller in ((lambda: fh.ActivationWriter(Two(), fh.outputs("a"), tmp_path).init(), "ActivationWriter"),
                            (lambda: fh.ActivationDataset(tmp_path), "ActivationDataset")):
        with pytest.raises(fh.ExtraError) as info:
            open_it()
        assert str(info.value) == (
            f"{caller}: activation stores are safetensors files, got safetensors not installed. "
            "Install the extra: pip install 'funhooks[store]'."
        )
