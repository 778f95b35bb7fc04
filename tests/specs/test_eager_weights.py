"""A recorded attention pattern is read off a Hugging Face attention module's own output, the
call run as eager attention, with no op mode around it (funhooks/specs/eager_weights.py;
issue 36 item 23): under eager the call as it is, under SDPA the same forward on a twin of the
module whose config says eager. What a user sees: the pattern equals eager's
(`output_attentions`), the output is the eager model's, no `TorchFunctionMode` is active inside
the attention call, and nothing of the model, its config or another thread's calls changes.
Calls where that does not hold (train mode, a query that sees no key, a run that edits or reads
scores, another library's wrapper) take the op mode and give what they gave before."""

from __future__ import annotations

import functools
import inspect
import threading

import pytest
import torch
from helpers import assert_clean
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import funhooks as fh

transformers = pytest.importorskip("transformers")
from tests.transformer_models import bert, gpt2, llama, neox

_TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
TOKENS = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])

# builder, the attention modules, a submodule the attention calls (to look from inside the call)
FAMILIES = {
    "gpt2": (gpt2, "transformer.h.*.attn", "c_attn"),
    "llama-gqa": (llama, "model.layers.*.self_attn", "q_proj"),
    "neox": (lambda attn: neox(attn, intermediate_size=64), "gpt_neox.layers.*.attention", "query_key_value"),
}
if _TRANSFORMERS_5:  # 4.x's BERT has a class per implementation, which picks none per call
    FAMILIES["bert"] = (bert, "bert.encoder.layer.*.attention.self", "query")


def _output(out: object) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _attention(model: nn.Module, where: str, layer: int) -> nn.Module:
    return model.get_submodule(where.replace("*", str(layer)))


class _Looking:
    """A forward hook on a submodule each attention call calls: how many torch function modes
    are active there (the op mode is one), and what the model's config says meanwhile."""

    def __init__(self, model: nn.Module, where: str, inside: str) -> None:
        self.model, self.modes, self.implementations = model, [], []
        self.handles = [_attention(model, where, layer).get_submodule(inside).register_forward_hook(self.hook)
                        for layer in range(2)]

    def hook(self, module: nn.Module, args: tuple, output: object) -> None:
        self.modes.append(torch._C._len_torch_function_stack())
        self.implementations.append(self.model.config._attn_implementation)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_recorded_pattern_needs_no_op_mode_and_is_eagers(family: str, attn: str) -> None:
    build, where, inside = FAMILIES[family]
    eager, model = build("eager"), build(attn)
    state = [dict(_attention(model, where, layer).__dict__) for layer in range(2)]
    looking = _Looking(model, where, inside)
    with torch.no_grad():
        want = eager(TOKENS, output_attentions=True)
        with fh.with_hooks(model, fh.op_outputs(where, fh.attention_pattern)) as run:
            out = _output(model(TOKENS))
    looking.remove()
    assert looking.modes == [0, 0]  # no op mode inside either attention call
    assert looking.implementations == [attn, attn]  # the model's config says what it said
    assert model.config._attn_implementation == attn
    assert [dict(_attention(model, where, layer).__dict__) for layer in range(2)] == state
    for layer in range(2):
        got = run.record[where.replace("*", str(layer))]["attention_pattern"]
        assert got.shape == (2, 4, 6, 6)
        torch.testing.assert_close(got, want.attentions[layer], rtol=0, atol=0 if _TRANSFORMERS_5 else 1e-6)
    if _TRANSFORMERS_5:
        assert torch.equal(out, _output(want))
    torch.testing.assert_close(out, _output(want))


def test_the_standard_pattern_point_reads_the_same_way() -> None:
    """`fh.capture(model, fh.outputs(pts.pattern))`, the benchmark's spelling, under SDPA."""
    model, eager = gpt2("sdpa"), gpt2("eager")
    looking = _Looking(model, "transformer.h.*.attn", "c_attn")
    with torch.no_grad():
        out, rec = fh.capture(model, fh.outputs(fh.transformer.points(model).pattern))(TOKENS)
        want = eager(TOKENS, output_attentions=True)
    looking.remove()
    assert looking.modes == [0, 0]
    assert torch.equal(out.logits, want.logits) or not _TRANSFORMERS_5
    for layer in range(2):
        torch.testing.assert_close(rec[f"blocks.{layer}.pattern"]["output"], want.attentions[layer])


