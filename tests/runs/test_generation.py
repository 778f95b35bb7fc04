"""Runs over Hugging Face ``generate``: a Record per decode step beside its token, decode
steps addressed by ``index=fh.steps(...)`` (the same with and without the KV cache), and the
streaming iterator."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import funhooks as fh

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
CHUNKS_THE_PROMPT = int(transformers.__version__.split(".")[0]) >= 5
needs_prompt_chunking = pytest.mark.skipif(
    not CHUNKS_THE_PROMPT, reason="transformers 4.x's `generate` runs these models' prompt in one pass "
    "whatever `prefill_chunk_size` says (one call, as funhooks records it); nothing to follow")

PROMPT = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
NEW = 5
GREEDY = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
WIDTH = 32


def _hidden(value: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A stored block output's hidden states: the value, or under transformers 4.x the block's
    tuple's element 0."""
    return value[0] if isinstance(value, tuple) else value


def _gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0,
        initializer_range=0.3))


def _llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=50, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, initializer_range=0.3))


def _neox() -> nn.Module:
    return transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        num_hidden_layers=2, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=2, vocab_size=50,
        max_position_embeddings=32, bos_token_id=0, eos_token_id=0, initializer_range=0.3))


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (_gpt2, "transformer.h.0"), "llama": (_llama, "model.layers.0"), "neox": (_neox, "gpt_neox.layers.0"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def lm(request: pytest.FixtureRequest) -> tuple[nn.Module, str]:
    build, block = MODELS[request.param]
    torch.manual_seed(0)
    return build().eval(), block


def test_records_one_step_per_new_token_beside_the_tokens_of_a_plain_generate(lm: tuple[nn.Module, str]) -> None:
    """Observers change no token; step 0 sees the prompt, each cached step one position."""
    model, block = lm
    plain = model.generate(PROMPT, **GREEDY)
    gen = fh.generate(model, fh.outputs(block), PROMPT, **GREEDY)
    assert torch.equal(gen.tokens, plain[:, PROMPT.shape[1]:])
    assert torch.equal(gen.output, plain)
    assert [s.step for s in gen.steps] == list(range(NEW))
    shapes = [tuple(_hidden(r[block]["output"]).shape) for r in gen.records]
    assert shapes == [(2, 5, WIDTH)] + [(2, 1, WIDTH)] * (NEW - 1)
    fh.testing.assert_no_hooks(model)


def test_sampling_with_a_fixed_seed_chooses_the_tokens_of_a_plain_generate(lm: tuple[nn.Module, str]) -> None:
    model, block = lm
    torch.manual_seed(1)
    plain = model.generate(PROMPT, max_new_tokens=NEW, do_sample=True, pad_token_id=0)
    torch.manual_seed(1)
    gen = fh.generate(model, fh.outputs(block), PROMPT, max_new_tokens=NEW, do_sample=True, pad_token_id=0)
    assert torch.equal(gen.output, plain)


def test_new_positions_are_the_same_record_with_and_without_the_cache(lm: tuple[nn.Module, str]) -> None:
    """``GenerationStep.new()`` keeps the positions a step added: the cache changes nothing."""
    model, block = lm
    cached = fh.generate(model, fh.outputs(block), PROMPT, use_cache=True, **GREEDY)
    uncached = fh.generate(model, fh.outputs(block), PROMPT, use_cache=False, **GREEDY)
    assert torch.equal(cached.tokens, uncached.tokens)
    assert _hidden(uncached.records[2][block]["output"]).shape[1] == PROMPT.shape[1] + 2
    for a, b in zip(cached.steps, uncached.steps):
        torch.testing.assert_close(_hidden(a.new()[block]["output"]), _hidden(b.new()[block]["output"]), atol=1e-5,
                                   rtol=1e-5)


def _manual_steer(model: nn.Module, block: str, vector: torch.Tensor, k: int, cached: bool) -> torch.Tensor:
    """Steering from step k on with a plain ``register_forward_hook``: cached, every call from
    the k-th on; uncached, the positions from ``prompt + k - 1`` on."""
    calls = [0]

    def hook(module: nn.Module, args: object, output: object) -> object:
        hidden = output[0] if isinstance(output, tuple) else output
        step, calls[0] = calls[0], calls[0] + 1
        if cached:
            hidden = hidden + vector if step >= k else hidden
        else:
            first = PROMPT.shape[1] + k - 1 if k else 0
            hidden = torch.cat([hidden[:, :first], hidden[:, first:] + vector], 1)
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

    handle = model.get_submodule(block).register_forward_hook(hook)
    try:
        return model.generate(PROMPT, use_cache=cached, **GREEDY)[:, PROMPT.shape[1]:]
    finally:
        handle.remove()


@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("k", [0, 2])
def test_steering_from_step_k_changes_exactly_the_tokens_from_k_as_a_manual_hook_loop(
        lm: tuple[nn.Module, str], cached: bool, k: int) -> None:
    model, block = lm
    torch.manual_seed(2)
    vector = torch.randn(WIDTH) * 4
    plain = fh.generate(model, (), PROMPT, **GREEDY).tokens
    steered = fh.generate(model, fh.steer(block, vector, index=fh.steps(k, None)), PROMPT, use_cache=cached, **GREEDY)
    assert torch.equal(steered.tokens, _manual_steer(model, block, vector, k, cached))
    assert torch.equal(steered.tokens[:, :k], plain[:, :k])
    assert bool((steered.tokens[:, k] != plain[:, k]).any())
    fh.testing.assert_no_hooks(model)


@pytest.mark.parametrize("index", [fh.steps(0), fh.steps(2), fh.steps(1, 3), fh.steps(0, None, last=True)])
def test_a_steps_index_means_the_same_tokens_with_and_without_the_cache(lm: tuple[nn.Module, str],
                                                                        index: fh.Steps) -> None:
    model, block = lm
    torch.manual_seed(3)
    vector = torch.randn(WIDTH) * 4
    spec = fh.steer(block, vector, index=index)
    cached = fh.generate(model, spec, PROMPT, use_cache=True, **GREEDY)
    uncached = fh.generate(model, spec, PROMPT, use_cache=False, **GREEDY)
    assert torch.equal(cached.tokens, uncached.tokens)


def test_steps_last_edits_only_the_positions_that_predict_a_token(lm: tuple[nn.Module, str]) -> None:
    """On the prompt pass ``last=True`` patches the prompt's last position alone."""
    model, block = lm
    spec = [fh.patch(block, 0.0, index=fh.steps(0, None, last=True)), fh.outputs(block)]
    gen = fh.generate(model, spec, PROMPT, **GREEDY)
    prompt_pass = gen.records[0][block]["output"]
    prompt_pass = prompt_pass[0] if isinstance(prompt_pass, tuple) else prompt_pass
    assert bool((prompt_pass[:, -1] == 0).all()) and bool((prompt_pass[:, :-1] != 0).any())


def test_iter_generate_yields_each_step_as_it_is_made_and_stops_when_closed(lm: tuple[nn.Module, str]) -> None:
    model, block = lm
    whole = fh.generate(model, fh.outputs(block), PROMPT, **GREEDY)
    seen = []
    for step in fh.iter_generate(model, fh.outputs(block), PROMPT, max_new_tokens=50, do_sample=False,
                                 pad_token_id=0):
        seen.append(step)
        if step.step == 2:
            break
    assert [s.step for s in seen] == [0, 1, 2]
    for a, b in zip(seen, whole.steps):
        assert torch.equal(a.token, b.token)
        assert torch.equal(a.record[block]["output"][0] if isinstance(a.record[block]["output"], tuple)
                           else a.record[block]["output"],
                           b.record[block]["output"][0] if isinstance(b.record[block]["output"], tuple)
                           else b.record[block]["output"])
    fh.testing.assert_no_hooks(model)


def test_a_steps_index_outside_a_generation_is_refused_naming_the_spec() -> None:
    model = nn.Sequential(nn.Identity())
    spec = fh.steer("0", torch.ones(2), index=fh.steps(1, None))
    with pytest.raises(fh.InterventionError) as info, fh.with_hooks(model, spec):
        model(torch.zeros(1, 3, 2))
    assert str(info.value) == (
        "with_hooks: `index=fh.steps(1, None)` addresses the decode steps of `fh.generate` or `fh.iter_generate`, "
        "got a call outside one, at module '0' for steer('0', <Tensor of shape (2,)>, index=fh.steps(1, None)). "
        "Generate through `fh.generate(model, specs, input_ids, ...)`.")
    fh.testing.assert_no_hooks(model)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: fh.steps(-1), "steps: `start` is a step number >= 0 (0 is the prompt pass), got -1. Pass e.g. 3."),
    (lambda: fh.steps(2, 2),
     "steps: `stop` is None or a step after `start` (2), got 2. Pass None for every step from `start` on."),
])
def test_bad_steps_are_refused_when_built(build: Callable[[], object], message: str) -> None:
    with pytest.raises(fh.SpecError) as info:
        build()
    assert str(info.value) == message


