"""`decompose_resid`, `stack_head_results` and `logit_attrs` equal TransformerLens' on the same
GPT-2 weights: a Hugging Face GPT2LMHeadModel from a small config with random weights, loaded into
a HookedTransformer by TransformerLens' own weight conversion. Skipped where transformer_lens is
not installed (the `bench` extra)."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_heads import FAMILIES, _perturbed

import funhooks as fh

pytest.importorskip("transformer_lens", reason="TransformerLens is not installed (the `bench` extra installs it)")


def _tl(hf, **processing):
    """A HookedTransformer holding `hf`'s weights, processed as `processing` says."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights

    c = hf.config
    cfg = HookedTransformerConfig(
        d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_heads=c.n_head, n_layers=c.n_layer, n_ctx=c.n_positions,
        d_vocab=c.vocab_size, d_mlp=4 * c.n_embd, act_fn="gelu_new", normalization_type="LN",
        eps=c.layer_norm_epsilon, original_architecture="GPT2LMHeadModel", default_prepend_bos=False,
        device=str(next(hf.parameters()).device))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.9 points to its Bridge; HookedTransformer is 3.9's
        tl = HookedTransformer(cfg)
    tl.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), **processing)
    return tl.eval()


RAW = {"fold_ln": True, "center_writing_weights": False, "center_unembed": False, "fold_value_biases": False}
"""TransformerLens' processing that keeps each head's result and each token's logit as the Hugging Face
model has them: the final norm's weight folded into the unembedding (as logit_attrs needs), nothing centred,
the value biases left in the heads."""


def test_equal_to_transformer_lens_on_the_same_gpt2_weights(device):
    """The writers (`heads=False`: TransformerLens' embed, pos_embed, L_attn_out, L_mlp_out), the heads'
    results (`L0H0` ...) and the logit and logit-difference attributions at the last position equal
    TransformerLens 3.9's `decompose_resid`, `stack_head_results` and `logit_attrs`."""
    hf = _perturbed(FAMILIES["gpt2"](), device)
    tl = _tl(hf, **RAW)
    ids = (torch.arange(12).reshape(2, 6) % 50).to(device)
    with torch.no_grad():
        tl_logits, cache = tl.run_with_cache(ids)
        out, rec = fh.capture(hf, [fh.outputs(p) for p in fh.transformer.points(hf).writers])(ids)
    torch.testing.assert_close(tl_logits, out.logits, atol=1e-5, rtol=1e-5)
    layers = fh.transformer.decompose_resid(hf, rec, heads=False)
    tl_layers, tl_labels = cache.decompose_resid(return_labels=True)
    assert [label.replace("blocks.", "").replace(".", "_") for label in layers.labels] == tl_labels
    torch.testing.assert_close(layers.resid, tl_layers, atol=1e-5, rtol=1e-5)
    heads = fh.transformer.stack_head_results(hf, rec)
    tl_heads, tl_head_labels = cache.stack_head_results(return_labels=True)
    assert [f"L{label.split('.')[1]}H{label.split('.')[3]}" for label in heads.labels] == tl_head_labels
    torch.testing.assert_close(heads.resid, tl_heads, atol=1e-5, rtol=1e-5)
    tokens, wrong = torch.tensor([3, 4], device=device), torch.tensor([9, 1], device=device)
    for stack, tl_stack in ((heads, tl_heads), (layers, tl_layers)):
        torch.testing.assert_close(fh.transformer.logit_attrs(hf, stack, tokens, wrong),
                                   cache.logit_attrs(tl_stack[:, :, -1], tokens, wrong, pos_slice=-1),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fh.transformer.logit_attrs(hf, stack, 7),
                                   cache.logit_attrs(tl_stack[:, :, -1], 7, pos_slice=-1), atol=1e-5, rtol=1e-5)


def test_logit_differences_equal_transformer_lens_default_processing():
    """Under TransformerLens' default processing (writing weights and unembedding centred, value biases
    folded into b_O), each layer's attribution to a logit difference is unchanged: the final norm's
    centring removes what centring the writers moved, and a difference removes the unembedding's
    centring."""
    hf = _perturbed(FAMILIES["gpt2"](), "cpu")
    tl = _tl(hf, fold_ln=True, center_writing_weights=True, center_unembed=True, fold_value_biases=True)
    ids = torch.arange(12).reshape(2, 6) % 50
    with torch.no_grad():
        _, cache = tl.run_with_cache(ids)
        _, rec = fh.capture(hf, [fh.outputs(p) for p in fh.transformer.points(hf).writers])(ids)
    tokens, wrong = torch.tensor([3, 4]), torch.tensor([9, 1])
    torch.testing.assert_close(
        fh.transformer.logit_attrs(hf, fh.transformer.decompose_resid(hf, rec, heads=False), tokens, wrong),
        cache.logit_attrs(cache.decompose_resid()[:, :, -1], tokens, wrong, pos_slice=-1), atol=1e-5, rtol=1e-5)