def test_right_padding_and_a_cache_read_the_same_way() -> None:
    """A boolean mask where every query sees a key (right padding), and decoding with a cache
    (one query: no mask at all), read off the twin like an unpadded batch."""
    model, eager = gpt2("sdpa"), gpt2("eager")
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    spec = fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)
    looking = _Looking(model, "transformer.h.*.attn", "c_attn")
    with torch.no_grad():
        out, rec = fh.capture(model, spec)(TOKENS, attention_mask=mask)
        want = eager(TOKENS, attention_mask=mask, output_attentions=True)
        first = model(TOKENS[:, :5], use_cache=True)
        cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        step, step_rec = fh.capture(model, spec)(TOKENS[:, 5:], **{cache: first.past_key_values})
        whole = eager(TOKENS, output_attentions=True)
    looking.remove()
    assert looking.modes[:2] == [0, 0]
    real = mask.bool()[:, None, :, None]  # padding queries' rows: whatever eager gives, as the output there
    for layer in range(2):
        got, expected = rec[f"transformer.h.{layer}.attn"]["attention_pattern"], want.attentions[layer]
        torch.testing.assert_close(got * real, expected * real)
        one = step_rec[f"transformer.h.{layer}.attn"]["attention_pattern"]
        assert one.shape == (2, 4, 1, 6)
        torch.testing.assert_close(one, whole.attentions[layer][:, :, 5:])
    torch.testing.assert_close(out.logits * mask[..., None], want.logits * mask[..., None])
    torch.testing.assert_close(step.logits, whole.logits[:, 5:], atol=1e-5, rtol=1e-5)


def _mode_count(model: nn.Module, run_specs: list[fh.Spec], *args: object,
                **kwargs: object) -> tuple[list[int], fh.Record]:
    looking = _Looking(model, "transformer.h.*.attn", "c_attn")
    try:
        with fh.with_hooks(model, run_specs) as run:
            model(*args, **kwargs)
    finally:
        looking.remove()
    return looking.modes, run.record


def test_calls_it_cannot_read_take_the_op_mode_as_before() -> None:
    """Train mode (the weights a module returns are after its dropout), a left-padded batch
    (a query that sees no key: SDPA's pattern row is 0), a run that also reads the scores or
    edits the pattern: each call inside the op mode, with the pattern it always gave."""
    pattern = fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)
    model = gpt2("sdpa", attn_pdrop=0.5)
    model.train()
    torch.manual_seed(0)
    modes, rec = _mode_count(model, [pattern], TOKENS)
    assert modes == [1, 1]
    rows = rec["transformer.h.0.attn"]["attention_pattern"].sum(-1)
    torch.testing.assert_close(rows, torch.ones_like(rows))  # the softmax, not its dropout

    model = gpt2("sdpa")
    left = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    with torch.no_grad():
        modes, rec = _mode_count(model, [pattern], TOKENS, attention_mask=left)
    assert modes == [1, 1]
    assert torch.equal(rec["transformer.h.0.attn"]["attention_pattern"][1, :, :2], torch.zeros(4, 2, 6))

    scores = fh.op_outputs("transformer.h.*.attn", fh.attention_scores)
    edit = fh.op_edit("transformer.h.0.attn", fh.attention_pattern, lambda m, a, k, p: p)
    with torch.no_grad():
        assert _mode_count(model, [pattern, scores], TOKENS)[0] == [1, 1]
        assert _mode_count(model, [pattern, edit], TOKENS)[0] == [1, 0]


def test_a_boolean_mask_under_vmap_takes_the_op_mode() -> None:
    """Inside `torch.func.vmap` a boolean mask cannot be read to tell whether some query sees
    no key: the call takes the op mode, and the per-example patterns equal the batch's."""
    attn = gpt2("sdpa").transformer.h[0].attn
    hidden = torch.randn(2, 6, 32)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril()
    mask[1, :, :, 0] = False  # example 1: its first key hidden from every query but the last
    mask[1, :, 5, 0] = True
    record = fh.capture(attn, fh.op_outputs("", fh.attention_pattern))

    def one(h: torch.Tensor, m: torch.Tensor) -> tuple[torch.Tensor, fh.Record]:
        out, rec = record(h[None], attention_mask=m[None])
        return out[0], rec

    with torch.no_grad():
        _, per_example = torch.func.vmap(one)(hidden, mask)
        _, batch = record(hidden, attention_mask=mask)
    got = per_example[""]["attention_pattern"][:, 0]
    torch.testing.assert_close(got, batch[""]["attention_pattern"])
    assert torch.equal(got[1, :, :5, 0], torch.zeros(4, 5))


