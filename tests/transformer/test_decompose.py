"""The residual stream as a sum of its writers (`decompose_resid`, `stack_head_results`) and
direct logit attribution (`logit_attrs`) on every pre-norm family, under eager and SDPA,
against the real stream and against the final norm and unembedding written by hand."""

from __future__ import annotations

import pytest
import torch
from test_heads import FAMILIES, _inputs, _perturbed

import funhooks as fh
from tests.transformer_models import ATTENTION, HEADS, LAYERS

PRE_NORM = sorted(set(FAMILIES) - {"bert"})


def _recorded(model, x, extra=()):
    pts = fh.transformer.points(model)
    specs = [*(fh.outputs(p) for p in pts.writers), fh.outputs(pts.resid_pre), fh.outputs(pts.resid_post[-1]), *extra]
    with torch.no_grad():
        return fh.capture(model, specs)(**x)


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("name", PRE_NORM)
def test_writers_sum_to_the_real_stream(name, attn, device):
    """Before every layer and at the final norm's input, the writers (embeddings, each head,
    each output projection's bias, each MLP) sum to the real residual stream; so do the rows
    with one `attn_out` per layer."""
    model = _perturbed(FAMILIES[name](attn), device)
    _, rec = _recorded(model, _inputs(name, device))
    real = {L: rec[f"blocks.{L}.resid_pre"]["output"] for L in range(LAYERS)}
    real[None] = rec[f"blocks.{LAYERS - 1}.resid_post"]["output"]
    for layer, stream in real.items():
        for heads in (True, False):
            d = fh.transformer.decompose_resid(model, rec, layer=layer, heads=heads)
            torch.testing.assert_close(d.resid.sum(0), stream, msg=lambda m, layer=layer: f"layer {layer}: {m}")
            torch.testing.assert_close(d.total, d.resid.sum(0))
    assert fh.transformer.decompose_resid(model, rec, layer=-1).labels == \
        fh.transformer.decompose_resid(model, rec, layer=LAYERS - 1).labels


def test_labels_say_each_writer_in_forward_order():
    """GPT-2's rows: embed, pos_embed, then per layer its heads, its bias and its MLP; a family
    without a bias on the output projection (Llama) and without a learned position embedding has no
    such rows; `heads=False` gives one `attn_out` row per layer."""
    gpt2, llama = FAMILIES["gpt2"](), FAMILIES["llama"]()
    _, rec = _recorded(gpt2, _inputs("gpt2", "cpu"))
    labels = fh.transformer.decompose_resid(gpt2, rec).labels

    def layer(L):
        return (*(f"blocks.{L}.heads.{h}" for h in range(HEADS)), f"blocks.{L}.attn_bias", f"blocks.{L}.mlp_out")

    assert labels == ("embed", "pos_embed", *layer(0), *layer(1))
    assert fh.transformer.decompose_resid(gpt2, rec, layer=1, heads=False).labels == (
        "embed", "pos_embed", "blocks.0.attn_out", "blocks.0.mlp_out")
    _, rec = _recorded(llama, _inputs("llama", "cpu"))
    assert fh.transformer.decompose_resid(llama, rec, layer=1).labels == (
        "embed", *(f"blocks.0.heads.{h}" for h in range(HEADS)), "blocks.0.mlp_out")
    assert fh.transformer.decompose_resid(llama, rec, layer=0).labels == ("embed",)


def test_stack_head_results_are_the_heads_rows():
    """`stack_head_results` keeps the head rows of the decomposition, and its `total` is still
    the whole stream."""
    model = _perturbed(FAMILIES["gpt2"](), "cpu")
    _, rec = _recorded(model, _inputs("gpt2", "cpu"))
    whole = fh.transformer.decompose_resid(model, rec)
    heads = fh.transformer.stack_head_results(model, rec)
    assert heads.labels == tuple(f"blocks.{L}.heads.{h}" for L in range(LAYERS) for h in range(HEADS))
    assert torch.equal(heads.resid, torch.stack([whole[label] for label in heads.labels]))
    assert torch.equal(heads.total, whole.total)


