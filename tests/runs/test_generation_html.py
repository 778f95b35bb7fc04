"""A Generation's notebook display: the tokens, step by step, and what each step recorded."""

from __future__ import annotations

import torch
import transformers
from html_kit import assert_self_contained, seen

import funhooks as fh


def _generation(batch: int = 1, new: int = 3) -> fh.Generation:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config).eval()
    prompt = torch.arange(1, 4).repeat(batch, 1) + torch.arange(batch)[:, None]
    return fh.generate(model, fh.outputs("transformer.h.0"), prompt, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=0, use_cache=False)


def test_each_step_shows_its_token_its_calls_and_what_it_recorded() -> None:
    gen = _generation()
    vocab = [f"<tok {i}>" for i in range(20)]
    markup = gen.html(vocab=vocab)
    rows = seen(markup).texts()
    assert rows[0] == ["step", "sequence 0", "calls", "record"]
    assert rows[1:] == [[str(s), vocab[t], "1", "1 module(s)"] for s, t in enumerate(gen.tokens[0].tolist())]
    assert "<tok" not in markup  # escaped
    assert_self_contained(markup)
    assert [r[1] for r in seen(gen._repr_html_()).texts()[1:]] == [str(t) for t in gen.tokens[0].tolist()]


def test_a_batch_shows_one_column_per_sequence_up_to_eight() -> None:
    gen = _generation(batch=10, new=2)
    shown = seen(gen._repr_html_())
    assert shown.texts()[0] == ["step", *(f"sequence {b}" for b in range(8)), "calls", "record"]
    assert [r[1:9] for r in shown.texts()[1:]] == [[str(t) for t in col] for col in gen.tokens[:8].T.tolist()]
    assert "10 sequences" in shown.caption


def test_the_plain_reprs_stay_short() -> None:
    gen = _generation(new=20)
    assert repr(gen) == "Generation(steps=20, tokens=Tensor(1, 20))"
    assert repr(gen.steps[0]) == "GenerationStep(step=0, token=Tensor(1,), record=<1 module(s)>, prompt=3, calls=1)"
