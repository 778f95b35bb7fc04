"""The standard points of fh.transformer: every point on every family equals an independent
computation (plain torch hooks on the module paths, reshapes by hand), under eager and sdpa."""

from __future__ import annotations

import pytest
import torch
import transformers

import funhooks as fh
from tests.transformer_models import ATTENTION, BUILDERS, inputs

PER_LAYER = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_in", "mlp_pre", "mlp_post", "mlp_out",
             "q", "k", "v", "z")


def _hooked(model, places):
    """Plain torch hooks: `places` maps a key to (module path, 'out'|'in'); returns the values."""
    got, handles = {}, []
    for key, (path, where) in places.items():
        module = model.get_submodule(path)
        if where == "out":
            handles.append(module.register_forward_hook(
                lambda m, a, o, key=key: got.__setitem__(key, (o[0] if isinstance(o, tuple) else o).detach())))
        else:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, key=key: got.__setitem__(key, a[0].detach())))
    return got, handles


def _expected(name, model):
    """The independent value of every per-layer point of layer 1 and the global ones."""
    arch = fh.transformer.architecture(model)
    base = "bert" if name == "bert" else {"gpt2": "transformer", "llama": "model"}.get(name, "gpt_neox")
    block = f"{base}.{arch.blocks}.1"
    places = {
        "embed": (f"{base}.{arch.embed}", "out"),
        "resid_pre": (f"{base}.{arch.blocks}.0", "out"),
        "resid_post": (block, "out"),
        "attn_out": (f"{block}.{arch.attn_out or arch.attn}", "out"),
        "mlp_in": (f"{block}.{arch.mlp_in or arch.mlp}", "in"),
        "mlp_pre": (f"{block}.{arch.mlp_pre}", "out"),
        "mlp_post": (f"{block}.{arch.mlp_proj}", "in"),
        "mlp_out": (f"{block}.{arch.mlp_out or arch.mlp}", "out"),
        "z": (f"{block}.{arch.attn_proj}", "in"),
        "logits": (arch.unembed, "out"),
        **{f"qkv{i}": (f"{block}.{p}", "out") for i, p in enumerate(arch.qkv)},
    }
    if arch.final_norm:
        places["final_norm"] = (f"{base}.{arch.final_norm}", "out")
    if name in ("bert",):
        places["resid_mid"] = (f"{block}.{arch.attn}", "out")
    elif name != "neox":
        places["resid_mid"] = (f"{block}.{arch.mlp_norm}", "in")  # the norm reads the stream after attention
    got, handles = _hooked(model, places)
    try:
        with torch.no_grad():
            out = model(**inputs(name))
    finally:
        for h in handles:
            h.remove()
    pts = fh.transformer.points(model)
    heads = lambda t, n: t.unflatten(-1, (n, -1))  # noqa: E731
    if len(arch.qkv) == 3:
        got["q"], got["k"], got["v"] = (heads(got.pop(f"qkv{i}"), n)
                                        for i, n in enumerate((pts.n_heads, pts.n_kv_heads, pts.n_kv_heads)))
    elif arch.fused == "thirds":
        got["q"], got["k"], got["v"] = (heads(t, pts.n_heads) for t in got.pop("qkv0").chunk(3, -1))
    else:  # NeoX: per head [q | k | v], as its attention reads it
        got["q"], got["k"], got["v"] = heads(got.pop("qkv0"), pts.n_heads).chunk(3, -1)
    got["z"] = heads(got["z"], pts.n_heads)
    return got, out.logits


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_point_equals_plain_hooks(name, attn):
    """Every point of layer 1 (and embed, final_norm, logits) equals what plain torch hooks on the
    family's module paths see, reshaped by hand; and the model's output is unchanged."""
    model = BUILDERS[name](attn)
    expected, logits = _expected(name, model)
    pts = fh.transformer.points(model)
    wanted = [getattr(pts, n)[1] for n in PER_LAYER if getattr(pts, n).kind != "none"]
    wanted += [p for p in (pts.embed, pts.final_norm, pts.logits) if p.kind != "none"]
    out, rec = fh.capture(model, [fh.outputs(p) for p in wanted])(**inputs(name))
    assert torch.equal(out.logits, logits)
    for key, value in expected.items():
        path = key if key in ("embed", "final_norm", "logits") else f"blocks.1.{key}"
        torch.testing.assert_close(rec[path]["output"], value, msg=lambda m: f"{path}: {m}")
    assert {p for p in rec} == {k if k in ("embed", "final_norm", "logits") else f"blocks.1.{k}" for k in expected}
    fh.testing.assert_no_hooks(model)


