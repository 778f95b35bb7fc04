"""Editing standard points: patches change the model's real value, per-head views write back
through, Records of points are patch sources, sweeps map under vmap, and errors are clear."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import funhooks as fh
from tests.transformer_models import BUILDERS, inputs

EDITABLE = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_in", "mlp_pre", "mlp_post", "mlp_out",
            "q", "k", "v", "z", "pattern", "attn_scores")
MODELS = {name: BUILDERS[name]() for name in BUILDERS}


def _corrupt(name):
    x = inputs(name)
    return {**x, "input_ids": (x["input_ids"] + 7) % 50}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_patching_resid_pre_runs_from_that_point(name):
    """Patching resid_pre[1] with a clean run's resid_pre[1] gives the clean run's output: the
    block's real input is replaced (the corrupted run before layer 1 no longer matters)."""
    model = MODELS[name]
    pts = fh.transformer.points(model)
    clean, rec = fh.capture(model, fh.outputs(pts.resid_pre[1]))(**inputs(name))
    patched, _ = fh.capture(model, fh.patch(pts.resid_pre[1], rec))(**_corrupt(name))
    corrupted, _ = fh.capture(model, [])(**_corrupt(name))
    torch.testing.assert_close(patched.logits, clean.logits)
    assert not torch.allclose(corrupted.logits, clean.logits)
    fh.testing.assert_no_hooks(model)


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "bert"])
def test_patching_z_head_changes_only_that_head(name):
    """`fh.patch(pts.z[1], src, index=h, dim=2)` changes head h's slice of the output projection's
    input, and nothing else of it."""
    model = MODELS[name]
    pts = fh.transformer.points(model)
    arch = fh.transformer.architecture(model)
    proj = f"{ {'gpt2': 'transformer', 'llama': 'model', 'neox': 'gpt_neox', 'bert': 'bert'}[name]}." \
           f"{arch.blocks}.1.{arch.attn_proj}".replace(" ", "")
    src = torch.full((2, 6, pts.n_heads, pts.d_head), 3.0)
    seen = {}
    module = model.get_submodule(proj)
    pre = module.register_forward_pre_hook(lambda m, a: seen.__setitem__("z", a[0].detach()))
    post = module.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o.detach()))
    try:
        fh.capture(model, [])(**inputs(name))
        z = seen["z"].unflatten(-1, (pts.n_heads, -1)).clone()
        fh.capture(model, fh.patch(pts.z[1], src, index=2, dim=2))(**inputs(name))
    finally:
        pre.remove(), post.remove()
    z[:, :, 2] = 3.0  # the head patched by hand, the others as they were
    with torch.no_grad():
        torch.testing.assert_close(seen["out"], module(z.flatten(-2)))


@pytest.mark.parametrize("point", ["q", "k", "v"])
@pytest.mark.parametrize("name", ["gpt2", "neox"])
def test_fused_qkv_views_write_back_into_their_part(name, point):
    """Editing q, k or v of a fused projection changes only that part of its output, in the
    family's layout: the point read back is the edited value, the other two are unchanged."""
    model = MODELS[name]
    pts = fh.transformer.points(model)
    x = inputs(name)
    reads = [fh.outputs(getattr(pts, p)[0]) for p in "qkv"]
    _, before = fh.capture(model, reads)(**x)
    _, after = fh.capture(model, [fh.scale(getattr(pts, point)[0], 0.0), *reads])(**x)
    for p in "qkv":
        got, was = after[f"blocks.0.{p}"]["output"], before[f"blocks.0.{p}"]["output"]
        assert torch.equal(got, torch.zeros_like(was)) if p == point else torch.equal(got, was)


def test_patching_resid_mid_changes_the_stream():
    """resid_mid is the stream itself, not a norm's input: zeroing it at every position leaves
    resid_post = the MLP's output of a zero input (GPT-2)."""
    model = MODELS["gpt2"]
    pts = fh.transformer.points(model)
    _, rec = fh.capture(model, [fh.ablate(pts.resid_mid[0]), fh.outputs(pts.resid_post[0]),
                                fh.outputs(pts.mlp_out[0])])(**inputs("gpt2"))
    torch.testing.assert_close(rec["blocks.0.resid_post"]["output"], rec["blocks.0.mlp_out"]["output"])


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(sorted(BUILDERS)), point=st.sampled_from(EDITABLE), layer=st.integers(-2, 1))
def test_patching_a_point_with_its_own_value_is_the_identity(name, point, layer):
    """For any family, point and layer: patching a point with the value a run recorded there gives
    that run's output, and a Record of the point is the source with the same key."""
    model = MODELS[name]
    pts = fh.transformer.points(model)
    where = getattr(pts, point)
    if where.kind == "none":
        return
    where = where[layer]
    out, rec = fh.capture(model, fh.outputs(where))(**inputs(name))
    again, rec2 = fh.capture(model, [fh.patch(where, rec), fh.outputs(where)])(**inputs(name))
    torch.testing.assert_close(again.logits, out.logits)
    assert list(rec2) == list(rec) == list(where.keys)