def test_a_forward_with_gradients_and_a_cache_reads_off_the_twin() -> None:
    """A plain forward with gradients on (a notebook without `no_grad`; Hugging Face's eval
    default `use_cache=True` hands every attention a cache): no op mode, and the gradients
    through the recorded calls are the eager model's."""
    model, eager = gpt2("sdpa"), gpt2("eager")
    looking = _Looking(model, "transformer.h.*.attn", "c_attn")
    with fh.with_hooks(model, fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)) as run:
        model(TOKENS, use_cache=True).logits.sum().backward()
    looking.remove()
    eager(TOKENS, use_cache=True).logits.sum().backward()
    assert looking.modes == [0, 0]
    assert len(run.record) == 2
    for got, want in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("use_cache", [False, True])
def test_checkpointed_blocks_record_once_and_backpropagate(use_cache: bool) -> None:
    """Blocks under activation checkpointing in eval mode, gradients on: each pattern is
    recorded once (not again when the block is recomputed during backward) and the gradients
    are the bare forward's. With `use_cache=True` the recomputed block finds the cache its
    first pass filled (more keys than queries, where the eager model itself fails): a call
    with a cache where autograd records takes the op mode in both passes, as before, and
    does what the bare SDPA model does (under transformers 4.x checkpoint refuses that
    recomputation for the bare model too, and for the run alike)."""
    model, bare = gpt2("sdpa"), gpt2("sdpa")
    for m in (model, bare):
        for block in m.transformer.h:
            block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    try:
        bare(TOKENS, use_cache=use_cache).logits.sum().backward()
    except torch.utils.checkpoint.CheckpointError:
        assert use_cache and not _TRANSFORMERS_5
        with pytest.raises(torch.utils.checkpoint.CheckpointError), fh.with_hooks(
                model, fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)):
            model(TOKENS, use_cache=use_cache).logits.sum().backward()
        assert_clean(model)
        return
    with fh.with_hooks(model, fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)) as run:
        model(TOKENS, use_cache=use_cache).logits.sum().backward()
    assert len(run.record.calls("transformer.h.0.attn", "attention_pattern")) == 1
    for got, want in zip(model.parameters(), bare.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-4)
    assert_clean(model)


def test_a_module_another_library_wrapped_takes_the_op_mode() -> None:
    """An instance `forward` set before the run (accelerate's hooks, a user's wrapper) is what
    the call goes through: it is not skipped, so the pattern comes through the op mode."""
    model, eager = gpt2("sdpa"), gpt2("eager")
    attn = model.transformer.h[0].attn
    calls = []
    original = attn.forward

    def wrapper(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return original(*args, **kwargs)

    attn.forward = wrapper
    with torch.no_grad():
        modes, rec = _mode_count(model, [fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)], TOKENS)
        want = eager(TOKENS, output_attentions=True).attentions
    assert calls == [1] and modes == [1, 0]
    for layer in range(2):
        torch.testing.assert_close(rec[f"transformer.h.{layer}.attn"]["attention_pattern"], want[layer])


def test_two_runs_recording_patterns_each_get_them() -> None:
    """Nested runs on one module (the shared state): both read the pattern off the one call."""
    model, eager = gpt2("sdpa"), gpt2("eager")
    spec = fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)
    looking = _Looking(model, "transformer.h.*.attn", "c_attn")
    with torch.no_grad(), fh.with_hooks(model, spec) as outer, fh.with_hooks(model, fh.outputs(
            fh.transformer.points(model).pattern)) as inner:
        model(TOKENS)
    looking.remove()
    want = eager(TOKENS, output_attentions=True).attentions
    assert looking.modes == [0, 0]
    for layer in range(2):
        torch.testing.assert_close(outer.record[f"transformer.h.{layer}.attn"]["attention_pattern"], want[layer])
        torch.testing.assert_close(inner.record[f"blocks.{layer}.pattern"]["output"], want[layer])


