"""Activation stores, written: `fh.ActivationWriter` as a reducer and a sink, `fh.collect`.

What the tests pin: the rows read back are exactly the rows recorded (cast, flattened,
masked), whatever the shard size; an interruption anywhere (exception, KeyboardInterrupt,
SIGKILL, a failing disk) followed by a restart gives the same store as one uninterrupted
run; bad input gives one-line errors and leaves committed shards intact.

Subprocess scenarios (a killed writer, a full disk simulated with RLIMIT_FSIZE, two gloo
ranks) run this file as a script, each bounded by a timeout.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

CHILD_TIMEOUT_S = 120
COLLECTIVE_TIMEOUT_S = 60
FEATURES, VOCAB = 3, 20


class Two(nn.Module):
    """Modules `a` (features) and `b`, whose hand-built records give the columns."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(FEATURES, FEATURES), nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@st.composite
def streams(draw: st.DrawFn) -> dict:
    """A stream of batches: float column `a/output`, int column `b/output`, optional mask."""
    flatten, masked = draw(st.booleans()), draw(st.booleans())
    positions = draw(st.integers(1, 4)) if flatten else None
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    batches = []
    for _ in range(draw(st.integers(1, 6))):
        lead = (draw(st.integers(0, 4)),) + ((positions,) if flatten else ())
        a = torch.randn(*lead, FEATURES, generator=gen)
        b = torch.randint(0, VOCAB, lead, generator=gen)
        mask = torch.rand(lead, generator=gen) < 0.7 if masked else None
        batches.append((a, b, mask))
    return {"batches": batches, "flatten": flatten, "rows_per_shard": draw(st.integers(1, 7)),
            "dtype": draw(st.sampled_from([None, torch.bfloat16, torch.float16]))}


def _record(a: torch.Tensor, b: torch.Tensor) -> fh.Record:
    return fh.Record({"a": {"output": (a,)}, "b": {"output": (b,)}})


def _expected(stream: dict) -> dict[str, torch.Tensor]:
    """The rows the store must hold: flattened, masked, floats cast."""
    cols: dict[str, list[torch.Tensor]] = {"a/output": [], "b/output": []}
    for a, b, mask in stream["batches"]:
        if stream["flatten"]:
            a, b, mask = a.flatten(0, 1), b.flatten(0, 1), None if mask is None else mask.flatten(0, 1)
        if mask is not None:
            a, b = a[mask], b[mask]
        cols["a/output"].append(a if stream["dtype"] is None else a.to(stream["dtype"]))
        cols["b/output"].append(b)
    return {k: torch.cat(v) for k, v in cols.items()}


def _writer(directory, stream: dict, **kw) -> fh.ActivationWriter:
    return fh.ActivationWriter(Two(), fh.outputs(["a", "b"]), directory, flatten=stream["flatten"],
                               dtype=stream["dtype"], rows_per_shard=stream["rows_per_shard"], fsync=False, **kw)


def _feed(writer: fh.ActivationWriter, stream: dict, stop: int | None = None) -> fh.ActivationDataset | None:
    """Write the stream's batches; stop with an exception before batch `stop`."""
    state = writer.init()
    for i, (a, b, mask) in enumerate(stream["batches"]):
        if i == stop:
            raise RuntimeError("interrupted")
        state = writer.write(state, i, _record(a, b), mask=mask)
    return writer.result(state)


def _contents(directory) -> dict[str, torch.Tensor]:
    ds = fh.ActivationDataset(directory)
    return ds[:] if len(ds) else {}


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


# -- the rows read back are the rows recorded --------------------------------------------------


@hypothesis.given(stream=streams())
def test_rows_read_back_are_the_rows_recorded(stream):
    """Any stream, shard size, mask and cast: the dataset and the raw safetensors files hold
    exactly the recorded rows, in order."""
    with tempfile.TemporaryDirectory() as d:
        want = _expected(stream)
        ds = _feed(_writer(d, stream), stream)
        assert len(ds) == len(want["a/output"])
        assert _equal(ds[:], want)
        files = sorted(pathlib.Path(d).glob("shard.rank0.*.safetensors"))
        assert len(files) == ds.shards
        if files:
            raw = [load_file(f) for f in files]
            assert _equal({k: torch.cat([r[k] for r in raw]) for k in want}, want)
            assert all(len(r["a/output"]) == stream["rows_per_shard"] for r in raw[:-1])


