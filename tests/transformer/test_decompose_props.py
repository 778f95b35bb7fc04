"""Hypothesis properties of the per-head writes on random small configs and inputs of every
pre-norm family: the heads' results plus the output projection's bias are `attn_out`, and the
writers sum to the residual stream before every layer and at the final norm; a logit's
attributions sum to the logit less the bias terms."""

from __future__ import annotations

import hypothesis
import torch
import transformers
from hypothesis import strategies as st

import funhooks as fh

transformers.logging.set_verbosity_error()
VOCAB = 40


@st.composite
def models(draw):
    """A random small pre-norm model (family, layers, heads, head width, attention implementation,
    biases), its weights moved off their init by a drawn seed, and token ids."""
    family = draw(st.sampled_from(["gpt2", "neox", "llama", "qwen2"]))
    layers, heads = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 4]))
    d_head = 8 if family == "neox" else draw(st.sampled_from([4, 8]))  # NeoX rotates a quarter of a head
    attn = draw(st.sampled_from(["eager", "sdpa"]))
    hidden, kv = heads * d_head, draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    common = {"vocab_size": VOCAB, "attn_implementation": attn}
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, n_positions=16, **common)
        cls = transformers.GPT2LMHeadModel
    elif family == "neox":
        config = transformers.GPTNeoXConfig(
            hidden_size=hidden, num_attention_heads=heads, num_hidden_layers=layers, intermediate_size=2 * hidden,
            max_position_embeddings=16, use_parallel_residual=draw(st.booleans()), **common)
        cls = transformers.GPTNeoXForCausalLM
    else:
        config_cls, cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
        extra = {"attention_bias": draw(st.booleans())} if family == "llama" else {}
        config = config_cls(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                            num_hidden_layers=layers, intermediate_size=2 * hidden, max_position_embeddings=16,
                            **common, **extra)
    torch.manual_seed(draw(st.integers(0, 2**16)))
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    batch, length = draw(st.integers(1, 3)), draw(st.integers(1, 7))
    ids = torch.randint(0, VOCAB, (batch, length))
    return model, ids


@hypothesis.settings(suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture,
                                           hypothesis.HealthCheck.too_slow])
@hypothesis.given(models())
def test_writers_sum_to_every_resid_and_heads_to_attn_out(device, drawn):
    """For any small model and input: sum over heads of `result` + b_O == `attn_out`; the writers
    before layer L sum to `resid_pre[L]`, all of them to the final norm's input; the attributions
    of a token's logit sum to the logit less the final norm's bias term."""
    model, ids = drawn[0].to(device), drawn[1].to(device)
    pts = fh.transformer.points(model)
    specs = [*(fh.outputs(p) for p in pts.writers), fh.outputs(pts.attn_out), fh.outputs(pts.resid_pre),
             fh.outputs(pts.resid_post[-1])]
    with torch.no_grad():
        out, rec = fh.capture(model, specs)(ids)
    for layer in range(pts.n_layers):
        torch.testing.assert_close(
            rec[f"blocks.{layer}.result"]["output"].sum(-2) + fh.transformer.head_weights(model, layer).b_O,
            rec[f"blocks.{layer}.attn_out"]["output"], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fh.transformer.decompose_resid(model, rec, layer=layer).resid.sum(0),
                                   rec[f"blocks.{layer}.resid_pre"]["output"], atol=1e-5, rtol=1e-4)
    whole = fh.transformer.decompose_resid(model, rec)
    torch.testing.assert_close(whole.resid.sum(0), rec[f"blocks.{pts.n_layers - 1}.resid_post"]["output"],
                               atol=1e-5, rtol=1e-4)
    norm = model.get_submodule(pts.final_norm.paths[0][1])
    bias = getattr(norm, "bias", None)
    bias_term = 0.0 if bias is None else bias @ model.get_output_embeddings().weight[5]
    torch.testing.assert_close(fh.transformer.logit_attrs(model, whole, 5).sum(0) + bias_term,
                               out.logits[:, -1, 5], atol=1e-4, rtol=1e-4)