@pytest.mark.parametrize("reading_exits_first", [True, False])
def test_a_reading_run_shares_its_module_and_reads_alone_again(reading_exits_first: bool) -> None:
    """A run reading patterns and a run editing one attention module's output, exited in
    either order: each call of the shared module still reads the pattern with no op mode, the
    run left alone reads on, and the model is left as it was."""
    model, eager = gpt2("sdpa"), gpt2("eager")
    pattern = fh.op_outputs("transformer.h.*.attn", fh.attention_pattern)
    reading = fh.with_hooks(model, pattern)
    editing = fh.with_hooks(model, fh.edit("transformer.h.0.attn", lambda m, a, o: o))
    looking = _Looking(model, "transformer.h.*.attn", "c_attn")
    with torch.no_grad():
        reading.__enter__()
        editing.__enter__()
        model(TOKENS)
        first, second = (reading, editing) if reading_exits_first else (editing, reading)
        first.__exit__(None, None, None)
        model(TOKENS)
        second.__exit__(None, None, None)
        with fh.with_hooks(model, pattern) as again:
            model(TOKENS)
        want = eager(TOKENS, output_attentions=True).attentions
    looking.remove()
    assert looking.modes == [0] * 6
    calls = reading.record.calls("transformer.h.0.attn", "attention_pattern")
    assert len(calls) == (1 if reading_exits_first else 2)
    for got in (*calls, again.record["transformer.h.0.attn"]["attention_pattern"]):
        torch.testing.assert_close(got, want[0])
    assert_clean(model)


def test_another_thread_meanwhile_runs_sdpa_untouched() -> None:
    """While a run reads patterns off the twin, the same model called from another thread is
    SDPA's own forward, bit for bit, and sees the config it always saw."""
    model = gpt2("sdpa")
    with torch.no_grad():
        bare = model(TOKENS).logits
    seen: dict[str, object] = {}

    def other() -> None:
        with torch.no_grad():
            seen["logits"] = model(TOKENS).logits
        seen["config"] = model.transformer.h[0].attn.config._attn_implementation

    def from_inside(module: nn.Module, args: tuple, output: object) -> None:
        if threading.current_thread() is threading.main_thread() and not seen:
            thread = threading.Thread(target=other)
            thread.start()
            thread.join()

    handle = model.transformer.h[0].attn.c_attn.register_forward_hook(from_inside)
    try:
        with torch.no_grad():
            _, rec = fh.capture(model, fh.op_outputs("transformer.h.*.attn", fh.attention_pattern))(TOKENS)
    finally:
        handle.remove()
    assert torch.equal(seen["logits"], bare)
    assert seen["config"] == "sdpa"
    assert len(rec) == 2


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_bfloat16_pattern_has_the_models_dtype_under_both(attn: str) -> None:
    """Llama's eager softmax runs in float32 and is cast back: the pattern read off the output
    is in the model's dtype, as SDPA's op-mode reading gives it."""
    model = llama(attn).to(torch.bfloat16)
    with torch.no_grad(), fh.with_hooks(model, fh.op_outputs("model.layers.*.self_attn", fh.attention_pattern)) as run:
        model(TOKENS)
    got = run.record["model.layers.0.self_attn"]["attention_pattern"]
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float().sum(-1), torch.ones(2, 4, 6), atol=2e-2, rtol=0)


@settings(max_examples=15, deadline=None)
@given(batch=st.integers(1, 3), length=st.integers(1, 7), data=st.data())
def test_property_read_patterns_equal_eagers_for_any_right_padded_batch(batch: int, length: int,
                                                                        data: st.DataObject) -> None:
    """For any batch and right padding (every query sees key 0), the pattern read off the SDPA
    model's twin equals the eager model's `output_attentions` on every real query, and the
    output equals the eager model's there."""
    lengths = [data.draw(st.integers(1, length)) for _ in range(batch)]
    mask = torch.tensor([[1] * n + [0] * (length - n) for n in lengths])
    ids = torch.arange(batch * length).reshape(batch, length) % 50
    with torch.no_grad():
        want = _EAGER(ids, attention_mask=mask, output_attentions=True)
        out, rec = fh.capture(_SDPA, fh.op_outputs("transformer.h.*.attn", fh.attention_pattern))(
            ids, attention_mask=mask)
    real = mask.bool()
    for layer in range(2):
        got = rec[f"transformer.h.{layer}.attn"]["attention_pattern"]
        torch.testing.assert_close(got[..., :][real[:, None, :, None].expand_as(got)],
                                   want.attentions[layer][real[:, None, :, None].expand_as(got)])
    torch.testing.assert_close(out.logits[real], want.logits[real])


_EAGER, _SDPA = gpt2("eager"), gpt2("sdpa")