def test_generate_refuses_a_model_without_generate_and_per_call_values(lm: tuple[nn.Module, str]) -> None:
    model, block = lm
    with pytest.raises(fh.SpecError) as info:
        fh.generate(nn.Sequential(nn.Identity()), fh.outputs("0"), PROMPT)
    assert str(info.value) == ("generate: `model` has a Hugging Face `generate` method, got Sequential. Pass a "
                               "transformers model with a language-modelling head.")
    with pytest.raises(fh.SpecError, match=r"generate: generation runs forward only with the values in its specs"):
        fh.generate(model, fh.steer(block, fh.arg("v")), PROMPT, **GREEDY)


def test_an_error_inside_iter_generate_is_raised_to_the_consumer(lm: tuple[nn.Module, str]) -> None:
    model, block = lm
    with pytest.raises(fh.InterventionError, match="broadcasts to the value it edits"):
        list(fh.iter_generate(model, fh.steer(block, torch.ones(3)), PROMPT, **GREEDY))
    fh.testing.assert_no_hooks(model)


# -- issue 36: chunked prefill, modes that are not one forward per token, steps that never came, ----------------
# -- a named iterator left suspended ---------------------------------------------------------------------------

PROMPT7 = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1]])


def _hand_loop(model: nn.Module, block: str, vector: torch.Tensor, positions: Callable[[int], list[int]]) -> torch.Tensor:
    """Greedy decoding written out: the whole sequence through the model at each token, a plain
    forward hook adding `vector` at `positions(length)` of the block's output."""
    def hook(module: nn.Module, args: object, output: object) -> object:
        hidden = output[0] if isinstance(output, tuple) else output
        edited = hidden.clone()
        for p in positions(hidden.shape[1]):
            edited[:, p] += vector
        return (edited, *output[1:]) if isinstance(output, tuple) else edited

    ids = PROMPT7
    handle = model.get_submodule(block).register_forward_hook(hook)
    try:
        with torch.no_grad():
            for _ in range(NEW):
                ids = torch.cat([ids, model(ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    finally:
        handle.remove()
    return ids[:, PROMPT7.shape[1]:]


P7 = PROMPT7.shape[1]
CHUNKED = {  # each index, and the positions of a sequence of `n` tokens it edits, written out
    "steps(0, last=True)": (fh.steps(0, last=True), lambda n: [P7 - 1]),
    "steps(0)": (fh.steps(0), lambda n: list(range(P7))),
    "steps(1, None, last=True)": (fh.steps(1, None, last=True), lambda n: list(range(P7, n))),
}


@needs_prompt_chunking
@pytest.mark.parametrize("name", list(CHUNKED))
def test_chunked_prefill_edits_the_positions_of_the_steps_asked_for_as_a_hand_loop(
        lm: tuple[nn.Module, str], name: str) -> None:
    """`prefill_chunk_size=3` runs a 7-token prompt as 3 calls (positions 0-2, 3-5, 6): a steps
    index follows the positions each call really holds (was: the last positions of the sequence,
    so `steps(0, last=True)` edited positions 2, 5 and 6), and the tokens are the hand loop's."""
    model, block = lm
    index, positions = CHUNKED[name]
    torch.manual_seed(4)
    vector = torch.randn(WIDTH) * 4
    spec = fh.steer(block, vector, index=index)
    chunked = fh.generate(model, spec, PROMPT7, prefill_chunk_size=3, **GREEDY)
    assert torch.equal(chunked.tokens, _hand_loop(model, block, vector, positions))
    assert torch.equal(chunked.tokens, fh.generate(model, spec, PROMPT7, **GREEDY).tokens)
    fh.testing.assert_no_hooks(model)


@needs_prompt_chunking
def test_a_chunked_prompt_pass_is_step_0_with_a_call_per_chunk(lm: tuple[nn.Module, str]) -> None:
    """Step 0 holds the 3 calls of the prompt pass (`calls == 3`), each its own positions;
    `last=True` patches the prompt's last position alone, in the last chunk; `new()` keeps
    every position of the prompt pass."""
    model, block = lm
    spec = [fh.patch(block, 0.0, index=fh.steps(0, last=True)), fh.outputs(block)]
    gen = fh.generate(model, spec, PROMPT7, prefill_chunk_size=3, **GREEDY)
    assert [s.calls for s in gen.steps] == [3] + [1] * (NEW - 1)
    values = [_hidden(v) for v in gen.records[0].calls(block, "output")]
    assert [tuple(v.shape) for v in values] == [(2, 3, WIDTH), (2, 3, WIDTH), (2, 1, WIDTH)]
    assert bool((values[2] == 0).all())
    assert all(bool((v != 0).any(-1).all()) for v in values[:2])
    new = [tuple(_hidden(v).shape) for v in gen.steps[0].new().calls(block, "output")]
    assert new == [(2, 3, WIDTH), (2, 3, WIDTH), (2, 1, WIDTH)]


@pytest.mark.parametrize(("options", "got"), [
    ({"num_beams": 2}, "beam search (num_beams=2)"),
    ({"num_beams": 2, "do_sample": True}, "beam sample (num_beams=2)"),
    ({"prompt_lookup_num_tokens": 2}, "assisted generation (prompt_lookup_num_tokens=2)"),
])
def test_modes_that_are_not_one_forward_per_token_are_refused_before_they_run(
        lm: tuple[nn.Module, str], options: dict[str, object], got: str) -> None:
    """Beam search gave `tokens` of (beams, steps) for one prompt, assisted decoding 11 steps for
    12 tokens; both are refused before `generate` runs, by `generate` and `iter_generate`."""
    model, block = lm
    kwargs = {**GREEDY, **options}
    message = (f"generate: steps are the forwards of greedy search or sampling, one per new token, got {got}, which "
               "makes other calls and returns other shapes. Generate with num_beams=1 and no assistant, or call "
               "`model.generate` inside `fh.with_hooks` for one Record of all its calls.")
    with pytest.raises(fh.SpecError) as info:
        fh.generate(model, fh.outputs(block), PROMPT, **kwargs)
    assert str(info.value) == message
    with pytest.raises(fh.SpecError) as info:
        fh.iter_generate(model, fh.outputs(block), PROMPT, **kwargs)
    assert str(info.value) == message.replace("generate:", "iter_generate:", 1)
    fh.testing.assert_no_hooks(model)


def test_an_assistant_model_is_refused_before_it_runs(lm: tuple[nn.Module, str]) -> None:
    model, block = lm
    with pytest.raises(fh.SpecError, match=r"got assisted generation \(assistant_model=\.\.\.\), which makes other "):
        fh.generate(model, fh.outputs(block), PROMPT, assistant_model=model, **GREEDY)
    fh.testing.assert_no_hooks(model)


def test_a_steps_index_after_the_last_step_is_an_error_at_the_end(lm: tuple[nn.Module, str]) -> None:
    """`fh.steps(k)` with k at or past the number of steps edited nothing, silently; now it
    raises when the generation ends, as an op spec that took no op does."""
    model, block = lm
    spec = fh.steer(block, torch.ones(WIDTH), index=fh.steps(NEW, None))
    with pytest.raises(fh.InterventionError) as info:
        fh.generate(model, spec, PROMPT, **GREEDY)
    assert str(info.value) == (
        f"generate: `index=fh.steps({NEW}, None)` addresses decode steps that came, got a generation of {NEW} step(s) "
        f"(0 to {NEW - 1}) for {spec!r}, which edited nothing. Address steps below {NEW}, or generate more tokens "
        "(`max_new_tokens`, no early `eos_token_id`).")
    with pytest.raises(fh.InterventionError, match="iter_generate: `index=fh.steps"):
        list(fh.iter_generate(model, spec, PROMPT, **GREEDY))
    fh.testing.assert_no_hooks(model)
    last = fh.steer(block, torch.ones(WIDTH), index=fh.steps(NEW - 1))
    assert fh.generate(model, last, PROMPT, **GREEDY).tokens.shape == (2, NEW)
    for step in fh.iter_generate(model, spec, PROMPT, **GREEDY):  # closed before the end: no error
        break
    on_op = fh.scale(fh.transformer.points(model).pattern[0], 2.0, index=fh.steps(NEW), dim=2)  # an op spec's
    with pytest.raises(fh.InterventionError, match=rf"generate: `index=fh.steps\({NEW}\)` addresses decode steps"):
        fh.generate(model, on_op, PROMPT, **GREEDY)
    fh.testing.assert_no_hooks(model)


@pytest.mark.usefixtures("frozen_heap")
def test_a_named_iterator_left_suspended_leaves_nothing_on_the_model_and_closes(lm: tuple[nn.Module, str]) -> None:
    """A named `iter_generate` kept after `break` held its hooks until freed; now nothing is
    attached while the consumer holds a step, `with` closes it, and freeing it ends the worker."""
    model, block = lm
    threads = set(threading.enumerate())
    steps = fh.iter_generate(model, fh.outputs(block), PROMPT, max_new_tokens=50, do_sample=False, pad_token_id=0)
    for step in steps:
        if step.step == 1:
            break
    fh.testing.assert_no_hooks(model)
    assert not steps.closed
    assert next(steps).step == 2  # resumes where it was
    del steps, step
    gc.collect()
    assert set(threading.enumerate()) == threads
    with fh.iter_generate(model, fh.outputs(block), PROMPT, max_new_tokens=50, do_sample=False,
                          pad_token_id=0) as steps:
        for step in steps:
            fh.testing.assert_no_hooks(model)
            if step.step == 1:
                break
    assert steps.closed and set(threading.enumerate()) == threads
    with pytest.raises(StopIteration):
        next(steps)
    fh.testing.assert_no_hooks(model)


def test_the_iterator_type_is_public_as_fh_generation_iterator() -> None:
    """`iter_generate` returned a `GenerationIterator` that users could not name (`fh.GenerationIterator`
    was missing from `fh` and from `funhooks.runs`): a type annotation or `isinstance` needs it."""
    import funhooks.runs

    assert fh.GenerationIterator is funhooks.runs.GenerationIterator
    assert "GenerationIterator" in fh.__all__ and "GenerationIterator" in funhooks.runs.__all__
    model = _gpt2().eval()
    with fh.iter_generate(model, (), PROMPT, max_new_tokens=2, do_sample=False, pad_token_id=0) as steps:
        assert isinstance(steps, fh.GenerationIterator)
