"""A LogitLens' notebook display: the top token of every layer at every position, with its
probability, and the top k on hover."""

from __future__ import annotations

import pytest
import torch
import transformers
from html_kit import assert_self_contained, seen

import funhooks as fh

VOCAB = ["<script>alert(1)</script>", " cat", " sat", "&", " the"]


def _lens() -> fh.transformer.LogitLens:
    torch.manual_seed(0)
    logits = torch.randn(3, 2, 4, len(VOCAB)) * 3  # (layers, batch, position, vocab)
    return fh.transformer.LogitLens(logits, tuple(f"blocks.{i}.resid_post" for i in range(3)))


def test_each_layer_shows_its_top_token_and_probability_at_each_position() -> None:
    lens = _lens()
    markup = lens.html(vocab=VOCAB, tokens=["a", "b", "c", "d"], k=2)
    shown = seen(markup)
    assert shown.texts()[0] == ["layer", "a", "b", "c", "d"]
    top = lens.top(2)
    for layer, row in enumerate(shown.rows[1:]):
        assert row[0].text == lens.labels[layer]
        for pos, cell in enumerate(row[1:]):
            ids, probs = top.indices[layer, 0, pos].tolist(), top.values[layer, 0, pos].tolist()
            assert cell.text == f"{VOCAB[ids[0]]} {round(probs[0], 2):.2f}"
            assert cell.title == ", ".join(f"{VOCAB[i]!r} {round(p, 2):.2f}" for i, p in zip(ids, probs))
    assert "example 0" in shown.caption
    assert "<script" not in markup
    assert_self_contained(markup)


def test_without_a_vocabulary_the_ids_are_shown_and_a_callable_decodes() -> None:
    lens = _lens()
    top1 = lens.top(1).indices[:, 0, :, 0].tolist()
    assert [[c.split()[0] for c in r[1:]] for r in seen(lens._repr_html_()).texts()[1:]] == [[str(i) for i in r] for r in top1]
    decoded = seen(lens.html(vocab=lambda i: f"tok{i}")).texts()
    assert decoded[1][1].startswith(f"tok{top1[0][0]} ")


def test_a_long_prompt_shows_its_last_positions_and_a_huge_vocabulary_stays_on_its_device() -> None:
    logits = torch.zeros(2, 1, 100, 50_000)
    logits[:, 0, :, 7] = 5.0
    lens = fh.transformer.LogitLens(logits, ("blocks.0.resid_post", "blocks.1.resid_post"))
    rows = seen(lens.html(tokens=[f"t{i}" for i in range(100)])).texts()
    assert rows[0] == ["layer", *(f"t{i}" for i in range(68, 100))]
    assert rows[1][1].startswith("7 ")
    assert len(repr(lens)) < 200
    with pytest.raises(ValueError, match=r"LogitLens.html: `tokens` has one label per position \(100\)"):
        lens.html(tokens=["a"])


def test_a_gpt2_logit_lens_is_displayed() -> None:
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=30, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    p = fh.transformer.points(model)
    with torch.no_grad():
        _, rec = fh.capture(model, fh.outputs(p.resid_post))(torch.tensor([[1, 2, 3]]))
    lens = fh.transformer.logit_lens(model, rec)
    rows = seen(lens._repr_html_()).texts()
    assert [r[0] for r in rows[1:]] == list(lens.labels) and len(rows[0]) == 1 + 3


def test_a_residual_stacks_repr_stays_short() -> None:
    labels = tuple(f"blocks.{i}.resid_pre" for i in range(48))
    stack = fh.transformer.ResidualStack(torch.zeros(48, 1, 1000, 64), labels)
    assert len(repr(stack)) < 200 and "Tensor(48, 1, 1000, 64)" in repr(stack)
