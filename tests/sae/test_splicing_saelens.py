"""SAELens' SAEs spliced by funhooks into a TransformerLens model equal SAELens' own way of
running them (``HookedSAETransformer``, hooks on ``hook_sae_acts_post``): the recorded features
are its cached ones, ``error=False`` its reconstruction, an ablation or a steer its hooks with
the error term, for each of its inference architectures and for its ``hook_z`` SAEs (which
flatten the heads themselves). Skipped where sae_lens is not installed (the `sae` extra; CI
installs it)."""

from __future__ import annotations

import pytest
import torch

import funhooks as fh
from transformer_models import gpt2

sae_lens = pytest.importorskip("sae_lens", reason="sae_lens is not installed (the `sae` extra: pip install "
                               "'funhooks[sae]')")
transformer_lens = pytest.importorskip("transformer_lens")

RESID, Z = "blocks.0.hook_resid_post", "blocks.1.attn.hook_z"
SPARSE = "ignore:Sparse invariant checks are implicitly disabled:UserWarning"  # torch's notice on a COO tensor
TOKENS = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(0))
ARCHITECTURES = {
    "standard": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {}),
    "standard, b_dec subtracted": (sae_lens.StandardSAE, sae_lens.StandardSAEConfig, {"apply_b_dec_to_input": True}),
    "topk": (sae_lens.TopKSAE, sae_lens.TopKSAEConfig, {"k": 8}),
    "jumprelu": (sae_lens.JumpReLUSAE, sae_lens.JumpReLUSAEConfig, {}),
    "gated": (sae_lens.GatedSAE, sae_lens.GatedSAEConfig, {}),
    # a training SAE whose encode returns a sparse COO tensor: funhooks makes its features dense
    "topk, sparse activations": (sae_lens.TopKTrainingSAE, sae_lens.TopKTrainingSAEConfig,
                                 {"k": 8, "use_sparse_activations": True}),
}


def _model():
    torch.manual_seed(0)
    return sae_lens.HookedSAETransformer(transformer_lens.HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_vocab=50, act_fn="gelu",
        normalization_type="LN")).eval()


def _sae(architecture: str, hook: str, **config: object):
    cls, config_cls, own = ARCHITECTURES[architecture]
    sae = cls(config_cls(d_in=32, d_sae=64, **own, **config))
    sae.cfg.metadata.hook_name = hook
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sae.named_parameters():  # random weights; JumpReLU thresholds small and positive
            p.copy_(torch.rand(p.shape, generator=g) * 0.1 if "threshold" in name
                    else torch.randn(p.shape, generator=g) * 0.3)
    return sae


def _their_edit(model, sae, hook: str, fn):
    """SAELens' own edit: its SAE attached with the error term, a hook on the feature activations."""
    with model.saes(saes=[sae], use_error_term=True):
        return model.run_with_hooks(TOKENS, fwd_hooks=[(f"{hook}.hook_sae_acts_post", lambda acts, hook: fn(acts))])


