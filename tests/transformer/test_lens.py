"""fh.transformer's logit lens: unembed, logit_lens and accumulated_resid, each checked against
the model's own logits and against the final norm and unembedding computed by hand, on GPT-2,
Llama (tied and untied), GPT-NeoX (parallel and sequential residual) and BERT (MLM head)."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch
import transformers
from hypothesis import given, settings
from torch import nn
from torch.nn import functional as F

import funhooks as fh
from tests.transformer_models import bert, gpt2, llama, neox

IDS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
MODELS: dict[str, nn.Module] = {
    "gpt2": gpt2("sdpa"),
    "llama-untied": llama("sdpa"),
    "llama-tied": llama("sdpa", tie_word_embeddings=True),
    "neox-parallel": neox("sdpa", intermediate_size=64),
    "neox-sequential": neox("sdpa", parallel=False, intermediate_size=64),
    "bert": bert("sdpa"),
}

def _kwargs(model: nn.Module) -> dict[str, torch.Tensor]:
    """BERT runs with padding in its attention mask; the causal models on the plain ids."""
    return {"attention_mask": MASK} if isinstance(model, transformers.BertForMaskedLM) else {}


def _residuals(model: nn.Module, ids: torch.Tensor, **kwargs: torch.Tensor) -> tuple[torch.Tensor, fh.Record]:
    """The model's logits and a Record of ``resid_pre`` and ``resid_post`` of every layer, from
    the standard points."""
    pts = fh.transformer.points(model)
    out, rec = fh.capture(model, [fh.outputs(pts.resid_pre), fh.outputs(pts.resid_post)])(ids, **kwargs)
    return out.logits, rec


def _by_hand(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The final norm and unembedding in plain math, from the weights (tied: the embedding's)."""
    if isinstance(model, transformers.GPT2LMHeadModel):
        ln = model.transformer.ln_f
        return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps) @ model.transformer.wte.weight.T
    if isinstance(model, transformers.LlamaForCausalLM):
        norm = model.model.norm
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
        unembedding = model.model.embed_tokens.weight if model.config.tie_word_embeddings else model.lm_head.weight
        return normed @ unembedding.T
    if isinstance(model, transformers.GPTNeoXForCausalLM):
        ln = model.gpt_neox.final_layer_norm
        head = model.get_output_embeddings()   # `lm_head` from transformers 5 on, `embed_out` before
        return F.layer_norm(x, (x.shape[-1],), ln.weight, ln.bias, ln.eps) @ head.weight.T
    assert isinstance(model, transformers.BertForMaskedLM)
    t = model.cls.predictions.transform
    h = F.gelu(x @ t.dense.weight.T + t.dense.bias)
    h = F.layer_norm(h, (h.shape[-1],), t.LayerNorm.weight, t.LayerNorm.bias, t.LayerNorm.eps)
    return h @ model.bert.embeddings.word_embeddings.weight.T + model.cls.predictions.bias


@pytest.mark.parametrize("name", MODELS)
def test_unembed_of_the_last_resid_post_is_the_models_logits(name: str) -> None:
    model = MODELS[name]
    logits, rec = _residuals(model, IDS, **_kwargs(model))
    got = fh.transformer.unembed(model, rec["blocks.1.resid_post"]["output"])
    torch.testing.assert_close(got, logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_unembed_equals_the_final_norm_and_unembedding_by_hand(name: str) -> None:
    model = MODELS[name]
    _, rec = _residuals(model, IDS, **_kwargs(model))
    resid = rec["blocks.0.resid_post"]["output"]
    torch.testing.assert_close(fh.transformer.unembed(model, resid), _by_hand(model, resid), atol=1e-5, rtol=1e-5)


def test_the_tied_and_untied_models_really_differ_in_their_unembedding() -> None:
    """The by-hand reference reads the embedding for tied models: the test above would not see
    a lens that read the wrong matrix unless the two are distinct objects for untied models."""
    assert MODELS["gpt2"].lm_head.weight is MODELS["gpt2"].transformer.wte.weight
    assert MODELS["llama-tied"].lm_head.weight is MODELS["llama-tied"].model.embed_tokens.weight
    untied = MODELS["llama-untied"]
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), shape=st.lists(st.integers(1, 3), min_size=0, max_size=3),
       seed=st.integers(0, 2**16), scale=st.floats(0.01, 100.0))