@hypothesis.given(stream=streams(), stops=st.lists(st.integers(0, 6), max_size=3))
def test_interrupted_writes_resume_to_the_same_store(stream, stops):
    """Exceptions before any batches, then a restart: the same rows as one run, none twice,
    none lost; after each interruption the store holds a prefix of them."""
    want = _expected(stream)
    with tempfile.TemporaryDirectory() as d:
        for stop in stops:
            if stop < len(stream["batches"]):
                with pytest.raises(RuntimeError, match="interrupted"):
                    _feed(_writer(d, stream), stream, stop=stop)
                got = _contents(d) if (pathlib.Path(d) / "manifest.rank0.jsonl").exists() else {}
                if got:
                    n = len(got["a/output"])
                    assert _equal(got, {k: v[:n] for k, v in want.items()})
        assert _equal(_feed(_writer(d, stream), stream)[:], want)
        assert not [p for p in pathlib.Path(d).iterdir() if p.name.endswith(".tmp")]


# -- steps: evaluate, train, fit ----------------------------------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _inputs(n: int = 7, batch: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 4, generator=gen) for _ in range(n)]


def _interrupting(batches, at: int, exc: BaseException):
    for i, b in enumerate(batches):
        if i == at:
            raise exc
        yield b


def test_fold_over_evaluate_resumes_after_keyboard_interrupt(tmp_path):
    """A KeyboardInterrupt mid-evaluation, then the same fold again: the rows of one run."""
    model, xs = _model(), _inputs()
    writer = fh.ActivationWriter(model, fh.outputs("1"), tmp_path, rows_per_shard=8)
    with pytest.raises(KeyboardInterrupt):
        fh.fold(writer, fh.evaluate(model, _interrupting(xs, 4, KeyboardInterrupt()), specs=writer.specs))
    fh.testing.assert_no_hooks(model)
    assert len(fh.ActivationDataset(tmp_path)) == 16  # two full shards were committed before batch 4
    ds = fh.fold(writer, fh.evaluate(model, xs, specs=writer.specs))
    with torch.no_grad():
        want = torch.cat([model[:2](x) for x in xs])
    assert torch.equal(ds[:]["1/output"], want)
    assert ds.metadata["model"] == "torch.nn.modules.container.Sequential"
    assert ds.metadata["modules"] == ["1"] and ds.metadata["specs"] == ["outputs('1')"]


def test_train_steps_and_fit_write_every_step(tmp_path):
    """Steps of `fh.train` over two epochs are batches 0..2n-1; under `fh.fit` the writer is
    one reducer among others."""
    model, xs = _model(), _inputs(3)
    batches = [(x, torch.zeros(len(x), 2)) for x in xs]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    writer = fh.ActivationWriter(model, fh.outputs("0"), tmp_path / "train")
    steps = list(fh.train(model, batches, nn.functional.mse_loss, opt, specs=writer.specs, epochs=2))
    ds = fh.fold(writer, steps)
    assert torch.equal(ds[:]["0/output"], torch.cat([s.record["0"]["output"] for s in steps]))
    fitted = fh.ActivationWriter(model, fh.outputs("2"), tmp_path / "fit")
    res = fh.fit(model, batches, nn.functional.mse_loss, opt, {"acts": fitted, "stats": fh.ActivationStats()})
    assert len(res["acts"]) == 15 and len(res["stats"].stats) == 3


