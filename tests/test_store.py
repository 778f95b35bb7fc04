"""Activation stores: the rows read back are the rows recorded, through evaluate, train, fit and collect."""

from __future__ import annotations

import pathlib
import tempfile

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from torch import nn

import funhooks as fh

pytest.importorskip("safetensors")
from safetensors.torch import load_file  # noqa: E402

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


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def _inputs(n: int = 7, batch: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 4, generator=gen) for _ in range(n)]


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
