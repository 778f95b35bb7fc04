"""Activation stores: the rows read back are the rows recorded, through evaluate, train, fit and collect."""

from __future__ import annotations

import pathlib
import tempfile

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from store_helpers import (
    VOCAB,
    contents,
    expected_rows,
    feed,
    same_rows,
    store_inputs,
    store_model,
    streams,
    writer_for,
)
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

# -- the rows read back are the rows recorded --------------------------------------------------


@hypothesis.given(stream=streams())
def test_rows_read_back_are_the_rows_recorded(stream):
    """Any stream, shard size, mask and cast: the dataset and the raw safetensors files hold
    exactly the recorded rows, in order."""
    with tempfile.TemporaryDirectory() as d:
        want = expected_rows(stream)
        ds = feed(writer_for(d, stream), stream)
        assert len(ds) == len(want["a/output"])
        assert same_rows(ds[:], want)
        files = sorted(pathlib.Path(d).glob("shard.rank0.*.safetensors"))
        assert len(files) == ds.shards
        if files:
            raw = [load_file(f) for f in files]
            assert same_rows({k: torch.cat([r[k] for r in raw]) for k in want}, want)
            assert all(len(r["a/output"]) == stream["rows_per_shard"] for r in raw[:-1])


@hypothesis.given(stream=streams(), stops=st.lists(st.integers(0, 6), max_size=3))
def test_interrupted_writes_resume_to_the_same_store(stream, stops):
    """Exceptions before any batches, then a restart: the same rows as one run, none twice,
    none lost; after each interruption the store holds a prefix of them."""
    want = expected_rows(stream)
    with tempfile.TemporaryDirectory() as d:
        for stop in stops:
            if stop < len(stream["batches"]):
                with pytest.raises(RuntimeError, match="interrupted"):
                    feed(writer_for(d, stream), stream, stop=stop)
                got = contents(d) if (pathlib.Path(d) / "manifest.rank0.jsonl").exists() else {}
                if got:
                    n = len(got["a/output"])
                    assert same_rows(got, {k: v[:n] for k, v in want.items()})
        assert same_rows(feed(writer_for(d, stream), stream)[:], want)
        assert not [p for p in pathlib.Path(d).iterdir() if p.name.endswith(".tmp")]


# -- steps: evaluate, train, fit ----------------------------------------------------------------


def _interrupting(batches, at: int, exc: BaseException):
    for i, b in enumerate(batches):
        if i == at:
            raise exc
        yield b


def test_fold_over_evaluate_resumes_after_keyboard_interrupt(tmp_path):
    """A KeyboardInterrupt mid-evaluation, then the same fold again: the rows of one run."""
    model, xs = store_model(), store_inputs()
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
    model, xs = store_model(), store_inputs(3)
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

    model, xs = Counting(), store_inputs()
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
    assert same_rows(ds[:], want)