def test_vmap_sweep_over_layers_and_positions():
    """A sweep over (layer, position) with `nth` and `index` per call in one vmapped call equals the
    patches run one by one."""
    model = MODELS["gpt2"]
    pts = fh.transformer.points(model)
    x, bad = inputs("gpt2", batch=1), _corrupt("gpt2")["input_ids"][:1]
    _, clean = fh.capture(model, fh.outputs(pts.resid_pre))(**x)
    f = fh.capture(model, fh.patch(pts.resid_pre, clean, nth=fh.arg("layer"), index=fh.arg("pos")))
    layers, positions = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 3, 0, 3])
    swept = torch.func.vmap(lambda layer, pos: f(bad, layer=layer, pos=pos, use_cache=False)[0].logits)(
        layers, positions)
    for i in range(4):
        one, _ = fh.capture(model, fh.patch(pts.resid_pre[int(layers[i])], clean, index=int(positions[i])))(bad)
        torch.testing.assert_close(swept[i], one.logits)


def test_grads_of_points_equal_autograd():
    """grads of a module-output point, of a view point and of an input point equal autograd's."""
    model = MODELS["llama"]
    pts = fh.transformer.points(model)
    with fh.with_hooks(model, [fh.outputs(pts.resid_post[0]), fh.grads(pts.resid_post[0]), fh.grads(pts.q[0]),
                               fh.grads(pts.z[0])]) as run:
        model(**inputs("llama")).logits.sum().backward()
    rec = run.record
    assert rec["blocks.0.resid_post"]["grad"].shape == rec["blocks.0.resid_post"]["output"].shape
    assert rec["blocks.0.q"]["grad"].shape == (2, 6, 4, 8) and rec["blocks.0.z"]["grad"].shape == (2, 6, 4, 8)
    z = {}
    proj = model.model.layers[0].self_attn.o_proj
    h = proj.register_forward_pre_hook(lambda m, a: (a[0].retain_grad(), z.__setitem__("z", a[0]))[1])
    try:
        model(**inputs("llama")).logits.sum().backward()
    finally:
        h.remove()
    torch.testing.assert_close(rec["blocks.0.z"]["grad"], z["z"].grad.unflatten(-1, (4, 8)))
    model.zero_grad()


def test_errors_name_the_point_and_the_fix():
    """Layer out of range, a point a family lacks, a wrong kind of spec: SpecErrors with the rule
    and the fix; an unknown family lists the known ones. The model is left as it was."""
    model = MODELS["gpt2"]
    pts = fh.transformer.points(model)
    with pytest.raises(fh.SpecError) as err:
        pts.resid_pre[2]
    assert str(err.value) == ("points: `resid_pre` has one value per layer of the model's 2 layers, got layer 2. "
                              "Pass a layer in [-2, 2) (negative from the last), a slice or a list of them.")
    with pytest.raises(fh.SpecError) as err:
        fh.inputs(pts.q)
    assert str(err.value).startswith("inputs: a standard point is a value, not a module, and takes `fh.outputs`")
    with pytest.raises(fh.SpecError, match=r"^grads: `resid_mid` is the value of an op"):
        fh.grads(pts.resid_mid)
    with pytest.raises(fh.SpecError, match=r"^patch: a standard point already says where"):
        fh.patch(pts.q, 0.0, op="softmax")
    with pytest.raises(fh.SpecError, match=r"^points: `embed` is one value for the whole model"):
        pts.embed[0]
    nopts = fh.transformer.points(MODELS["neox"])
    with pytest.raises(fh.SpecError) as err:
        fh.outputs(nopts.resid_mid)
    assert str(err.value) == ("outputs: `resid_mid` is the stream between attention and MLP, which read the same "
                              "input in the parallel blocks of 'gpt_neox', got `resid_mid`. Use another point "
                              "(see docs/transformers.md).")
    with pytest.raises(fh.SpecError, match="final_norm"):
        fh.outputs(fh.transformer.points(MODELS["bert"]).final_norm)
    with pytest.raises(fh.SelectorError) as err:
        fh.transformer.points(torch.nn.Linear(2, 2))
    assert "Declare where your family keeps them with `fh.transformer.register" in str(err.value)
    with pytest.raises(fh.InterventionError):
        fh.capture(model, fh.patch(pts.z[0], torch.zeros(3)))(**inputs("gpt2"))
    fh.testing.assert_no_hooks(model)
