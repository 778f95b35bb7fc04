"""Per-head writes: the `result` point (each head's output after the output projection) and
`head_weights` on every family, under eager and SDPA, checked against plain hooks and matmuls
written by hand."""

from __future__ import annotations

import pytest
import torch
import transformers

import funhooks as fh
from tests.transformer_models import ATTENTION, BUILDERS, HEADS, HIDDEN, LAYERS, POSITIONS, VOCAB, inputs


def _perturbed(model, device):
    """`model` on `device` with every parameter moved off its init (norm weights off 1, biases
    off 0), so that no bias or norm weight is left out of a check by being trivial."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model.to(device)


def qwen2(attn: str = "eager"):
    """Qwen2: biases on q, k, v and none on o (a Llama kin)."""
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=2,
        num_hidden_layers=LAYERS, intermediate_size=64, max_position_embeddings=POSITIONS,
        attn_implementation=attn)).eval()


FAMILIES = {**BUILDERS, "qwen2": qwen2,
            "llama_bias": lambda attn="eager": BUILDERS["llama"](attn, attention_bias=True, head_dim=16)}
"""Every family in the table; Llama with biases everywhere and a head width that is not hidden / heads."""


def _inputs(name, device):
    return {k: v.to(device) for k, v in inputs("bert" if name == "bert" else "gpt2").items()}


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_heads_results_plus_bias_sum_to_attn_out(name, attn, device):
    """`result` is (batch, position, head, d_model); its sum over heads plus the output
    projection's bias is `attn_out`, and recording it leaves the model's output unchanged."""
    model = _perturbed(FAMILIES[name](attn), device)
    pts = fh.transformer.points(model)
    x = _inputs(name, device)
    with torch.no_grad():
        bare = model(**x).logits
        out, rec = fh.capture(model, [fh.outputs(pts.result), fh.outputs(pts.attn_out)])(**x)
    assert torch.equal(out.logits, bare)
    for layer in range(LAYERS):
        result = rec[f"blocks.{layer}.result"]["output"]
        assert result.shape == (2, 6, HEADS, HIDDEN)
        b_O = fh.transformer.head_weights(model, layer).b_O
        torch.testing.assert_close(result.sum(-2) + b_O, rec[f"blocks.{layer}.attn_out"]["output"])
    fh.testing.assert_no_hooks(model)


def _projection(module):
    """(matrix as x @ matrix, bias) of a Linear or a Conv1D, by hand."""
    if isinstance(module, torch.nn.Linear):
        return module.weight.T, module.bias
    return module.weight, module.bias


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_head_weights_make_q_k_v_and_result_by_hand(name, device):
    """The projection's input times `W_Q[h]`/`W_K[h]`/`W_V[h]` plus the bias is the point
    `q`/`k`/`v` of head h (GPT-2's thirds, NeoX's per-head layout, separate projections), and
    `z[..., h, :] @ W_O[h]` is `result[..., h, :]`; `W_O` is the projection's rows of head h."""
    model = _perturbed(FAMILIES[name](), device)
    pts = fh.transformer.points(model)
    x = _inputs(name, device)
    path = pts.q.paths[1][1]
    with torch.no_grad():
        _, rec = fh.capture(model, [fh.inputs(path), *(fh.outputs(p[1]) for p in (pts.q, pts.k, pts.v, pts.z,
                                                                                  pts.result))])(**x)
    stream = rec[path]["input"][0][0]
    w = fh.transformer.head_weights(model, 1)
    for part, W, b in (("q", w.W_Q, w.b_Q), ("k", w.W_K, w.b_K), ("v", w.W_V, w.b_V)):
        expected = torch.einsum("bpm,hmd->bphd", stream, W) + b
        torch.testing.assert_close(rec[f"blocks.1.{part}"]["output"], expected, msg=lambda m, part=part: f"{part}: {m}")
    o_proj = model.get_submodule(pts.z.paths[1][1])
    matrix, bias = _projection(o_proj)
    z = rec["blocks.1.z"]["output"]
    for h in range(HEADS):
        rows = matrix[h * z.shape[-1]:(h + 1) * z.shape[-1]]
        torch.testing.assert_close(w.W_O[h], rows)
        torch.testing.assert_close(rec["blocks.1.result"]["output"][..., h, :], z[..., h, :] @ rows)
    assert w.has_b_O == (bias is not None)


