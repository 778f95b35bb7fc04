"""An SAE spliced at a point: features recorded at ``<point>.sae``, the model's output kept bit
for bit without an edit (the error term), edits equal to a hand-written hook doing the same
matmuls, during ``generate`` too; clear errors for what cannot be spliced."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import funhooks as fh
from sae_kit import SAE, hand
from transformer_models import gpt2, llama

IDS = torch.arange(12).reshape(2, 6) % 50


def test_without_an_edit_the_output_is_the_models_bit_for_bit_and_the_features_are_encode(device: torch.device) -> None:
    model, sae = gpt2().to(device), SAE().to(device)
    pts = fh.transformer.points(model)
    ids = IDS.to(device)
    out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae))(ids)
    _, clean = fh.capture(model, fh.outputs(pts.resid_post[0]))(ids)
    assert torch.equal(out.logits, model(ids).logits)
    assert list(rec) == ["blocks.0.resid_post.sae"]
    assert torch.equal(rec["blocks.0.resid_post.sae"]["features"], sae.encode(clean["blocks.0.resid_post"]["output"]))
    fh.testing.assert_no_hooks(model)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), d_sae=st.integers(1, 96), batch=st.integers(1, 3), length=st.integers(1, 8),
       layer=st.integers(0, 1), scale=st.floats(0.01, 3.0))
def test_property_an_edit_that_changes_no_feature_changes_no_bit(seed: int, d_sae: int, batch: int, length: int,
                                                                 layer: int, scale: float) -> None:
    """For random SAEs and inputs: recording only, and an edit that leaves every feature as it was
    (a real edit, decoded twice), give the model's own logits, bit for bit."""
    model, sae = _MODEL, SAE(32, d_sae, seed, scale)
    ids = torch.randint(0, 50, (batch, length), generator=torch.Generator().manual_seed(seed))
    pts = fh.transformer.points(model)
    want = model(ids).logits
    for edit in (None, fh.sae.scale(None, 1.0), fh.sae.steer([0], 0.0)):
        out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[layer], sae, edit=edit))(ids)
        assert torch.equal(out.logits, want)
        assert rec[f"blocks.{layer}.resid_post.sae"]["features"].shape == (batch, length, d_sae)


_MODEL = gpt2()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_an_ablation_is_the_hand_written_hook_and_the_recorded_features_are_the_edited_ones(attn: str) -> None:
    model, sae = llama(attn), SAE()
    pts = fh.transformer.points(model)
    edit = fh.sae.ablate([3, 7])
    out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[1], sae, edit=edit))(IDS)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        f = sae.encode(x)
        g = f.clone()
        g[..., [3, 7]] = 0
        return x + (sae.decode(g) - sae.decode(f))

    want = hand(model, model.model.layers[1], by_hand, IDS).logits
    torch.testing.assert_close(out.logits, want, rtol=0, atol=0)
    features = rec["blocks.1.resid_post.sae"]["features"]
    assert features[..., [3, 7]].abs().max() == 0 and features.abs().max() > 0
    assert not features.requires_grad


def test_without_the_error_term_the_model_runs_on_the_reconstruction() -> None:
    model, sae = gpt2(), SAE()
    pts = fh.transformer.points(model)
    out, _ = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae, error=False, record=False))(IDS)
    want = hand(model, model.transformer.h[0], lambda x: sae.decode(sae.encode(x)), IDS).logits
    assert torch.equal(out.logits, want)


def test_steering_a_feature_during_generate_is_the_hand_written_hook_at_every_step() -> None:
    model, sae = gpt2(), SAE()
    pts = fh.transformer.points(model)
    kw = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    steered = fh.sae.splice(pts.resid_post[1], sae, edit=fh.sae.steer(5, 40.0))
    gen = fh.generate(model, steered, IDS, **kw)

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        f = sae.encode(x)
        g = f.clone()
        g[..., 5] += 40.0
        return x + (sae.decode(g) - sae.decode(f))

    handle = model.transformer.h[1].register_forward_hook(lambda m, a, out: by_hand(out) if isinstance(
        out, torch.Tensor) else (by_hand(out[0]), *out[1:]))
    try:
        want = model.generate(IDS, **kw)
    finally:
        handle.remove()
    assert torch.equal(gen.output, want)
    assert not torch.equal(gen.output, model.generate(IDS, **kw))
    shapes = [tuple(r["blocks.1.resid_post.sae"]["features"].shape) for r in gen.records]
    assert shapes == [(2, 6, 64)] + [(2, 1, 64)] * 3
    fh.testing.assert_no_hooks(model)


def test_the_sae_sees_the_value_in_its_own_dtype_and_the_model_gets_its_own_back() -> None:
    model, sae = gpt2(), SAE().double()
    seen: list[torch.dtype] = []

    def look(f: torch.Tensor) -> torch.Tensor:
        seen.append(f.dtype)
        return f

    pts = fh.transformer.points(model)
    out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae, edit=[look, fh.sae.ablate(1)]))(IDS)
    assert seen == [torch.float64] and out.logits.dtype == torch.float32
    assert rec["blocks.0.resid_post.sae"]["features"].dtype == torch.float64


def test_a_module_path_and_positions_and_a_user_function_as_the_edit() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    sae = SAE(8, 16)
    x = torch.randn(3, 5, 4)
    out, rec = fh.capture(model, fh.sae.splice("0", sae, edit=fh.sae.patch(None, 0.0, positions=[-1])))(x)
    h = model[0](x)
    f = sae.encode(h)
    g = f.clone()
    g[:, -1] = 0
    torch.testing.assert_close(out, model[1](h + sae.decode(g) - sae.decode(f)))
    assert torch.equal(rec["0.sae"]["features"], g)