def test_a_step_mask_keeps_the_rows_it_selects(tmp_path):
    """`mask(step)` reads what the step recorded (here: which inputs are not padding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 4))
    ids = [torch.tensor([[3, 4, 0], [5, 0, 0]]), torch.tensor([[6, 7, 8], [0, 0, 0]])]

    def real(module, args, output):
        return args[0] != 0

    writer = fh.ActivationWriter(model, [fh.outputs("0"), fh.observe("0", real)], tmp_path, flatten=True,
                                 mask=lambda step: step.record["0"]["real"])
    ds = fh.fold(writer, fh.evaluate(model, ids, specs=writer.specs))
    assert torch.equal(ds[:]["0/output"], model[0].weight[[3, 4, 5, 6, 7, 8]].detach())
    assert ds.metadata["masked"] is True and bool(ds[:]["0/real"].all())


def test_collect_skips_written_batches_without_running_the_model(tmp_path):
    """After an interruption, `collect` resumes at the first unwritten batch: the model runs
    on it and the later ones only."""
    calls = []

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 3)

        def forward(self, x):
            calls.append(len(x))
            return self.body(x)

    model, xs = Counting(), _inputs()
    writer = fh.ActivationWriter(model, fh.outputs("body"), tmp_path, rows_per_shard=10)

    def stop_at_5(batch):
        if len(calls) == 5:  # before the model runs on batch 5
            raise KeyboardInterrupt
        return None

    with pytest.raises(KeyboardInterrupt):
        fh.collect(writer, xs, mask=stop_at_5)
    assert model.training
    calls.clear()
    ds = fh.collect(writer, xs)
    assert len(calls) == 3  # rows of batches 0..3 were committed (20 of them) before the interruption
    with torch.no_grad():
        assert torch.equal(ds[:]["body/output"], torch.cat([model.body(x) for x in xs]))


def test_collect_moves_rows_from_any_device_to_the_store(device, tmp_path):
    """A model on the CPU or a GPU: masked, flattened, cast rows land on disk as recorded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 4)).to(device)
    ids = torch.randint(1, VOCAB, (3, 5, 6), device=device)
    ids[:, :, 4:] = 0
    writer = fh.ActivationWriter(model, fh.outputs("*"), tmp_path, flatten=True, dtype=torch.float16, rows_per_shard=7)
    ds = fh.collect(writer, list(ids), mask=lambda x: x != 0)
    with torch.no_grad():  # batch by batch, as collected: a batched matmul may round differently
        want = {"0/output": torch.cat([model[0](x)[x != 0] for x in ids]).half().cpu(),
                "1/output": torch.cat([model(x)[x != 0] for x in ids]).half().cpu()}
    assert _equal(ds[:], want)


# -- bad input: one-line errors, committed shards intact ---------------------------------------


def _stream(n: int = 4, rows_per_shard: int = 3) -> dict:
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(2, FEATURES, generator=gen), torch.arange(2) + 2 * i, None) for i in range(n)]
    return {"batches": batches, "flatten": False, "rows_per_shard": rows_per_shard, "dtype": None}


def test_a_store_continued_with_other_specs_or_options_is_refused(tmp_path):
    """`init` compares the directory's header with the writer's: other specs, `flatten`,
    `dtype` or `rows_per_shard` are one-line errors before anything runs."""
    stream = _stream()
    _feed(_writer(tmp_path, stream), stream)
    cases = {
        "specs": (fh.ActivationWriter(Two(), fh.outputs("a"), tmp_path),
                  "the specs that started it, got [\"outputs('a')\"] for {d}, written with [\"outputs(['a', 'b'])\"]"),
        "dtype": (_writer(tmp_path, {**stream, "dtype": torch.float16}),
                  "the `dtype` that started it, got 'float16' for {d}, written with None"),
        "rows": (_writer(tmp_path, {**stream, "rows_per_shard": 5}),
                 "the `rows_per_shard` that started it, got 5 for {d}, written with 3. Pass that, or None."),
    }
    for writer, middle in cases.values():
        with pytest.raises(fh.StoreError) as info:
            writer.init()
        end = "" if middle.endswith("None.") else ". Pass those, or write to a new directory."
        where = middle.format(d=repr(str(tmp_path)))
        assert str(info.value) == f"ActivationWriter: a store is continued with {where}{end}"
    assert _equal(_contents(tmp_path), _expected(stream))