def _eager_pattern(q, k, mask=None):
    """softmax(q k^T / sqrt(d)) by hand, causal unless a padding mask is given; (batch, head, q, k)."""
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    n = scores.shape[-1]
    if mask is None:
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    else:
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], torch.finfo(scores.dtype).min)
    return scores.softmax(-1)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_pattern_and_z_equal_attention_by_hand(name):
    """`pattern` is softmax(q k^T / sqrt(d_head)) by hand (GPT-2, BERT with padding; Llama's q, k
    after RoPE are not the stored ones, so only its shape and rows are checked), and `z` is the
    pattern applied to `v` (head by head)."""
    model = BUILDERS[name]("eager")
    pts = fh.transformer.points(model)
    x = inputs(name)
    _, rec = fh.capture(model, [fh.outputs(p[0]) for p in (pts.q, pts.k, pts.v, pts.pattern, pts.z)])(**x)
    pattern = rec["blocks.0.pattern"]["output"]
    assert pattern.shape == (2, pts.n_heads, 6, 6)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(2, pts.n_heads, 6))
    if name == "llama":
        return
    q, k, v = (rec[f"blocks.0.{n}"]["output"] for n in "qkv")
    expected = _eager_pattern(q, k, x.get("attention_mask"))
    torch.testing.assert_close(pattern, expected)
    torch.testing.assert_close(rec["blocks.0.z"]["output"], (expected @ v.transpose(1, 2)).transpose(1, 2))


def _attention(model, name, specs):
    """The model's output and Record for `specs` on `name`'s inputs."""
    with torch.no_grad():
        out, rec = fh.capture(model, specs)(**inputs(name))
    return out.logits, rec


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "bert"])
def test_pattern_and_scores_under_sdpa_equal_eager(name):
    """Under the default SDPA implementation `pattern` and `attn_scores` are (batch, head, query,
    key) tensors equal to eager's (causal, GQA, parallel NeoX, BERT with padding); scores are -inf
    where SDPA masks and the dtype's minimum where eager does; the recorded attention calls run as
    eager attention, so the output is the eager model's (SDPA's own to rounding)."""
    eager, sdpa = BUILDERS[name]("eager"), BUILDERS[name]("sdpa")
    pts = fh.transformer.points(sdpa)
    specs = [fh.outputs(pts.pattern), fh.outputs(pts.attn_scores)]
    want_out, want = _attention(eager, name, specs)
    got_out, got = _attention(sdpa, name, specs)
    exact = int(transformers.__version__.split(".")[0]) >= 5  # 4.x's GPT-2 divides by the scale
    torch.testing.assert_close(got_out, want_out, **({"rtol": 0, "atol": 0} if exact else {}))
    torch.testing.assert_close(got_out, _attention(sdpa, name, [])[0])
    assert list(got) == list(want) == [f"blocks.{L}.{n}" for L in range(2) for n in ("attn_scores", "pattern")]
    for layer in range(2):
        pattern = got[f"blocks.{layer}.pattern"]["output"]
        assert pattern.shape == (2, pts.n_heads, 6, 6)
        torch.testing.assert_close(pattern, want[f"blocks.{layer}.pattern"]["output"])
        scores = got[f"blocks.{layer}.attn_scores"]["output"]
        eager_scores = want[f"blocks.{layer}.attn_scores"]["output"]
        masked = eager_scores < torch.finfo(eager_scores.dtype).min / 2
        # -inf where SDPA gets a boolean mask; the dtype's minimum where it gets an additive one (BERT, transformers 4)
        hidden = scores.isneginf() | (scores < torch.finfo(scores.dtype).min / 2)
        assert masked.any() and torch.equal(hidden, masked)
        torch.testing.assert_close(scores[~masked], eager_scores[~masked])


def _flipped(name):
    x = inputs(name)
    return {**x, "input_ids": x["input_ids"].flip(-1)}


@pytest.mark.parametrize("name", ["gpt2", "llama", "neox", "bert"])
def test_patching_the_pattern_under_sdpa_equals_the_same_patch_under_eager(name):
    """`fh.patch(pts.pattern[L], record)` with another input's patterns (one head) gives under SDPA
    the output eager attention gives with the same patch, and the recorded pattern is the patched one."""
    eager, sdpa = BUILDERS[name]("eager"), BUILDERS[name]("sdpa")
    pts = fh.transformer.points(sdpa)
    with torch.no_grad():
        _, source = fh.capture(sdpa, fh.outputs(pts.pattern[1]))(**_flipped(name))
    specs = [fh.patch(pts.pattern[1], source, index=2), fh.outputs(pts.pattern[1])]
    want_out, want = _attention(eager, name, specs)
    got_out, got = _attention(sdpa, name, specs)
    assert not torch.allclose(got_out, _attention(sdpa, name, [])[0])
    torch.testing.assert_close(got_out, want_out)
    patched = got["blocks.1.pattern"]["output"]
    torch.testing.assert_close(patched[:, 2], source["blocks.1.pattern"]["output"][:, 2])
    torch.testing.assert_close(patched, want["blocks.1.pattern"]["output"])


