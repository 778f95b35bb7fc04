"""Helpers shared by the activation-store tests: a two-output model, streams of batches, and
reading a store back."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn

import funhooks as fh

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


def record_of(a: torch.Tensor, b: torch.Tensor) -> fh.Record:
    return fh.Record({"a": {"output": (a,)}, "b": {"output": (b,)}})


def expected_rows(stream: dict) -> dict[str, torch.Tensor]:
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


def writer_for(directory, stream: dict, **kw) -> fh.ActivationWriter:
    return fh.ActivationWriter(Two(), fh.outputs(["a", "b"]), directory, flatten=stream["flatten"],
                               dtype=stream["dtype"], rows_per_shard=stream["rows_per_shard"], fsync=False, **kw)


def feed(writer: fh.ActivationWriter, stream: dict, stop: int | None = None) -> fh.ActivationDataset | None:
    """Write the stream's batches; stop with an exception before batch `stop`."""
    state = writer.init()
    for i, (a, b, mask) in enumerate(stream["batches"]):
        if i == stop:
            raise RuntimeError("interrupted")
        state = writer.write(state, i, record_of(a, b), mask=mask)
    return writer.result(state)


def contents(directory) -> dict[str, torch.Tensor]:
    ds = fh.ActivationDataset(directory)
    return ds[:] if len(ds) else {}


def same_rows(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return set(got) == set(want) and all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def store_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def store_inputs(n: int = 7, batch: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(batch, 4, generator=gen) for _ in range(n)]