def test_another_format_version_is_refused_by_writer_and_reader(tmp_path):
    """A manifest of format version 2 is named, with the release that wrote it."""
    stream = _stream()
    _feed(_writer(tmp_path, stream), stream)
    manifest = tmp_path / "manifest.rank0.jsonl"
    lines = manifest.read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header.update(version=2, versions={**header["versions"], "funhooks": "9.0"})
    manifest.write_text(json.dumps(header) + "\n" + "".join(lines[1:]))
    for open_it, caller in ((lambda: _writer(tmp_path, stream).init(), "ActivationWriter"),
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
    writer = _writer(tmp_path, stream)
    with pytest.raises(fh.StoreError) as info:
        _feed(writer, {**stream, "batches": bad})
    assert str(info.value) == (
        "ActivationWriter: every batch gives column 'a/output' float32 rows of shape (3,), got float32 rows of shape "
        "(4,) in batch 1. Give every batch one shape (with flatten=True a row is one position, and a mask drops "
        "padding) and one dtype, or write to a new directory."
    )
    wrong_dtype = [stream["batches"][0], (torch.randn(2, FEATURES, dtype=torch.float64), torch.arange(2), None)]
    with pytest.raises(fh.StoreError, match="got float64 rows of shape \\(3,\\) in batch 1"):
        _feed(writer, {**stream, "batches": wrong_dtype})
    assert _equal(_contents(tmp_path), {k: v[:2] for k, v in _expected(stream).items()})
    assert _equal(_feed(writer, stream)[:], _expected(stream))


def test_a_deleted_shard_is_named_with_the_fix(tmp_path):
    """A shard deleted by hand: reader and writer name it and the fix; cutting the manifest
    as told makes the writer rewrite it, and the later shards, exactly."""
    stream = _stream(n=5)
    _feed(_writer(tmp_path, stream), stream)
    (tmp_path / "shard.rank0.000001.safetensors").unlink()
    for open_it, caller in ((lambda: fh.ActivationDataset(tmp_path), "ActivationDataset"),
                            (lambda: _writer(tmp_path, stream).init(), "ActivationWriter")):
        with pytest.raises(fh.StoreError) as info:
            open_it()
        assert str(info.value) == (
            f"{caller}: every shard a manifest lists is in the store as written, got 'shard.rank0.000001.safetensors' "
            f"(rank 0, shard 1) missing in {str(tmp_path)!r}. Restore that file, or cut manifest.rank0.jsonl to its "
            "first 2 lines so that a writer rewrites it from batch 1."
        )
    manifest = tmp_path / "manifest.rank0.jsonl"
    manifest.write_text("".join(manifest.read_text().splitlines(keepends=True)[:2]))
    assert _equal(_feed(_writer(tmp_path, stream), stream)[:], _expected(stream))


def test_a_torn_manifest_line_and_stray_files_are_not_part_of_the_store(tmp_path):
    """What a killed writer can leave (half a manifest line, a shard renamed but not listed,
    a temporary) is ignored by the reader and cleaned by the next writer."""
    stream = _stream()
    _feed(_writer(tmp_path, stream), stream)
    want = _expected(stream)
    with (tmp_path / "manifest.rank0.jsonl").open("a") as f:
        f.write('{"shard": 3, "file": "shard.rank0.0000')
    (tmp_path / "shard.rank0.000003.safetensors").write_bytes(b"half")
    (tmp_path / ".shard.rank0.000003.safetensors.0a1b2c3d.tmp").write_bytes(b"half")
    assert _equal(_contents(tmp_path), want)
    more = {**stream, "batches": stream["batches"] + _stream(2)["batches"]}
    assert _equal(_feed(_writer(tmp_path, more), more)[:], _expected(more))
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
        _writer(tmp_path, _stream()).init()
    assert str(info.value) == (
        f"ActivationWriter: each line of a manifest is one JSON object, got line 2 of {str(manifest)!r} unreadable "
        "(a JSON list). Restore the file, or write the store again in a new directory."
    )


def test_a_corrupted_shard_is_refused_when_read(tmp_path):
    """A shard of the right size whose bytes were overwritten fails at its first read, named."""
    stream = _stream()
    _feed(_writer(tmp_path, stream), stream)
    shard = tmp_path / "shard.rank0.000001.safetensors"
    data = bytearray(shard.read_bytes())
    data[:8] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    ds = fh.ActivationDataset(tmp_path)
    assert torch.equal(ds[0]["b/output"], _expected(stream)["b/output"][0])  # shard 0 is fine
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
        _feed(_writer(tmp_path, stream), stream, stop=2)  # shard 0 ends one row into batch 1
    shorter = {**stream, "batches": [stream["batches"][0], (torch.randn(0, FEATURES), torch.arange(0), None)]}
    with pytest.raises(fh.StoreError) as info:
        _feed(_writer(tmp_path, stream), shorter)
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
        (_record(a, torch.arange(3)), None, "the columns of a batch share their leading batch dimensions, got "
         "{'a/output': (2,), 'b/output': (3,)} in batch 0. Write modules with other shapes to another store."),
        (_record(a, b), torch.ones(3, dtype=torch.bool),
         "a mask has the columns' leading shape (2,), got (3,) in batch 0. Pass a (batch,) mask of the same batch."),
    ]
    for record, mask, message in cases:
        with pytest.raises(fh.StoreError) as info:
            writer.write(state, 0, record, mask=mask)
        assert str(info.value).startswith("ActivationWriter: ") and message in str(info.value)
    with pytest.raises(fh.StoreError) as info:
        writer.write(state, 1, _record(a, b))
    assert str(info.value) == (
        f"ActivationWriter: batches come in order, each once, got batch 1 where batch 0 was next in {str(tmp_path)!r}. "
        "Feed every batch (a restart feeds them all from the first; the written ones are skipped), or fh.collect the "
        "inputs."
    )
    writer.write(state, 0, _record(a, b))
    with pytest.raises(fh.StoreError) as info:
        writer.write(state, 1, _record(a, b))
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


