"""Attention patterns and scores under every attention implementation HF ships on CPU
(issue 28): `fh.attention_pattern` / `fh.attention_scores` are op values; under SDPA they are
computed from what `scaled_dot_product_attention` receives and equal eager's; editing them
under SDPA runs that call eagerly and gives what eager attention with the same edit gives."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch import nn

import funhooks as fh

transformers = pytest.importorskip("transformers")
from tests.transformer_models import bert, gpt2, llama, neox

_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

TOKENS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
PADDING = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])

# (builder taking the attention implementation, the attention modules, whether a padding mask is passed)
FAMILIES = {
    "gpt2": (gpt2, "transformer.h.*.attn", False),
    "llama-gqa": (llama, "model.layers.*.self_attn", False),
    "neox-parallel": (lambda attn: neox(attn, intermediate_size=64), "gpt_neox.layers.*.attention", False),
    "neox-sequential": (lambda attn: neox(attn, parallel=False, intermediate_size=64), "gpt_neox.layers.*.attention",
                        False),
    "bert-padding": (bert, "bert.encoder.layer.*.attention.self", True),
}


def _model(family: str, attn: str) -> tuple[nn.Module, str, dict]:
    build, where, padded = FAMILIES[family]
    return build(attn), where, ({"attention_mask": PADDING} if padded else {})


def _output(out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _layers(rec: fh.Record, where: str, name: str) -> list[torch.Tensor]:
    return [rec[where.replace("*", str(layer))][name] for layer in range(2)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_sdpa_pattern_equals_the_eager_pattern(family: str) -> None:
    """`op_outputs(attn, fh.attention_pattern)` records (batch, head, query, key) patterns
    under SDPA equal to eager's (HF's `output_attentions`), causal, padded and GQA alike, and
    the recorded calls run as eager attention: the output is the eager model's, bit for bit
    under transformers 5 (4.x's GPT-2 divides by the scale where SDPA multiplies) (issue 36
    item 23: a pattern costs eager attention, not eager's work beside SDPA's)."""
    eager, where, kwargs = _model(family, "eager")
    sdpa, _, _ = _model(family, "sdpa")
    with torch.no_grad():
        eager_out = eager(TOKENS, output_attentions=True, **kwargs)
        expected = eager_out.attentions
        bare = _output(sdpa(TOKENS, **kwargs))
        with fh.with_hooks(sdpa, fh.op_outputs(where, fh.attention_pattern)) as run:
            out = _output(sdpa(TOKENS, **kwargs))
    if _TRANSFORMERS_5:
        assert torch.equal(out, _output(eager_out))
    torch.testing.assert_close(out, _output(eager_out))
    torch.testing.assert_close(out, bare)
    for got, want in zip(_layers(run.record, where, "attention_pattern"), expected, strict=True):
        assert got.shape == (2, 4, 6, 6)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "bert-padding"])
def test_the_sdpa_scores_equal_the_eager_scores_with_minus_inf_where_masked(family: str) -> None:
    """`fh.attention_scores` under SDPA is eager's softmax input (scaled q·kᵀ plus the mask)
    where a key is visible, and -inf where eager puts the dtype's minimum."""
    eager, where, kwargs = _model(family, "eager")
    sdpa, _, _ = _model(family, "sdpa")
    spec = fh.op_outputs(where, fh.attention_scores)
    with torch.no_grad(), fh.with_hooks(eager, spec) as want, fh.with_hooks(sdpa, spec) as got:
        eager(TOKENS, **kwargs)
        sdpa(TOKENS, **kwargs)
    for s, e in zip(_layers(got.record, where, "attention_scores"), _layers(want.record, where, "attention_scores"),
                    strict=True):
        masked = e < torch.finfo(e.dtype).min / 2
        # -inf where SDPA gets a boolean mask; the dtype's minimum where it gets an additive one (BERT, transformers 4)
        hidden = s.isneginf() | (s < torch.finfo(s.dtype).min / 2)
        assert masked.any() and torch.equal(hidden, masked)
        torch.testing.assert_close(s[~masked], e[~masked])


def _by_hand(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2]).tril() == 0, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    return scores.softmax(-1)