def _equal_to_saelens(model, sae, hook: str) -> None:
    clean = model(TOKENS)
    _, cache = model.run_with_cache_with_saes(TOKENS, saes=[sae], use_error_term=True)
    out, rec = fh.capture(model, fh.sae.splice(hook, sae))(TOKENS)
    assert torch.equal(rec[f"{hook}.sae"]["features"], cache[f"{hook}.hook_sae_acts_post"])
    assert torch.equal(out, clean)
    reconstruction = fh.capture(model, fh.sae.splice(hook, sae, error=False, record=False))(TOKENS)[0]
    assert torch.equal(reconstruction, model.run_with_saes(TOKENS, saes=[sae], use_error_term=False))
    on, top = torch.arange(64) == 3, cache[f"{hook}.hook_sae_acts_post"].sum((0, 1)).topk(2).indices
    for ours, theirs in ((fh.sae.ablate(top.tolist()), lambda f: f.index_fill(-1, top, 0.0)),
                         (fh.sae.steer(3, 5.0), lambda f: f + 5.0 * on)):
        want = _their_edit(model, sae, hook, theirs)
        assert (want - clean).abs().max() > 0.1  # the edit reaches the logits
        out, rec = fh.capture(model, fh.sae.splice(hook, sae, edit=ours))(TOKENS)
        # SAELens adds its error term to the edited reconstruction, funhooks the edit's difference to x
        torch.testing.assert_close(out, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(rec[f"{hook}.sae"]["features"], theirs(cache[f"{hook}.hook_sae_acts_post"]))
    fh.testing.assert_no_hooks(model)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", SPARSE)
@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_each_architecture_spliced_is_saelens_own_run_of_it(architecture: str) -> None:
    model = _model()
    _equal_to_saelens(model, _sae(architecture, RESID), RESID)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", SPARSE)
def test_an_sae_whose_encode_is_sparse_records_and_evaluates_as_its_dense_twin() -> None:
    """SAELens' TopK training SAE with ``use_sparse_activations`` returns sparse features: the
    recorded features, an edit and every evaluation number are those of the same weights with
    dense features (a sparse tensor took no edit and no sum before)."""
    model, sparse = _model(), _sae("topk, sparse activations", RESID)
    dense = sae_lens.TopKTrainingSAE(sae_lens.TopKTrainingSAEConfig(d_in=32, d_sae=64, k=8))
    dense.load_state_dict(sparse.state_dict())
    assert sparse.encode(torch.randn(3, 32)).is_sparse and not dense.encode(torch.randn(3, 32)).is_sparse
    runs = [fh.capture(model, fh.sae.splice(RESID, sae, edit=fh.sae.steer(3, 5.0)))(TOKENS) for sae in (sparse, dense)]
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1][f"{RESID}.sae"]["features"], runs[1][1][f"{RESID}.sae"]["features"])
    ours, want = (fh.sae.evaluate(sae, [TOKENS], model=model, where=RESID) for sae in (sparse, dense))
    assert (ours.mse, ours.l0, ours.ce_spliced, ours.kl) == (want.mse, want.l0, want.ce_spliced, want.kl)
    assert torch.equal(ours.density, want.density)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_a_hook_z_sae_flattening_the_heads_itself_gets_them_as_they_are() -> None:
    """SAELens' ``hook_z`` SAEs (``reshape_activations="hook_z"``, as its attention SAEs load)
    flatten ``(..., heads, d_head)`` in their own ``encode`` and unflatten in ``decode``:
    funhooks hands them the heads unflattened (flattening them first made the SAE flatten
    positions into heads: a shape error)."""
    model = _model()
    _equal_to_saelens(model, _sae("standard", Z, reshape_activations="hook_z"), Z)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_a_hook_z_sae_at_a_hugging_face_models_z_point_and_evaluated_there() -> None:
    """The same SAE at GPT-2's per-head point ``pts.z`` (the output projection's input, viewed
    as heads): its features are its own ``encode`` of the heads; an ablation is its ``decode``
    of the edited features plus the error term; evaluation runs on the heads too."""
    model, sae = gpt2(), _sae("standard", Z, reshape_activations="hook_z")
    pts = fh.transformer.points(model)
    z = fh.capture(model, fh.outputs(pts.z[1]))(TOKENS)[1]["blocks.1.z"]["output"]
    assert z.shape == (2, 7, 4, 8)
    out, rec = fh.capture(model, fh.sae.splice(pts.z[1], sae, edit=fh.sae.ablate([0, 5])))(TOKENS)
    f = sae.encode(z)
    assert torch.equal(rec["blocks.1.z.sae"]["features"], f.index_fill(-1, torch.tensor([0, 5]), 0.0))

    def by_hand(module: torch.nn.Module, args: tuple) -> tuple:
        g = f.index_fill(-1, torch.tensor([0, 5]), 0.0)
        return (args[0] + (sae.decode(g) - sae.decode(f)).flatten(-2),)

    handle = model.transformer.h[1].attn.c_proj.register_forward_pre_hook(by_hand)
    try:
        want = model(TOKENS).logits
    finally:
        handle.remove()
    torch.testing.assert_close(out.logits, want, rtol=0, atol=1e-6)
    with torch.no_grad():
        mse = float(((z - sae.decode(f)) ** 2).flatten(-2).sum(-1).mean())
    result = fh.sae.evaluate(sae, [TOKENS], model=model, where=pts.z[1])
    assert result.rows == 14 and result.mse == pytest.approx(mse, rel=1e-5)
    result = fh.sae.evaluate(sae, [z])  # stored activations, heads unflattened
    assert result.rows == 14 and result.mse == pytest.approx(mse, rel=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_a_hook_z_sae_given_flattened_heads_is_refused_with_the_fix() -> None:
    """Flattened activations (a store's rows) cannot be unflattened by funhooks: the SAE that
    flattens the heads itself is refused, naming SAELens' switch for flattened input."""
    sae = _sae("standard", Z, reshape_activations="hook_z")
    with pytest.raises(fh.SpecError, match=r"flattens per-head values.*itself.*already flattened.*turn_off_forward_pass_hook_z_reshaping"):
        fh.sae.evaluate(sae, [torch.randn(5, 32)])
    sae.turn_off_forward_pass_hook_z_reshaping()
    assert fh.sae.evaluate(sae, [torch.randn(5, 32)]).rows == 5
