"""Runs over Hugging Face ``generate``: a Record per decode step beside its token, decode
steps addressed by ``index=fh.steps(...)`` (the same with and without the KV cache), and the
streaming iterator."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import funhooks as fh

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

PROMPT = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
NEW = 5
GREEDY = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
WIDTH = 32


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
    assert [tuple(r[block]["output"].shape) for r in gen.records] == [(2, 5, WIDTH)] + [(2, 1, WIDTH)] * (NEW - 1)
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
    assert uncached.records[2][block]["output"].shape[1] == PROMPT.shape[1] + 2
    for a, b in zip(cached.steps, uncached.steps):
        torch.testing.assert_close(a.new()[block]["output"], b.new()[block]["output"], atol=1e-5, rtol=1e-5)


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