def test_bad_input_is_refused_with_the_fix() -> None:
    model = gpt2()
    pts = fh.transformer.points(model)
    with pytest.raises(fh.SpecError, match=r"encode.*decode.*Linear without `encode` and `decode`"):
        fh.sae.splice(pts.resid_post[0], nn.Linear(32, 32))
    with pytest.raises(fh.SpecError, match=r"one place.*2 layers.*pts.resid_post\[3\]"):
        fh.sae.splice(pts.resid_post, SAE())
    with pytest.raises(fh.SpecError, match=r"op inside a module"):
        fh.sae.splice(pts.resid_mid[0], SAE())
    with pytest.raises(fh.SpecError, match=r"feature edit"):
        fh.sae.splice(pts.resid_post[0], SAE(), edit=3)
    with pytest.raises(fh.SpecError, match=r"non-empty list of ints"):
        fh.sae.ablate([])
    with pytest.raises(fh.SpecError, match=r"d_in=48, got `resid_post\[1\]`.*width 32.*SAE.*Splice it at "
                       r"the point it was trained on"):
        fh.capture(model, fh.sae.splice(pts.resid_post[1], SAE(48, 8)))(IDS)
    fh.testing.assert_no_hooks(model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_an_saelens_sae_splices_as_it_is() -> None:
    """SAELens' ``SAE`` follows the protocol: its widths come from ``cfg``, its features are its
    own ``encode``, an ablation is its own ``decode`` of the edited features plus the error term."""
    sae_lens = pytest.importorskip("sae_lens", reason="sae_lens is not installed (the `sae` extra: pip "
                                   "install 'funhooks[sae]')")
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=32, d_sae=64))
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    assert fh.sae.shape_of(sae, "test") == fh.sae.Shape(32, 64, torch.device("cpu"), torch.float32)
    model = gpt2()
    pts = fh.transformer.points(model)
    out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae))(IDS)
    assert torch.equal(out.logits, model(IDS).logits)
    x = fh.capture(model, fh.outputs(pts.resid_post[0]))(IDS)[1]["blocks.0.resid_post"]["output"]
    assert torch.equal(rec["blocks.0.resid_post.sae"]["features"], sae.encode(x))
    out, rec = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae, edit=fh.sae.ablate([1, 2])))(IDS)

    def by_hand(h: torch.Tensor) -> torch.Tensor:
        f = sae.encode(h)
        g = f.clone()
        g[..., [1, 2]] = 0
        return h + (sae.decode(g) - sae.decode(f))

    assert torch.equal(out.logits, hand(model, model.transformer.h[0], by_hand, IDS).logits)
    with pytest.raises(fh.SpecError, match=r"d_in=32, got `mlp_post\[0\]`.*width 128"):
        fh.capture(model, fh.sae.splice(pts.mlp_post[0], sae))(IDS)


def test_an_sae_on_z_reads_the_heads_flattened_and_writes_them_back() -> None:
    """An SAE as wide as all heads (SAELens' ``hook_z`` convention) at ``pts.z``: it sees
    ``(batch, position, heads * d_head)``; the edit reaches the output projection's input."""
    model, sae = gpt2(), SAE(32, 48)
    pts = fh.transformer.points(model)
    out, rec = fh.capture(model, fh.sae.splice(pts.z[1], sae, edit=fh.sae.ablate([0, 5])))(IDS)

    def by_hand(module: nn.Module, args: tuple) -> tuple:
        z = args[0]
        f = sae.encode(z)
        g = f.clone()
        g[..., [0, 5]] = 0
        return (z + (sae.decode(g) - sae.decode(f)),)

    handle = model.transformer.h[1].attn.c_proj.register_forward_pre_hook(by_hand)
    try:
        want = model(IDS).logits
    finally:
        handle.remove()
    assert torch.equal(out.logits, want)
    assert rec["blocks.1.z.sae"]["features"].shape == (2, 6, 48)


def test_patching_a_clean_runs_features_into_a_corrupted_run() -> None:
    model, sae = gpt2(), SAE()
    pts = fh.transformer.points(model)
    clean, corrupt = IDS, IDS.flip(1)
    _, rec = fh.capture(model, fh.sae.splice(pts.resid_post[0], sae))(clean)
    features = rec["blocks.0.resid_post.sae"]["features"]
    patch = fh.sae.splice(pts.resid_post[0], sae, edit=fh.sae.patch(None, features, positions=[-1]))
    out, rec2 = fh.capture(model, patch)(corrupt)
    assert torch.equal(rec2["blocks.0.resid_post.sae"]["features"][:, -1], features[:, -1])

    def by_hand(x: torch.Tensor) -> torch.Tensor:
        f = sae.encode(x)
        g = f.clone()
        g[:, -1] = features[:, -1]
        return x + (sae.decode(g) - sae.decode(f))

    assert torch.equal(out.logits, hand(model, model.transformer.h[0], by_hand, corrupt).logits)


def test_under_vmap_each_row_is_its_own_call() -> None:
    """``torch.func.vmap`` of a capture function with a splice: outputs and recorded (edited)
    features equal the loop over the rows."""
    model, sae = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), SAE(8, 16)
    f = fh.capture(model, fh.sae.splice("0", sae, edit=fh.sae.ablate([1, 2])))
    xs = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(0))
    out, rec = torch.func.vmap(f)(xs)
    loop = [f(x) for x in xs]
    features = rec["0.sae"]["features"]
    assert features[..., [1, 2]].abs().max() == 0
    torch.testing.assert_close(out, torch.stack([o for o, _ in loop]))
    torch.testing.assert_close(features, torch.stack([r["0.sae"]["features"] for _, r in loop]))