def test_lens_logits_of_any_residual_equal_the_norm_and_head_by_hand(name: str, shape: list[int], seed: int,
                                                                     scale: float) -> None:
    model = MODELS[name]
    x = torch.randn(*shape, 32, generator=torch.Generator().manual_seed(seed)) * scale
    got = fh.transformer.unembed(model, x)
    assert got.shape == (*shape, 50)
    torch.testing.assert_close(got, _by_hand(model, x), atol=1e-4, rtol=1e-4)
    stacked = torch.stack([x, 2 * x])
    torch.testing.assert_close(fh.transformer.logit_lens(model, stacked).logits[1], _by_hand(model, 2 * x),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_logit_lens_reads_every_residual_point_of_a_record_in_depth_order(name: str) -> None:
    model = MODELS[name]
    logits, rec = _residuals(model, IDS, **_kwargs(model))
    shuffled = fh.Record({p: {"output": [rec[p]["output"]]} for p in reversed(list(rec))})
    lens = fh.transformer.logit_lens(model, shuffled)
    assert lens.labels == ("blocks.0.resid_pre", "blocks.0.resid_post", "blocks.1.resid_pre", "blocks.1.resid_post")
    assert lens.logits.shape == (4, 2, 5, 50)
    for i, label in enumerate(lens.labels):
        torch.testing.assert_close(lens.logits[i], _by_hand(model, rec[label]["output"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lens["blocks.1.resid_post"], logits, atol=1e-5, rtol=1e-5)


def test_logit_lens_leaves_out_points_that_are_not_the_residual_stream() -> None:
    model = MODELS["gpt2"]
    pts = fh.transformer.points(model)
    _, rec = _residuals(model, IDS)
    _, more = fh.capture(model, [fh.outputs(pts.embed), fh.outputs(pts.resid_pre), fh.outputs(pts.attn_out[0]),
                                 fh.outputs(pts.resid_post), fh.outputs(pts.logits)])(IDS)
    assert "blocks.0.attn_out" in more and "embed" in more
    assert fh.transformer.logit_lens(model, more).labels == fh.transformer.logit_lens(model, rec).labels


@pytest.mark.parametrize("name", MODELS)
def test_the_lens_on_a_record_of_every_residual_point_equals_the_norm_and_head_by_hand(name: str) -> None:
    """A Record of the points resid_pre, resid_mid (where the family has one) and resid_post is
    read in depth order by logit_lens and by accumulated_resid(incl_mid=True)."""
    model = MODELS[name]
    pts = fh.transformer.points(model)
    wanted = [p for p in (pts.resid_pre, pts.resid_mid, pts.resid_post) if p.kind != "none"]
    logits, rec = fh.capture(model, [fh.outputs(p) for p in wanted])(IDS, **_kwargs(model))
    lens = fh.transformer.logit_lens(model, rec)
    names = [p.name for p in wanted]
    assert lens.labels == tuple(f"blocks.{L}.{n}" for L in range(2) for n in names)
    for i, label in enumerate(lens.labels):
        torch.testing.assert_close(lens.logits[i], _by_hand(model, rec[label]["output"]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lens["blocks.1.resid_post"], logits.logits, atol=1e-5, rtol=1e-5)
    if pts.resid_mid.kind != "none":
        stack = fh.transformer.accumulated_resid(model, rec, incl_mid=True)
        assert stack.labels == ("blocks.0.resid_pre", "blocks.0.resid_mid", "blocks.1.resid_pre",
                                "blocks.1.resid_mid", "blocks.1.resid_post")


def test_logit_lens_of_a_tensor_labels_its_rows_by_index() -> None:
    model = MODELS["llama-untied"]
    x = torch.randn(3, 2, 4, 32)
    lens = fh.transformer.logit_lens(model, x)
    assert lens.labels == ("0", "1", "2") and len(lens) == 3
    torch.testing.assert_close(lens.logits, _by_hand(model, x), atol=1e-5, rtol=1e-5)


def test_the_lens_helpers_equal_softmax_sort_and_topk_by_hand() -> None:
    model = MODELS["gpt2"]
    _, rec = _residuals(model, IDS)
    lens = fh.transformer.logit_lens(model, rec)
    probs = torch.softmax(lens.logits, -1)
    torch.testing.assert_close(lens.probs(), probs)
    torch.testing.assert_close(lens.prob(7), probs[..., 7])
    order = lens.logits.argsort(-1, descending=True)
    torch.testing.assert_close(lens.rank(7), (order == 7).int().argmax(-1))
    answers = torch.tensor([[7], [9]])      # one answer per example, (batch, 1)
    torch.testing.assert_close(lens.prob(answers)[:, 1], probs[:, 1, :, 9])
    top = lens.top(3)
    torch.testing.assert_close(top.indices, order[..., :3])
    torch.testing.assert_close(top.values, probs.gather(-1, order[..., :3]))


def test_accumulated_resid_stacks_every_resid_pre_and_the_last_resid_post() -> None:
    model = MODELS["gpt2"]
    logits, rec = _residuals(model, IDS)
    stack = fh.transformer.accumulated_resid(model, rec)
    assert stack.labels == ("blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.resid_post")
    assert not stack.normed
    expected = torch.stack([rec[label]["output"] for label in stack.labels])
    assert torch.equal(stack.resid, expected)
    # GPT-2's resid_pre of layer 0 is the embeddings plus positions, as TransformerLens has it
    by_hand = model.transformer.wte(IDS) + model.transformer.wpe(torch.arange(5))
    torch.testing.assert_close(stack["blocks.0.resid_pre"], by_hand)
    torch.testing.assert_close(fh.transformer.logit_lens(model, stack).logits[-1], logits, atol=1e-5, rtol=1e-5)


def test_accumulated_resid_with_apply_ln_is_the_final_norm_and_is_not_normed_twice() -> None:
    model = MODELS["llama-tied"]
    _, rec = _residuals(model, IDS)
    plain = fh.transformer.accumulated_resid(model, rec)
    normed = fh.transformer.accumulated_resid(model, rec, apply_ln=True)
    assert normed.normed and normed.labels == plain.labels
    norm = model.model.norm
    by_hand = plain.resid * torch.rsqrt(plain.resid.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    torch.testing.assert_close(normed.resid, by_hand)
    torch.testing.assert_close(fh.transformer.logit_lens(model, normed).logits,
                               fh.transformer.logit_lens(model, plain).logits, atol=1e-5, rtol=1e-5)


def test_accumulated_resid_apply_ln_on_bert_which_has_no_final_norm_changes_nothing() -> None:
    model = MODELS["bert"]
    _, rec = _residuals(model, IDS, **_kwargs(model))
    assert torch.equal(fh.transformer.accumulated_resid(model, rec, apply_ln=True).resid,
                       fh.transformer.accumulated_resid(model, rec).resid)


def test_accumulated_resid_names_the_point_the_record_lacks() -> None:
    model = MODELS["gpt2"]
    _, rec = _residuals(model, IDS)
    with pytest.raises(fh.RecordError) as info:
        fh.transformer.accumulated_resid(model, rec, incl_mid=True)
    assert str(info.value) == (
        f"accumulated_resid: the Record holds no `blocks.0.resid_mid`, got paths {list(rec)}. "
        "Record every residual point it needs, e.g. `fh.outputs(points.resid_pre)`.")


def test_logit_lens_of_a_record_without_residual_points_says_which_it_reads() -> None:
    rec = fh.Record({"embed": {"output": [torch.zeros(1, 2, 32)]}})
    with pytest.raises(fh.RecordError) as info:
        fh.transformer.logit_lens(MODELS["gpt2"], rec)
    assert str(info.value) == (
        "logit_lens: the Record holds residual points `blocks.{L}.resid_pre` / `resid_mid` / `resid_post`, "
        "got paths ['embed']. Record them with `fh.outputs(points.resid_post)`.")


def test_unembed_refuses_a_model_without_its_head_naming_the_missing_module() -> None:
    base = MODELS["gpt2"].transformer
    with pytest.raises(fh.SelectorError) as info:
        fh.transformer.unembed(base, torch.zeros(1, 32))
    assert str(info.value) == (
        "unembed: the 'gpt2' family keeps its unembedding at `lm_head`, got a GPT2Model without it. Pass the model "
        "with its language-modelling head (e.g. `GPT2LMHeadModel`, `LlamaForCausalLM`, `BertForMaskedLM`), or fix "
        "the family with `fh.transformer.register`.")


def test_unembed_refuses_a_residual_of_the_wrong_width_or_type() -> None:
    with pytest.raises(ValueError) as info:
        fh.transformer.unembed(MODELS["gpt2"], torch.zeros(2, 5, 16))
    assert str(info.value) == ("unembed: `resid` ends in the model's width d_model=32, got shape (2, 5, 16). "
                               "Pass a residual stream of this model (hidden size last).")
    with pytest.raises(TypeError, match=r"^unembed: `resid` is a tensor `\(\.\.\., d_model\)`, got \[1, 2\]"):
        fh.transformer.unembed(MODELS["gpt2"], [1, 2])  # type: ignore[arg-type]


def test_the_lens_refuses_a_float_token() -> None:
    lens = fh.transformer.LogitLens(torch.zeros(1, 1, 2, 5), ("0",))
    with pytest.raises(TypeError) as info:
        lens.rank(1.5)  # type: ignore[arg-type]
    assert str(info.value) == "LogitLens: `token` is a token id (an int or an integer tensor), got 1.5."


def test_lens_values_are_frozen() -> None:
    lens = fh.transformer.LogitLens(torch.zeros(1, 1, 2, 5), ("0",))
    with pytest.raises(fh.FrozenError):
        lens.labels = ("1",)  # type: ignore[misc]
