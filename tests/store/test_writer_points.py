"""Activation stores at standard points: a column is named after the point's Record path (what
``fh.capture`` keys it by), through ``collect``, a fold over ``evaluate``, ``max_rows`` and the
stream, for per-layer, view, op and global points and several layers at once."""

from __future__ import annotations

import tempfile

import pytest
import torch
import transformer_models as tm

import funhooks as fh

pytest.importorskip("safetensors")

_POINTS = {  # name -> (the point of a model's points, the Record paths it stores at)
    "resid_post[0]": (lambda p: p.resid_post[0], ["blocks.0.resid_post"]),
    "resid_pre[1]": (lambda p: p.resid_pre[1], ["blocks.1.resid_pre"]),
    "z[1]": (lambda p: p.z[1], ["blocks.1.z"]),
    "resid_mid[1]": (lambda p: p.resid_mid[1], ["blocks.1.resid_mid"]),
    "pattern[0]": (lambda p: p.pattern[0], ["blocks.0.pattern"]),
    "embed": (lambda p: p.embed, ["embed"]),
    "final_norm": (lambda p: p.final_norm, ["final_norm"]),
    "logits": (lambda p: p.logits, ["logits"]),
    "resid_post[:2]": (lambda p: p.resid_post[:2], ["blocks.0.resid_post", "blocks.1.resid_post"]),
    "resid_post": (lambda p: p.resid_post, ["blocks.0.resid_post", "blocks.1.resid_post"]),
}


def _batches(n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, tm.VOCAB, (2, 6), generator=g) for _ in range(n)]


def _recorded(model: torch.nn.Module, specs: object, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The values `specs` record on one batch, by ``"<Record path>/<record name>"``."""
    _, record = fh.capture(model, specs)(ids)
    return {f"{path}/{name}": record[path][name] for path in record for name in record[path]}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("point", list(_POINTS))
def test_a_point_is_stored_under_its_record_path(family, point):
    """`fh.collect` at a standard point writes one column per Record path the point stores at,
    named as the Record names it, holding the recorded values (rows of all batches in order)."""
    model = tm.BUILDERS[family]()
    where, paths = _POINTS[point]
    spec = fh.outputs(where(fh.transformer.points(model)))
    batches = _batches()
    writer = fh.ActivationWriter(model, spec, tempfile.mkdtemp())
    assert [c for c, _, _ in writer.columns] == [f"{p}/output" for p in paths]
    ds = fh.collect(writer, batches)
    assert list(ds.columns) == [f"{p}/output" for p in paths]
    for column in ds.columns:
        want = torch.cat([_recorded(model, spec, ids)[column] for ids in batches])
        assert torch.equal(ds[:][column], want)


def test_a_fold_over_evaluate_and_the_stream_read_the_point_columns():
    """Folded over ``fh.evaluate``'s Steps (rows per position), a store of every layer's
    ``resid_post`` holds the Record's values; the stream's batches carry the same columns."""
    model = tm.gpt2()
    pts = fh.transformer.points(model)
    batches = _batches()
    writer = fh.ActivationWriter(model, fh.outputs(pts.resid_post), tempfile.mkdtemp(), flatten=True)
    ds = fh.fold(writer, fh.evaluate(model, batches, specs=writer.specs))
    names = ["blocks.0.resid_post/output", "blocks.1.resid_post/output"]
    assert list(ds.columns) == names and len(ds) == 3 * 2 * 6
    for name in names:
        want = torch.cat([_recorded(model, writer.specs, ids)[name].flatten(0, 1) for ids in batches])
        assert torch.equal(ds[:][name], want)
    got = list(fh.ActivationStream(ds, batch_size=12, shuffle=False))
    assert all(sorted(b) == names for b in got)
    assert torch.equal(torch.cat([b[names[1]] for b in got]), ds[:][names[1]])


def test_two_points_on_one_module_are_two_columns():
    """``resid_post[0]`` and ``resid_pre[1]`` read the same module's output: each is its own
    column, under its own Record path, holding the same values."""
    model = tm.gpt2()
    pts = fh.transformer.points(model)
    specs = [fh.outputs(pts.resid_post[0]), fh.outputs(pts.resid_pre[1])]
    ds = fh.collect(fh.ActivationWriter(model, specs, tempfile.mkdtemp(), flatten=True), _batches())
    assert list(ds.columns) == ["blocks.0.resid_post/output", "blocks.1.resid_pre/output"]
    assert torch.equal(ds[:]["blocks.0.resid_post/output"], ds[:]["blocks.1.resid_pre/output"])


def test_max_rows_cuts_a_store_at_a_point():
    """``collect(max_rows=)`` reads the point's rows to cut the last batch: the store holds
    exactly the first `max_rows` rows."""
    model = tm.gpt2()
    spec = fh.outputs(fh.transformer.points(model).resid_post[1])
    batches = _batches()
    ds = fh.collect(fh.ActivationWriter(model, spec, tempfile.mkdtemp(), flatten=True), batches, max_rows=15)
    want = torch.cat([_recorded(model, spec, ids)["blocks.1.resid_post/output"].flatten(0, 1) for ids in batches])
    assert len(ds) == 15 and torch.equal(ds[:]["blocks.1.resid_post/output"], want[:15])


def test_module_paths_keep_their_names():
    """A spec at a module path is named after the module, as before."""
    model = tm.gpt2()
    ds = fh.collect(fh.ActivationWriter(model, fh.outputs("transformer.h.0.mlp"), tempfile.mkdtemp()), _batches(1))
    assert list(ds.columns) == ["transformer.h.0.mlp/output"]