# -- subprocess scenarios ----------------------------------------------------------------------


def _child(*args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)


def _child_batches() -> list[torch.Tensor]:
    return [x * (i + 1) for i, x in enumerate(_inputs(40, 3))]


def _child_writer(directory: str, rows_per_shard: int, **kw) -> fh.ActivationWriter:
    return fh.ActivationWriter(_model(), [fh.outputs("0"), fh.outputs("2")], directory, rows_per_shard=rows_per_shard,
                               dtype=torch.bfloat16, **kw)


def _child_want() -> dict[str, torch.Tensor]:
    model = _model()
    with torch.no_grad():
        xs = _child_batches()
        return {"0/output": torch.cat([model[0](x) for x in xs]).bfloat16(),
                "2/output": torch.cat([model(x) for x in xs]).bfloat16()}


def _slow(batches, delay: float):
    for i, b in enumerate(batches):
        print(f"batch {i}", flush=True)
        time.sleep(delay)
        yield b


def test_a_killed_writer_resumes_without_duplicates_or_losses(tmp_path):
    """SIGKILL while writing (fsync on, a commit every 4 rows): the rank's lock is released,
    the store holds a prefix, and `collect` again completes it exactly."""
    want = _child_want()
    for kill_after in (5, 17):
        directory = tmp_path / str(kill_after)
        proc = _child("kill", str(directory))
        try:
            for line in proc.stdout:
                if line.strip() == f"batch {kill_after}":
                    break
            else:
                pytest.fail(f"the writer ended before batch {kill_after}: {proc.wait()}")
            with pytest.raises(fh.StoreError) as info:
                _child_writer(directory, 4).init()
            assert str(info.value) == (
                f"ActivationWriter: one writer at a time writes a rank of a store, got rank 0 of {str(directory)!r} "
                "locked by another process. Stop that process, or write with another `rank=` or directory."
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=CHILD_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
        got = _contents(directory)
        n = len(got["0/output"])
        assert 0 < n < len(want["0/output"]) and _equal(got, {k: v[:n] for k, v in want.items()})
        ds = fh.collect(_child_writer(directory, 4), _child_batches())
        assert _equal(ds[:], want)
        assert sorted(p.name for p in directory.iterdir() if not p.name.startswith("shard.")) == [
            ".lock.rank0", "manifest.rank0.jsonl"]


def _run_limited(directory: pathlib.Path, limit: int, rows_per_shard: int) -> str:
    proc = _child("limited", str(directory), str(limit), str(rows_per_shard))
    out, _ = proc.communicate(timeout=CHILD_TIMEOUT_S)
    assert proc.returncode == 0, out
    return out.strip().splitlines()[-1]


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_a_full_disk_keeps_what_was_committed(tmp_path):
    """Writes that fail for real (a file-size limit, EFBIG) while appending to the manifest
    or while writing a shard: a one-line StoreError, the committed shards intact, no file
    left over, and a later run completes the store."""
    want = _child_want()
    reference = tmp_path / "reference"
    fh.collect(_child_writer(reference, 4, fsync=False), _child_batches())
    lines = (reference / "manifest.rank0.jsonl").read_bytes().splitlines(keepends=True)
    shard_bytes = json.loads(lines[1])["bytes"]
    assert shard_bytes < len(b"".join(lines[:4]))
    for directory, limit, rows, kept in ((tmp_path / "manifest", len(b"".join(lines[:4])) + 20, 4, 3),
                                         (tmp_path / "shard", len(lines[0]) + 8, 64, 0)):
        message = _run_limited(directory, limit, rows)
        failing = f"shard.rank0.{kept:06d}.safetensors"
        assert message == (
            f"ActivationWriter: a shard is written whole or not at all, got OSError 27 (File too large) "
            f"{'committing' if kept else 'writing'} {failing} in {str(directory)!r}. Free space (or pick another "
            f"directory) and run again: the {kept} committed shards of rank 0 are kept and writing resumes at "
            f"batch {kept * 4 // 3}."
        )
        names = sorted(p.name for p in directory.iterdir())
        shards = [f"shard.rank0.{k:06d}.safetensors" for k in range(kept)]
        assert names == [".lock.rank0", "manifest.rank0.jsonl", *shards]
        if kept:
            assert _equal(_contents(directory), {k: v[:4 * kept] for k, v in want.items()})
        ds = fh.collect(_child_writer(directory, rows), _child_batches())
        assert _equal(ds[:], want)


def test_ranks_write_their_own_shards_and_read_as_one_dataset(tmp_path):
    """Two gloo ranks `collect` their own batches into one directory (rank from
    torch.distributed); the dataset reads rank 0's rows, then rank 1's."""
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    procs = [_child("rank", str(tmp_path / "store"), str(tmp_path / "rendezvous"), str(rank)) for rank in range(2)]
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, out
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    ds = fh.ActivationDataset(tmp_path / "store", columns="2/output")
    model = _model()
    with torch.no_grad():
        want = torch.cat([model(x).bfloat16() for rank in range(2) for x in _rank_batches(rank)])
    assert ds.metadata["ranks"] == [0, 1] and ds.shards == -(-30 // 4) + -(-24 // 4)
    assert torch.equal(ds[:], want)


def _rank_batches(rank: int) -> list[torch.Tensor]:
    return _child_batches()[rank * 10:(rank + 1) * 10 - 2 * rank]


def _main(mode: str, *args: str) -> None:
    torch.set_num_threads(1)
    if mode == "kill":
        fh.collect(_child_writer(args[0], 4), _slow(_child_batches(), 0.05))
    elif mode == "limited":
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(args[1]), resource.RLIM_INFINITY))
        try:
            fh.collect(_child_writer(args[0], int(args[2])), _child_batches())
        except fh.StoreError as e:
            print(e)
    elif mode == "rank":
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{args[1]}", rank=int(args[2]), world_size=2,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            fh.collect(_child_writer(args[0], 4), _rank_batches(int(args[2])))
            dist.barrier()
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    _main(*sys.argv[1:])
