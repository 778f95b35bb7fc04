"""A Record's notebook display: the tree's paths, record names, call counts, shapes, dtypes and
devices as a person reads them, never a tensor's values."""

from __future__ import annotations

import statistics
import time

import torch
import transformers
from html_kit import assert_self_contained, seen
from torch import nn

import funhooks as fh


def _row(rec: fh.Record, path: str) -> list[str]:
    [row] = [r for r in seen(rec._repr_html_()).texts()[1:] if r[0] == path]
    return row


def test_a_records_display_shows_each_path_with_its_calls_shapes_dtypes_and_devices() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Sequential(nn.ReLU(), nn.Linear(4, 2).double()))
    with fh.with_hooks(model, [fh.outputs("0"), fh.outputs("1.0"), fh.inputs("1.1")]) as run:
        model[1][1](model[1][0](model[0](torch.ones(5, 3))).double())
    rec = run.record
    shown = seen(rec._repr_html_())
    assert shown.texts()[0] == ["module", "record", "calls", "shape", "dtype", "device"]
    assert [r[:2] for r in shown.texts()[1:]] == [[p, n] for p, node in rec.items() for n in node]
    assert _row(rec, "0") == ["0", "output", "1", "5×4", "float32", "cpu"]
    assert _row(rec, "1.0") == ["1.0", "output", "1", "5×4", "float32", "cpu"]
    assert _row(rec, "1.1") == ["1.1", "input", "1", "((5×4,), {})", "float64", "cpu"]
    assert "3 module(s)" in shown.caption
    assert_self_contained(rec._repr_html_())


def test_calls_of_different_shapes_are_listed_and_the_count_is_every_call() -> None:
    rec = fh.Record({"blocks.0": {"output": tuple(torch.zeros(1, n, 8) for n in (3, 1, 1, 1))}})
    assert _row(rec, "blocks.0") == ["blocks.0", "output", "4", "1×3×8 / 1×1×8", "float32", "cpu"]
    many = fh.Record({"blocks.0": {"output": tuple(torch.zeros(1, n, 8) for n in range(1, 40))}})
    row = _row(many, "blocks.0")
    assert row[2] == "39" and row[3].endswith("/ …") and len(row[3]) < 300


def test_a_huge_tensor_is_described_never_printed() -> None:
    big = torch.full((2000, 1000), 123.456)
    markup = fh.Record({"fc": {"output": (big,)}, "": {"loss": (torch.tensor(7.5),)}})._repr_html_()
    assert "123.4" not in markup and "7.5" not in markup
    assert len(markup) < 3000
    assert _row(fh.Record({"fc": {"output": (big,)}}), "fc")[3] == "2000×1000"


def test_describing_a_tensor_reads_none_of_its_values() -> None:
    """A meta tensor has no values: reading one raises, so a display of it proves none is read
    (the same path a CUDA tensor takes: it never syncs with the host)."""
    huge = torch.empty(10**6, 10**6, device="meta", dtype=torch.bfloat16)
    rec = fh.Record({"lm_head": {"output": ((huge, None),)}})
    assert _row(rec, "lm_head") == ["lm_head", "output", "1", "(1000000×1000000, None)", "bfloat16", "meta"]


def test_other_stored_objects_show_their_type_and_plain_values_themselves() -> None:
    class Holder:
        def __repr__(self) -> str:
            raise AssertionError("a display called the repr of a stored object")

    rec = fh.Record({"a": {"kept": ({"x": Holder(), "n": 3, "s": "text"},)}})
    assert _row(rec, "a")[3] == "{x: Holder, n: 3, s: 'text'}"


def test_user_strings_are_escaped() -> None:
    evil = "<script>alert(1)</script>"
    rec = fh.Record({evil: {"out&<b>": (torch.zeros(2),)}})
    markup = rec._repr_html_()
    assert "<script" not in markup and "<b>" not in markup
    assert _row(rec, evil)[:2] == [evil, "out&<b>"]


def test_a_long_record_says_how_many_rows_it_left_out() -> None:
    from funhooks._html import MAX_ROWS

    rec = fh.Record({f"layer{i}": {"output": (torch.zeros(1),)} for i in range(MAX_ROWS + 25)})
    rows = seen(rec._repr_html_()).texts()
    assert len(rows) == 1 + MAX_ROWS + 1 and rows[-1] == ["… 25 more not shown"]


def test_a_12_layer_records_display_renders_in_well_under_100_ms() -> None:
    config = transformers.GPT2Config(n_layer=12, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad(), fh.with_hooks(model, [fh.outputs(nn.Module), fh.inputs("transformer.h.*")]) as run:
        model(torch.tensor([[1, 2, 3, 4]]), use_cache=False)
    rec = run.record
    assert len(rec) > 150
    times = []
    for _ in range(7):
        start = time.perf_counter()
        rec._repr_html_()
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.05, f"{statistics.median(times) * 1e3:.1f} ms"
    assert _row(rec, "transformer.h.11.mlp")[3] == "1×4×16"
