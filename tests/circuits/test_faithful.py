"""Faithfulness runs (issue 38): keeping every edge runs the clean model, keeping none the
corrupted one; cutting one head's edge equals patching that head's query (key) from the
corrupted run by hand; the mean reference; the curve over circuit sizes; errors."""

from __future__ import annotations

import pytest
import torch
import transformer_models as tm

import funhooks as fh

FAMILIES = ("gpt2", "neox", "neox_seq", "llama")


def logit_diff(out: object) -> torch.Tensor:
    return out.logits[:, -1, 7] - out.logits[:, -1, 8]  # type: ignore[attr-defined]


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]])
    corrupt = clean.clone()
    corrupt[:, 2] = 9
    return clean, corrupt


@pytest.mark.parametrize("attn", tm.ATTENTION)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_edge_runs_the_clean_model_and_none_the_corrupted_one(family: str, attn: str) -> None:
    model = tm.BUILDERS[family](attn)
    clean, corrupt = _prompts()
    g = fh.circuits.graph(model)
    run = fh.circuits.faithfulness(model, logit_diff)
    everything, nothing = run(clean, corrupt, g.upstream), run(clean, corrupt, torch.zeros_like(g.upstream))
    with torch.no_grad():
        assert torch.equal(everything.metric, logit_diff(model(clean)).sum())
        assert torch.allclose(nothing.metric, logit_diff(model(corrupt)).sum(), atol=1e-5)
    assert (everything.edges, nothing.edges) == (g.n_edges, 0)
    assert abs(everything.recovered - 1) < 1e-6 and abs(nothing.recovered) < 1e-3


@pytest.mark.parametrize(("family", "part", "head"), [("gpt2", "q", 1), ("neox", "v", 3), ("llama", "k", 1)])
def test_cutting_one_heads_edge_is_that_heads_patch_by_hand(family: str, part: str, head: int) -> None:
    """Cutting the embeddings -> layer 0's head `head` `part` input: that head's `part` (and no
    other head's) becomes the corrupted run's, as an ``fh.edit`` of the standard point does by hand."""
    model = tm.BUILDERS[family]("sdpa")
    clean, corrupt = _prompts()
    g = fh.circuits.graph(model)
    kept = g.upstream.clone()
    kept[g.writers.index("embed"), g.reader(0, part, head)] = False
    circuit = fh.circuits.faithfulness(model, logit_diff)(clean, corrupt, kept)
    point = getattr(g.points, part)[0]
    _, rec = fh.capture(model, fh.outputs(point))(corrupt)
    corrupted = rec[point.keys[0]]["output"]

    def one_head(module: torch.nn.Module, args: tuple, value: torch.Tensor) -> torch.Tensor:
        new = value.clone()
        new[:, :, head] = corrupted[:, :, head]
        return new

    by_hand, _ = fh.capture(model, fh.edit(point, one_head))(clean)
    assert torch.allclose(circuit.metric, logit_diff(by_hand).sum(), atol=1e-5)
    assert not torch.allclose(circuit.metric, circuit.clean, atol=1e-6)


def test_the_mean_reference_of_identical_rows_is_the_corrupted_run() -> None:
    model = tm.gpt2()
    clean, corrupt = _prompts()
    corrupt = corrupt[:1].expand(2, -1)
    g = fh.circuits.graph(model)
    kept = g.upstream & (torch.arange(g.upstream.numel()).reshape(g.upstream.shape) % 3 == 0)
    same = [fh.circuits.faithfulness(model, logit_diff, reference=r)(clean, corrupt, kept).metric
            for r in ("corrupt", "mean")]
    assert torch.allclose(same[0], same[1], atol=1e-6)


def test_the_curve_goes_from_the_corrupted_run_to_the_clean_one() -> None:
    pytest.importorskip("matplotlib")
    model = tm.llama()
    clean, corrupt = _prompts()
    edges = fh.circuits.eap(model, logit_diff)(clean, corrupt)
    sizes = [0, 5, 20, edges.n_edges]
    curve = fh.circuits.faithfulness_curve(model, logit_diff, edges, sizes)(clean, corrupt)
    assert curve.sizes == tuple(sizes) and curve.metrics.shape == (4,)
    assert abs(float(curve.recovered[0])) < 1e-3 and abs(float(curve.recovered[-1]) - 1) < 1e-6
    single = fh.circuits.faithfulness(model, logit_diff)(clean, corrupt, edges.circuit(5))
    assert torch.equal(single.metric, curve.metrics[1])
    ax = curve.plot().axes[0]
    assert ax.get_xlabel() == "edges kept" and list(ax.lines[0].get_xdata()) == sizes


def test_bad_circuits_and_references_are_refused() -> None:
    model = tm.gpt2()
    clean, corrupt = _prompts()
    run = fh.circuits.faithfulness(model, logit_diff)
    with pytest.raises(fh.SpecError, match=r"`kept` is a bool mask of shape \(writers, readers\) = \(12, 27\)"):
        run(clean, corrupt, torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(fh.SpecError, match="`kept` is a bool mask"):
        run(clean, corrupt, torch.ones(12, 27))
    with pytest.raises(fh.SpecError, match="`reference` is 'corrupt'"):
        fh.circuits.faithfulness(model, logit_diff, reference="zero")  # type: ignore[arg-type]
    with pytest.raises(fh.SpecError, match="same shape"):
        run(clean, corrupt[:1], torch.ones(12, 27, dtype=torch.bool))
    other = fh.circuits.eap(tm.llama(), logit_diff)(clean, corrupt)
    with pytest.raises(fh.SpecError, match="of another graph"):
        fh.circuits.faithfulness_curve(model, logit_diff, other, [1])