class _Sdpa(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("case", ["causal", "bool mask", "float mask", "enable_gqa", "scale"])
def test_the_pattern_is_read_off_what_sdpa_receives(case: str) -> None:
    """The pattern is computed from SDPA's own arguments: `is_causal`, boolean and additive
    masks, `enable_gqa` key heads and `scale`, as the math gives it."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    mask = torch.rand(2, 1, 5, 5) > 0.3
    mask[..., 0] = True
    kwargs: dict = {"causal": {"is_causal": True}, "bool mask": {"attn_mask": mask},
                    "float mask": {"attn_mask": torch.randn(5, 5)}, "enable_gqa": {"enable_gqa": True},
                    "scale": {"scale": 0.5}}[case]
    if case == "enable_gqa":
        k, v = k[:, :2], v[:, :2]
    module = _Sdpa()
    with fh.with_hooks(module, fh.op_outputs("", fh.attention_pattern)) as run:
        module(q, k, v, **kwargs)
    if case == "scale":
        expected = (q @ k.transpose(-1, -2) * 0.5).softmax(-1)
    else:
        expected = _by_hand(q, k, kwargs.get("attn_mask"), kwargs.get("is_causal", False))
    torch.testing.assert_close(run.record[""]["attention_pattern"], expected)


def _keep_first_key(module: nn.Module, args: tuple, kwargs: dict, pattern: torch.Tensor) -> torch.Tensor:
    return pattern * torch.tensor([2.0, 1, 1, 1, 1, 1])


def _mask_last_key(module: nn.Module, args: tuple, kwargs: dict, scores: torch.Tensor) -> torch.Tensor:
    return scores - torch.tensor([0.0, 0, 0, 0, 0, 1e9])


@pytest.mark.parametrize("family", ["gpt2", "llama-gqa", "bert-padding"])
@pytest.mark.parametrize("point", ["pattern", "scores"])
def test_an_edit_under_sdpa_gives_eager_attention_with_the_same_edit(family: str, point: str) -> None:
    """`op_edit(attn, fh.attention_pattern | fh.attention_scores, fn)` under SDPA runs that
    attention call eagerly: the model's output is eager attention's with the same edit, and a
    recording after the edit sees the edited pattern."""
    eager, where, kwargs = _model(family, "eager")
    sdpa, _, _ = _model(family, "sdpa")
    op, fn = (fh.attention_pattern, _keep_first_key) if point == "pattern" else (fh.attention_scores, _mask_last_key)
    specs = [fh.op_edit(where, op, fn), fh.op_outputs(where, fh.attention_pattern)]
    with torch.no_grad():
        plain = _output(eager(TOKENS, **kwargs))
        with fh.with_hooks(eager, specs) as want:
            expected = _output(eager(TOKENS, **kwargs))
        with fh.with_hooks(sdpa, specs) as got:
            out = _output(sdpa(TOKENS, **kwargs))
    assert not torch.allclose(expected, plain)
    torch.testing.assert_close(out, expected)
    for s, e in zip(_layers(got.record, where, "attention_pattern"), _layers(want.record, where, "attention_pattern"),
                    strict=True):
        torch.testing.assert_close(s, e)


def test_patching_the_pattern_under_sdpa_takes_the_pattern_of_another_run() -> None:
    """`fh.patch(attn, record, op=fh.attention_pattern)` under SDPA puts another input's
    patterns in: the output is that of eager attention patched the same way."""
    eager, where, _ = _model("gpt2", "eager")
    sdpa, _, _ = _model("gpt2", "sdpa")
    other = TOKENS.flip(-1)
    with torch.no_grad():
        _, source = fh.capture(sdpa, fh.op_outputs(where, fh.attention_pattern))(other)
        patch = fh.patch(where, source, op=fh.attention_pattern)
        with fh.with_hooks(eager, patch):
            expected = eager(TOKENS).logits
        with fh.with_hooks(sdpa, patch):
            out = sdpa(TOKENS).logits
    torch.testing.assert_close(out, expected)


def test_an_edit_under_sdpa_keeps_the_calls_dropout_in_train_mode() -> None:
    """An edited SDPA call with `dropout_p > 0` drops pattern entries as eager attention does
    (the kept ones scaled by 1 / (1 - p)): with the same seed, the same output as eager."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    module = _Sdpa()
    with fh.with_hooks(module, fh.op_edit("", fh.attention_pattern, _keep_first_of_four)):
        torch.manual_seed(1)
        out = module(q, k, v, dropout_p=0.5)
    torch.manual_seed(1)
    pattern = nn.functional.dropout(_keep_first_of_four(None, (), {}, _by_hand(q, k)), 0.5)
    torch.testing.assert_close(out, pattern @ v)


def _keep_first_of_four(module: object, args: tuple, kwargs: dict, pattern: torch.Tensor) -> torch.Tensor:
    return pattern * torch.tensor([2.0, 1, 1, 1])


def test_gradients_flow_through_an_edited_sdpa_pattern() -> None:
    """Under autograd, an edited SDPA call differentiates like eager attention: the gradient
    w.r.t. q equals the hand-written attention's."""
    torch.manual_seed(0)
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    module = _Sdpa()
    with fh.with_hooks(module, fh.op_edit("", fh.attention_pattern, _keep_first_of_four)):
        (grad,) = torch.autograd.grad(module(q, k, v, is_causal=True).sum(), q)
    (expected,) = torch.autograd.grad((_keep_first_of_four(None, (), {}, _by_hand(q, k, causal=True)) @ v).sum(), q)
    torch.testing.assert_close(grad, expected)


def test_a_module_calling_no_attention_says_which_implementations_work() -> None:
    """Selecting a module that calls neither softmax nor SDPA (flex or flash attention, or the
    wrong module) raises the op spec's "matched nothing" error, naming the switch to make."""
    model = nn.Sequential(nn.Linear(4, 4))
    spec = fh.op_outputs("0", fh.attention_pattern)
    with pytest.raises(fh.SelectorError) as caught, fh.with_hooks(model, spec):
        model(torch.ones(1, 4))
    assert str(caught.value) == (
        "with_hooks: an op spec matches an op called by the module it selects, got no call of `attention_pattern` in "
        "module '0' (Linear) for op_outputs('0', fh.attention_pattern). An attention pattern is read off eager "
        "attention's `softmax` or computed from `scaled_dot_product_attention`: load the model with "
        "`attn_implementation=\"eager\"` or `\"sdpa\"` (or call `model.set_attn_implementation(\"sdpa\")`), or select "
        "the module that calls it."
    )
    fh.testing.assert_no_hooks(model)


def test_an_attention_value_has_no_inputs_to_store() -> None:
    """`op_inputs` of an attention value is refused when the spec is made."""
    with pytest.raises(fh.SpecError) as caught:
        fh.op_inputs("attn", fh.attention_pattern)
    assert str(caught.value) == (
        "op_inputs: a derived op such as fh.attention_pattern is a value with no inputs of its own, got it. Store its "
        "value with `fh.op_outputs`, or the inputs of the ops it is read off ('softmax', "
        "'scaled_dot_product_attention')."
    )


def test_call_picks_one_attention_call_and_the_values_compare_and_print() -> None:
    """`fh.op(fh.attention_pattern, call=1)` takes the second attention call of each module
    call; the values are equal by value and print as they are spelled."""
    torch.manual_seed(0)

    class Twice(nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            once = nn.functional.scaled_dot_product_attention(q, q, q)
            return nn.functional.scaled_dot_product_attention(once, q, q, is_causal=True)

    q = torch.randn(1, 2, 3, 4)
    second = fh.op(fh.attention_pattern, call=1)
    assert second == fh.op(fh.attention_pattern, call=1) and second != fh.attention_pattern
    assert repr(second) == "fh.op(fh.attention_pattern, call=1)" and repr(fh.attention_scores) == "fh.attention_scores"
    module = Twice()
    with fh.with_hooks(module, fh.op_outputs("", second, name="second")) as run:
        module(q)
    once = nn.functional.scaled_dot_product_attention(q, q, q)
    torch.testing.assert_close(run.record[""]["second"], _by_hand(once, q, causal=True))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["gpt2", "neox", "neox_seq", "llama", "bert"])
def test_pts_attn_takes_every_attention_op_on_every_family(name: str, attn: str) -> None:
    """Issue 36 item 19: `pts.attn` with an attention op works on every family, BERT included
    (whose attention call runs in `attention.self`, a submodule of `pts.attn`), as the error of
    `fh.patch(pts.pattern, ..., op=...)` tells users to write: recorded, edited, intervened on,
    each equal to the standard point doing the same."""
    from tests.transformer_models import BUILDERS, inputs

    model, x = BUILDERS[name](attn), inputs(name)
    pts = fh.transformer.points(model)
    with pytest.raises(fh.SpecError, match=r"give patch a module \(`pts.attn`\) with `op=`"):
        fh.patch(pts.pattern, 0.0, op=fh.attention_pattern)

    def halve(module: nn.Module, args: tuple, kwargs: dict, value: torch.Tensor) -> torch.Tensor:
        return value * 0.5

    for op, point in ((fh.attention_pattern, pts.pattern), (fh.attention_scores, pts.attn_scores)):
        _, by_attn = fh.capture(model, fh.op_outputs(pts.attn, op))(**x)
        _, by_point = fh.capture(model, fh.outputs(point))(**x)
        assert len(by_attn) == 2 and len(by_point) == 2
        for got, want in zip(by_attn.values(), by_point.values(), strict=True):
            assert torch.equal(got[op.name], want["output"])
        ablated, _ = fh.capture(model, fh.ablate(pts.attn, op=op, index=1, dim=1))(**x)
        same, _ = fh.capture(model, fh.ablate(point, index=1, dim=1))(**x)
        assert torch.equal(ablated.logits, same.logits)
        patched, _ = fh.capture(model, fh.patch(pts.attn, by_attn, op=op))(**x)
        plain, _ = fh.capture(model, [])(**x)
        torch.testing.assert_close(patched.logits, plain.logits)
        edited, _ = fh.capture(model, fh.op_edit(pts.attn, op, halve))(**x)
        halved, _ = fh.capture(model, fh.edit(point, lambda m, a, v: v * 0.5))(**x)
        assert torch.equal(edited.logits, halved.logits)
    fh.testing.assert_no_hooks(model)


def test_a_query_that_sees_no_key_has_a_zero_pattern_under_sdpa() -> None:
    """Issue 36 item 21, as docs/transformers.md says: a padding query of a left-padded batch
    sees no key; SDPA's pattern row is 0 there and `pattern @ v` is the real `z` (0), while
    eager's softmax spreads it (uniformly under transformers 5). Real queries agree."""
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [0, 0, 7, 8, 9, 10]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    got = {}
    for attn in ("eager", "sdpa"):
        model = gpt2(attn)
        pts = fh.transformer.points(model)
        _, rec = fh.capture(model, [fh.outputs(pts.pattern[0]), fh.outputs(pts.v[0]), fh.outputs(pts.z[0])])(
            input_ids=ids, attention_mask=mask)
        got[attn] = [rec[f"blocks.0.{name}"]["output"] for name in ("pattern", "v", "z")]
    pattern, v, z = got["sdpa"]
    assert torch.equal(pattern[1, :, :2], torch.zeros(4, 2, 6))
    torch.testing.assert_close(pattern @ v.transpose(1, 2), z.transpose(1, 2))
    eager = got["eager"][0]
    assert torch.all(eager[1, :, :2].sum(-1) > 0.99)     # a softmax row, not zeros
    torch.testing.assert_close(eager[:, :, 2:], pattern[:, :, 2:])
    torch.testing.assert_close(eager[0], pattern[0])


def test_a_pattern_run_changes_only_its_own_calls_and_leaves_the_model_as_it_was() -> None:
    """Issue 36 item 23: the eager attention of a pattern run is the run's calls' alone. While it
    is open, the same model called from another thread gives the bare SDPA output bit for bit
    (this thread's: the eager model's, bit for bit under transformers 5); after it, and after a run that raised, the model is
    SDPA as before (its config untouched, no hooks, the bare output again)."""
    eager, where, _ = _model("gpt2", "eager")
    sdpa, _, _ = _model("gpt2", "sdpa")
    spec = fh.op_outputs(where, fh.attention_pattern)
    with torch.no_grad():
        bare, eager_out = sdpa(TOKENS).logits, eager(TOKENS).logits
        assert not torch.equal(bare, eager_out)
        other: dict[str, torch.Tensor] = {}
        with fh.with_hooks(sdpa, spec) as run:
            thread = threading.Thread(target=lambda: other.update(out=sdpa(TOKENS).logits))
            thread.start()
            thread.join()
            out = sdpa(TOKENS).logits
        assert torch.equal(other["out"], bare)
        if _TRANSFORMERS_5:  # 4.x's GPT-2 divides by the scale where SDPA multiplies
            assert torch.equal(out, eager_out)
        torch.testing.assert_close(out, eager_out)
        assert len(_layers(run.record, where, "attention_pattern")) == 2
        with pytest.raises(ValueError, match="stop"), fh.with_hooks(sdpa, spec):
            sdpa(TOKENS)
            raise ValueError("stop")
        assert sdpa.config._attn_implementation == "sdpa"
        fh.testing.assert_no_hooks(sdpa)
        assert torch.equal(sdpa(TOKENS).logits, bare)
