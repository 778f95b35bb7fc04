"""A model's circuit graph (issue 38): the writers under ``decompose_resid``'s labels, the readers
per head (k and v per key-value head), the edges of sequential and parallel blocks, and the sum
of the writers upstream of each reader (plus the output projections' biases) equal to its input."""

from __future__ import annotations

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
import transformer_models as tm

import funhooks as fh


def test_gpt2_writers_are_decompose_resids_and_readers_are_per_head() -> None:
    g = fh.circuits.graph(tm.gpt2())
    assert g.writers == ("embed", "pos_embed", *(f"blocks.0.heads.{h}" for h in range(4)), "blocks.0.mlp_out",
                         *(f"blocks.1.heads.{h}" for h in range(4)), "blocks.1.mlp_out")
    assert g.readers[:13] == (*(f"blocks.0.heads.{h}.{p}" for p in "qkv" for h in range(4)), "blocks.0.mlp")
    assert g.readers[-1] == "logits" and len(g.readers) == 27
    assert g.writer(1, 2) == g.writers.index("blocks.1.heads.2") and g.reader(1, "v", 3) == 24
    assert (g.attn_norms, g.mlp_norms, g.final_norm) == (
        ("transformer.h.0.ln_1", "transformer.h.1.ln_1"), ("transformer.h.0.ln_2", "transformer.h.1.ln_2"),
        "transformer.ln_f")


def test_grouped_query_attention_has_a_key_and_value_reader_per_key_value_head() -> None:
    g = fh.circuits.graph(tm.llama())
    assert g.embeds == 1 and len(g.readers) == 2 * (4 + 2 + 2 + 1) + 1
    assert g.readers[4:8] == ("blocks.0.heads.0.k", "blocks.0.heads.1.k", "blocks.0.heads.0.v", "blocks.0.heads.1.v")


@pytest.mark.parametrize(("family", "parallel"), [("neox", True), ("neox_seq", False), ("gpt2", False)])
def test_an_mlp_reads_its_own_layers_heads_only_in_sequential_blocks(family: str, parallel: bool) -> None:
    g = fh.circuits.graph(tm.BUILDERS[family]())
    mlp, head = g.reader(1), g.writer(1, 0)
    assert g.parallel is parallel
    assert bool(g.upstream[head, mlp]) is not parallel
    assert not g.upstream[g.writer(1), mlp]  # an MLP does not read itself
    assert not g.upstream[head, g.reader(1, "q", 0)] and g.upstream[g.writer(0), g.reader(1, "q", 0)]
    assert bool(g.upstream[:, -1].all())  # the logits read every writer


def _reader_inputs(model: torch.nn.Module, g: fh.circuits.Graph, ids: torch.Tensor) -> tuple[fh.Record, list]:
    pts = g.points
    specs = [*(fh.outputs(p) for p in pts.writers), fh.outputs(pts.resid_pre), fh.inputs(list(g.mlp_norms)),
             fh.inputs(g.final_norm)]
    _, rec = fh.capture(model, specs)(ids)
    inputs = []
    for column, reader in enumerate(g.readers):
        if reader == "logits":
            inputs.append(rec[g.final_norm]["input"][0][0])  # (args, kwargs)
            continue
        layer = int(reader.split(".")[1])
        inputs.append(rec[g.mlp_norms[layer]]["input"][0][0] if reader.endswith("mlp")
                      else rec[f"blocks.{layer}.resid_pre"]["output"])
    return rec, inputs


@hypothesis.settings(max_examples=10, deadline=None)
@hypothesis.given(family=st.sampled_from(["gpt2", "neox", "neox_seq", "llama"]), attn=st.sampled_from(tm.ATTENTION),
                  tokens=st.lists(st.integers(0, tm.VOCAB - 1), min_size=6, max_size=6))
def test_the_writers_upstream_of_a_reader_sum_to_its_input(family: str, attn: str, tokens: list[int]) -> None:
    """With ``fh.transformer.decompose_resid``'s rows: the writers upstream of each reader, plus the
    output projections' biases of the layers whose heads are upstream, sum to the reader's input."""
    model = tm.BUILDERS[family](attn)
    g = fh.circuits.graph(model)
    rec, inputs = _reader_inputs(model, g, torch.tensor(tokens).reshape(2, 3))
    d = fh.transformer.decompose_resid(model, rec)
    rows = dict(zip(d.labels, d.resid))
    for column, value in enumerate(inputs):
        upstream = [w for i, w in enumerate(g.writers) if g.upstream[i, column]]
        biases = {f"{w.rsplit('.', 2)[0]}.attn_bias" for w in upstream if ".heads." in w} & set(rows)
        total = sum(rows[w] for w in [*upstream, *biases])
        assert torch.allclose(total, value, atol=1e-5), g.readers[column]


def test_a_post_norm_family_is_refused() -> None:
    with pytest.raises(fh.SpecError, match="pre-norm families .* got the 'bert' family"):
        fh.circuits.graph(tm.bert())