def _by_hand(model, name, rows, stream, token):
    """Each row's logit of `token` at the last position through the final norm frozen at
    `stream`'s scale, its weight and the unembedding's row of the token, written out."""
    rows, stream = rows[:, :, -1], stream[:, -1]
    if name in ("gpt2",) or name.startswith("neox"):
        norm = model.transformer.ln_f if name == "gpt2" else model.gpt_neox.final_layer_norm
        centred = rows - rows.mean(-1, keepdim=True)
        sd = ((stream - stream.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True).add(norm.eps).sqrt()
        normed = centred / sd * norm.weight
        bias = norm.bias @ model.get_output_embeddings().weight[token]
    else:
        norm = model.model.norm
        rms = stream.pow(2).mean(-1, keepdim=True).add(norm.variance_epsilon).sqrt()
        normed, bias = rows / rms * norm.weight, torch.zeros(())
    return normed @ model.get_output_embeddings().weight[token], bias


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("name", PRE_NORM)
def test_logit_attrs_equal_hand_math_and_sum_to_the_logit(name, attn, device):
    """Each writer's attribution is its row through the final norm frozen at the real stream's
    scale (LayerNorm: centred, over the real standard deviation; RMSNorm: over the real rms),
    times the norm's weight and the token's unembedding; they sum to the real logit less the
    norm's bias term (the unembedding has none); a difference of tokens is the difference."""
    model = _perturbed(FAMILIES[name](attn), device)
    out, rec = _recorded(model, _inputs(name, device))
    d = fh.transformer.decompose_resid(model, rec)
    attrs = fh.transformer.logit_attrs(model, d, 7)
    expected, bias = _by_hand(model, name, d.resid, rec[f"blocks.{LAYERS - 1}.resid_post"]["output"], 7)
    torch.testing.assert_close(attrs, expected)
    torch.testing.assert_close(attrs.sum(0) + bias, out.logits[:, -1, 7])
    tokens, wrong = torch.tensor([3, 4], device=device), torch.tensor([9, 1], device=device)
    diff = fh.transformer.logit_attrs(model, d, tokens, wrong, position=2)
    logit = out.logits[:, 2]
    bias_diff = 0.0 if not hasattr(model, "transformer") else \
        (model.transformer.ln_f.bias * (model.get_output_embeddings().weight[tokens] - model.get_output_embeddings().weight[wrong])).sum(-1)
    if name.startswith("neox"):
        norm = model.gpt_neox.final_layer_norm
        bias_diff = (norm.bias * (model.get_output_embeddings().weight[tokens] - model.get_output_embeddings().weight[wrong])).sum(-1)
    torch.testing.assert_close(diff.sum(0) + bias_diff,
                               logit.gather(-1, tokens[:, None])[:, 0] - logit.gather(-1, wrong[:, None])[:, 0])
    heads = fh.transformer.stack_head_results(model, rec)
    torch.testing.assert_close(fh.transformer.logit_attrs(model, heads, 7),
                               attrs[[d.labels.index(label) for label in heads.labels]])


def test_decompose_names_what_is_missing_or_wrong():
    """A Record without a writer, a post-norm model, a layer out of range, a plain stack or a
    stack of a layer's input given to `logit_attrs`: each error names the fix."""
    model = FAMILIES["gpt2"]()
    pts = fh.transformer.points(model)
    _, rec = fh.capture(model, fh.outputs(pts.embed))(**_inputs("gpt2", "cpu"))
    with pytest.raises(fh.RecordError) as err:
        fh.transformer.decompose_resid(model, rec)
    assert str(err.value) == ("decompose_resid: the Record holds the writers of the residual stream, got no "
                              "`pos_embed` among ['embed']. Record them with `[fh.outputs(p) for p in pts.writers]`.")
    bert = FAMILIES["bert"]()
    with pytest.raises(fh.SpecError, match="normalise the stream after each add"):
        fh.transformer.decompose_resid(bert, rec)
    with pytest.raises(ValueError, match=r"in \[-2, 2\]"):
        fh.transformer.decompose_resid(model, rec, layer=3)
    _, rec = _recorded(model, _inputs("gpt2", "cpu"))
    d = fh.transformer.decompose_resid(model, rec, layer=1)
    with pytest.raises(ValueError, match="`layer=None`"):
        fh.transformer.logit_attrs(model, d, 1)
    with pytest.raises(TypeError, match="is a Decomposition"):
        fh.transformer.logit_attrs(model, fh.transformer.ResidualStack(d.resid, d.labels), 1)
    with pytest.raises(TypeError, match="a token is an id"):
        fh.transformer.logit_attrs(model, fh.transformer.decompose_resid(model, rec), 1.5)


def test_logit_attrs_take_one_position_per_example():
    """`position` as a tensor takes each example's own position (the last real token of a padded
    prompt): each column equals the attribution at that example's position."""
    model = _perturbed(FAMILIES["llama"](), "cpu")
    _, rec = _recorded(model, _inputs("llama", "cpu"))
    d = fh.transformer.decompose_resid(model, rec)
    tokens = torch.tensor([3, 4])
    both = fh.transformer.logit_attrs(model, d, tokens, position=torch.tensor([2, 5]))
    torch.testing.assert_close(both[:, 0], fh.transformer.logit_attrs(model, d, tokens, position=2)[:, 0])
    torch.testing.assert_close(both[:, 1], fh.transformer.logit_attrs(model, d, tokens, position=5)[:, 1])
    with pytest.raises(TypeError, match="one per example"):
        fh.transformer.logit_attrs(model, d, tokens, position=torch.tensor([1, 2, 3]))