def test_head_weights_are_views_of_the_parameters():
    """`head_weights` copies nothing: an edit of the model's projection shows in `W_O`."""
    model = BUILDERS["gpt2"]()
    w = fh.transformer.head_weights(model, 0)
    with torch.no_grad():
        model.transformer.h[0].attn.c_proj.weight[0, 0] = 5.0
    assert w.W_O[0, 0, 0] == 5.0


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("name", ["gpt2", "neox", "llama", "bert"])
def test_edit_result_equals_the_same_edit_of_z(name, attn, device):
    """`fh.edit(pts.result[1], fn)` zeroing head 2 gives the output of zeroing head 2 of `z`, and
    an editor returning the results unchanged leaves the output as it was."""
    model = _perturbed(FAMILIES[name](attn), device)
    pts = fh.transformer.points(model)
    x = _inputs(name, device)

    def drop_head(module, args, value):
        return value * (torch.arange(HEADS, device=value.device) != 2)[:, None]

    def keep(module, args, value):
        return value + 0

    with torch.no_grad():
        bare = model(**x).logits
        by_result, _ = fh.capture(model, fh.edit(pts.result[1], drop_head))(**x)
        by_z, _ = fh.capture(model, fh.edit(pts.z[1], drop_head))(**x)
        kept, _ = fh.capture(model, fh.edit(pts.result[1], keep))(**x)
    torch.testing.assert_close(by_result.logits, by_z.logits)
    assert not torch.allclose(by_result.logits, bare)
    torch.testing.assert_close(kept.logits, bare)


def test_observe_result_sees_the_heads_results():
    """`fh.observe(pts.result, fn)` calls `fn(module, args, results)` and stores its value."""
    model = BUILDERS["gpt2"]()
    pts = fh.transformer.points(model)

    def norms(module, args, value):
        return value.norm(dim=-1)

    _, rec = fh.capture(model, [fh.observe(pts.result[0], norms), fh.outputs(pts.result[0])])(**inputs("gpt2"))
    torch.testing.assert_close(rec["blocks.0.result"]["norms"], rec["blocks.0.result"]["output"].norm(dim=-1))


def test_interventions_and_grads_on_result_name_the_fix():
    """Patching, steering, scaling or ablating `result`, or watching its gradient, raises a
    SpecError naming the equivalent spec on `z` / `attn_out`."""
    model = BUILDERS["gpt2"]()
    pts = fh.transformer.points(model)
    with pytest.raises(fh.SpecError) as err:
        fh.ablate(pts.result[1])
    assert str(err.value) == (
        "ablate: `result` is computed from `z` and the output projection's weight, not a value the model holds, so "
        "ablate cannot edit it in place, got `result[1]`. Ablate `pts.z` instead (a head's result is its `z` times "
        "`W_O`: patching, scaling or zero-ablating z's head does the same to its result), steer `pts.attn_out` (a "
        "vector added to one head's result is added to `attn_out`), or edit the results with "
        "`fh.edit(pts.result, fn)`.")
    for make in (lambda: fh.patch(pts.result, 0.0), lambda: fh.scale(pts.result, 2.0)):
        with pytest.raises(fh.SpecError, match="`pts.z` instead"):
            make()
    with pytest.raises(fh.SpecError, match=r"Steer `pts.attn_out` instead \(a vector added to one head's result"):
        fh.steer(pts.result, torch.zeros(HIDDEN))
    with pytest.raises(fh.SpecError) as err:
        fh.grads(pts.result)
    assert str(err.value) == (
        "grads: `result` is computed from `z` and the output projection's weight, not a tensor of the model's "
        "forward, so no gradient of it is watched, got `result`. Take `fh.grads(pts.attn_out)`: every head's "
        "result has the gradient of `attn_out`.")


def test_result_spec_reads_like_the_point():
    """The spec of `result` shows the point, and one made twice is equal (a value)."""
    pts = fh.transformer.points(BUILDERS["llama"]())
    assert repr(fh.outputs(pts.result[1])) == "outputs(result[1])"
    assert fh.outputs(pts.result) == fh.outputs(pts.result)
    assert fh.transformer.points(BUILDERS["gpt2"]()).pos_embed.keys == ("pos_embed",)
    with pytest.raises(fh.SpecError, match="learned position embedding"):
        fh.outputs(pts.pos_embed)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_attribution_patching_of_result_equals_that_of_z(name, device):
    """Node attribution patching on `result` (each head's result probed through `fh.edit`) gives,
    head by head, the estimate attribution patching on `z` gives: a head's result is its `z` times
    `W_O[h]`, and its gradient is `attn_out`'s."""
    model = _perturbed(FAMILIES[name](), device)
    pts = fh.transformer.points(model)
    clean = (torch.arange(12).reshape(2, 6) % 50).to(device)
    corrupt = (clean + 7) % 50

    def metric(out):
        return out.logits[:, -1, 3] - out.logits[:, -1, 5]

    by_result = fh.attribution_patching(model, pts.result, metric, heads=HEADS)(clean, corrupt)
    by_z = fh.attribution_patching(model, pts.z, metric, heads=HEADS)(clean, corrupt)
    assert by_result.points == ("blocks.0.result", "blocks.1.result")
    assert by_result.table.shape == (LAYERS, 6, HEADS)
    torch.testing.assert_close(by_result.table, by_z.table)
    assert by_result.table.abs().max() > 1e-4