@pytest.mark.parametrize("edit", ["patch", "steer", "scale", "ablate"])
@pytest.mark.parametrize("point", ["pattern", "attn_scores"])
def test_every_edit_of_an_attention_point_under_sdpa_equals_eager(point, edit):
    """patch / steer / scale / ablate of `pattern` or `attn_scores` under SDPA give eager's
    output with the same edit (Llama, grouped-query attention)."""
    eager, sdpa = BUILDERS["llama"]("eager"), BUILDERS["llama"]("sdpa")
    where = getattr(fh.transformer.points(sdpa), point)[0]
    bias = torch.linspace(-1.0, 1.0, 6)  # one value per key
    spec = {"patch": lambda: fh.patch(where, 0.5, index=1), "steer": lambda: fh.steer(where, bias),
            "scale": lambda: fh.scale(where, 2.0), "ablate": lambda: fh.ablate(where, index=3)}[edit]()
    want_out, _ = _attention(eager, "llama", spec)
    got_out, _ = _attention(sdpa, "llama", spec)
    assert not torch.allclose(got_out, _attention(sdpa, "llama", [])[0])
    torch.testing.assert_close(got_out, want_out)


def test_keys_are_the_same_on_every_family():
    """One analysis runs unchanged on every family: the Record keys of the same points agree."""
    def analysis(model, name):
        pts = fh.transformer.points(model)
        _, rec = fh.capture(model, [fh.outputs(pts.resid_pre), fh.outputs(pts.z), fh.outputs(pts.mlp_out)])(
            **inputs(name))
        return list(rec), [tuple(rec[k]["output"].shape[-2:]) for k in rec]

    keys = {name: analysis(BUILDERS[name](), name)[0] for name in BUILDERS}
    assert len({tuple(sorted(k)) for k in keys.values()}) == 1
    assert sorted(keys["gpt2"]) == sorted(f"blocks.{L}.{n}" for L in range(2) for n in ("resid_pre", "z", "mlp_out"))


@pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5,
                    reason="under transformers 4 GPT-2's blocks return a 1-tuple: resid_post reads its element 0 "
                           "(test_block_points_are_tensors_under_every_transformers)")
def test_resid_post_is_the_path_spec():
    """Where a point is a module's output, the spec is the path's own spec, with a Record label."""
    model = BUILDERS["gpt2"]()
    pts = fh.transformer.points(model)
    spec = fh.outputs(pts.resid_post[1])
    path = fh.outputs("transformer.h.1")
    assert (spec.event, spec.role, spec.name, spec.hook, spec.fn) == (path.event, path.role, path.name, path.hook,
                                                                       path.fn)
    assert spec.labels == (("transformer.h.1", "blocks.1.resid_post"),)
    assert repr(spec) == "outputs(resid_post[1])"
    assert spec == fh.outputs(pts.resid_post[-1]) and hash(spec) == hash(fh.outputs(pts.resid_post[-1]))
    assert repr(fh.patch(pts.z[[0, 1]], 0.0, index=2, dim=2)) == "patch(z[[0, 1]], 0.0, index=2, dim=2)"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_block_points_are_tensors_under_every_transformers(name):
    """Issue 36 item 22: `resid_pre` and `resid_post` store the stream itself whatever the
    blocks return (a tensor from transformers 5 on, a 1-tuple from GPT-2's, NeoX's and BERT's
    under 4.x), and the logit lens and accumulated_resid read them."""
    model = BUILDERS[name]()
    pts = fh.transformer.points(model)
    x = inputs(name)
    out, rec = fh.capture(model, [fh.outputs(pts.resid_pre), fh.outputs(pts.resid_post)])(**x)
    values = [rec[k]["output"] for k in rec]
    assert len(values) == 4 and all(isinstance(v, torch.Tensor) and v.shape == (2, 6, 32) for v in values)
    lens = fh.transformer.logit_lens(model, rec)
    torch.testing.assert_close(lens["blocks.1.resid_post"], out.logits)
    stack = fh.transformer.accumulated_resid(model, rec)
    assert stack.labels == ("blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.resid_post")
    assert torch.equal(stack["blocks.1.resid_pre"], rec["blocks.0.resid_post"]["output"])
