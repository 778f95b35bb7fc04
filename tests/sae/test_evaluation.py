"""An SAE's evaluation: every number equal to hand math, on activations (lists, an
``ActivationStream``) and on token batches; equal to SAELens' own evaluation functions on the
same SAE and model where sae_lens and transformer_lens are installed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import funhooks as fh
from sae_kit import SAE, hand
from transformer_models import gpt2


@torch.no_grad()
def _by_hand(sae: SAE, x: torch.Tensor) -> dict[str, object]:
    x = x.reshape(-1, x.shape[-1]).double()
    f = sae.encode(x.float()).double()
    x_hat = sae.decode(f.float()).double()
    mse = float(((x - x_hat) ** 2).sum(-1).mean())
    variance = float((x ** 2).sum(-1).mean() - (x.mean(0) ** 2).sum())
    return {"mse": mse, "ev": 1 - mse / variance, "l0": float((f != 0).sum(-1).double().mean()),
            "density": (f != 0).double().mean(0)}


def test_on_activations_each_number_is_the_hand_math() -> None:
    sae = SAE(8, 16)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(5, 8, generator=g), torch.randn(2, 3, 8, generator=g)]
    result = fh.sae.evaluate(sae, batches, dead_below=0.2, dense_above=0.5)
    want = _by_hand(sae, torch.cat([batches[0], batches[1].reshape(-1, 8)]))
    assert result.rows == 11
    assert result.mse == pytest.approx(want["mse"], rel=1e-6)
    assert result.explained_variance == pytest.approx(want["ev"], rel=1e-6)
    assert result.l0 == pytest.approx(want["l0"], rel=1e-12)
    assert torch.allclose(result.density, want["density"])  # type: ignore[arg-type]
    assert result.dead == int((want["density"] < 0.2).sum())  # type: ignore[operator]
    assert result.dense == int((want["density"] > 0.5).sum())  # type: ignore[operator]
    assert "explained variance" in repr(result) and "dead" in repr(result)


def test_on_an_activation_stream(tmp_path) -> None:
    pytest.importorskip("safetensors")
    model, sae = gpt2(), SAE()
    pts = fh.transformer.points(model)
    writer = fh.ActivationWriter(model, fh.outputs(pts.resid_post[0]), str(tmp_path), flatten=True)
    ds = fh.collect(writer, [torch.arange(12).reshape(2, 6) % 50, torch.arange(12, 24).reshape(2, 6) % 50])
    stream = fh.ActivationStream(ds, batch_size=10, shuffle=False)
    result = fh.sae.evaluate(sae, stream)
    want = _by_hand(sae, ds[:][next(iter(ds.columns))])
    assert result.rows == len(ds) == 24
    assert result.mse == pytest.approx(want["mse"], rel=1e-6)
    assert result.explained_variance == pytest.approx(want["ev"], rel=1e-6)


def test_on_token_batches_the_downstream_numbers_are_the_hand_math() -> None:
    model, sae = gpt2(), SAE(scale=0.1)
    pts = fh.transformer.points(model)
    ids = torch.arange(24).reshape(4, 6) % 50
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    batches = [{"input_ids": ids[:2], "attention_mask": mask[:2]}, {"input_ids": ids[2:], "attention_mask": mask[2:]}]
    result = fh.sae.evaluate(sae, batches, model=model, where=pts.resid_post[0])
    block = model.transformer.h[0]
    ce, kl, xs = [0.0, 0.0, 0.0], [0.0, 0.0], []
    for b in batches:
        with torch.no_grad():
            clean = model(**b).logits.double()
            spliced = hand(model, block, lambda x: sae.decode(sae.encode(x)), **b).logits.double()
            ablated = hand(model, block, torch.zeros_like, **b).logits.double()
            xs.append(model(**b, output_hidden_states=True).hidden_states[1][b["attention_mask"].bool()])
        keep = b["attention_mask"].bool()
        for i, logits in enumerate((clean, spliced, ablated)):
            lp = logits[:, :-1].log_softmax(-1).gather(-1, b["input_ids"][:, 1:, None])[..., 0]
            ce[i] += float(-lp[keep[:, 1:]].sum())
        p = clean.softmax(-1)
        for i, logits in enumerate((spliced, ablated)):
            kl[i] += float((p * (clean.log_softmax(-1) - logits.log_softmax(-1))).sum(-1)[keep].sum())
    tokens, positions = int(mask[:, 1:].sum()), int(mask.sum())
    assert result.ce_clean == pytest.approx(ce[0] / tokens, rel=1e-6)
    assert result.ce_spliced == pytest.approx(ce[1] / tokens, rel=1e-6)
    assert result.ce_ablated == pytest.approx(ce[2] / tokens, rel=1e-6)
    recovered = (ce[2] - ce[1]) / (ce[2] - ce[0])
    assert result.ce_loss_recovered == pytest.approx(recovered, rel=1e-5)
    assert result.kl == pytest.approx(kl[0] / positions, rel=1e-5)
    assert result.kl_ablated == pytest.approx(kl[1] / positions, rel=1e-5)
    want = _by_hand(sae, torch.cat(xs))
    assert result.rows == positions == 22
    assert result.mse == pytest.approx(want["mse"], rel=1e-6)
    assert "CE loss recovered" in repr(result)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(fh.SpecError, match="`model` and `where` come together"):
        fh.sae.evaluate(SAE(), [], model=gpt2())
    with pytest.raises(fh.SpecError, match="no rows"):
        fh.sae.evaluate(SAE(), [])
    with pytest.raises(fh.SpecError, match="d_in=32, got activations of width 8"):
        fh.sae.evaluate(SAE(), [torch.randn(2, 8)])


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")
@pytest.mark.parametrize("hook", ["blocks.0.hook_resid_post", "blocks.0.attn.hook_z"])
def test_equal_to_saelens_evaluation_functions_on_the_same_sae_and_model(hook: str) -> None:
    """SAELens evaluates on a TransformerLens model: funhooks evaluates the same SAE on that same
    model at the same hook point (a module path), and the numbers agree; at ``hook_z`` an SAE
    flattening the heads itself, as SAELens loads its attention SAEs (its evals turn that off
    and flatten the heads for it)."""
    sae_lens = pytest.importorskip("sae_lens", reason="sae_lens is not installed (the `sae` extra: pip "
                                   "install 'funhooks[sae]')")
    transformer_lens = pytest.importorskip("transformer_lens")
    from sae_lens import evals

    torch.manual_seed(0)
    model = transformer_lens.HookedTransformer(transformer_lens.HookedTransformerConfig(
        n_layers=2, d_model=32, n_ctx=16, d_head=8, n_heads=4, d_vocab=50, act_fn="gelu", normalization_type="LN"))
    model.eval()
    heads = hook.endswith("hook_z")
    sae = sae_lens.StandardSAE(sae_lens.StandardSAEConfig(d_in=32, d_sae=64,
                                                          reshape_activations="hook_z" if heads else "none"))
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    tokens = torch.randint(0, 50, (4, 10), generator=torch.Generator().manual_seed(0))
    sae.turn_off_forward_pass_hook_z_reshaping()  # SAELens' evals flatten the heads themselves
    theirs = evals.get_recons_loss(sae, model, evals.ActivationScaler(), tokens, compute_kl=True, compute_ce_loss=True,
                                   hook_name=hook)
    _, cache = model.run_with_cache(tokens, names_filter=hook)
    x = cache[hook].reshape(-1, 32)
    calc = evals.ExplainedVarianceCalculator()
    with torch.no_grad():
        calc.add_batch(sae.decode(sae.encode(x)), x)
    if heads:
        sae.turn_on_forward_pass_hook_z_reshaping()
    ours = fh.sae.evaluate(sae, [tokens], model=model, where=hook)
    assert ours.ce_clean == pytest.approx(float(theirs["ce_loss_without_sae"].mean()), rel=1e-5)
    assert ours.ce_spliced == pytest.approx(float(theirs["ce_loss_with_sae"].mean()), rel=1e-5)
    assert ours.ce_ablated == pytest.approx(float(theirs["ce_loss_with_ablation"].mean()), rel=1e-5)
    assert ours.kl == pytest.approx(float(theirs["kl_div_with_sae"].mean()), rel=1e-4)
    assert ours.kl_ablated == pytest.approx(float(theirs["kl_div_with_ablation"].mean()), rel=1e-4)
    assert ours.explained_variance == pytest.approx(calc.compute(), rel=1e-5)


def test_recovered_is_nan_where_ablating_the_point_changes_nothing() -> None:
    """A point the logits do not depend on (a module path whose output nothing reads): no gap
    between clean and ablated, so no fraction of it recovered."""
    import math

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm, self.unused = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 50)), nn.Identity()

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            self.unused(torch.zeros(*ids.shape, 32))
            return self.lm(ids)

    result = fh.sae.evaluate(SAE(), [torch.arange(12).reshape(2, 6)], model=Reads(), where="unused")
    assert result.ce_clean == result.ce_spliced == result.ce_ablated
    assert math.isnan(result.ce_loss_recovered) and math.isnan(result.kl_recovered)
