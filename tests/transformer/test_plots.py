"""fh.transformer's figures: what a user sees in them (axes, tick labels, titles, the image
data equal to the table given), and the PNGs docs/logit-lens.md shows, drawn here from a
small GPT-2."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import funhooks as fh
from tests.transformer_models import gpt2

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
DPI = 80
TOKENS = ["When", " Mary", " and", " John", " went"]


def _ticks(labels: list) -> list[str]:
    return [t.get_text() for t in labels]


def test_plot_patching_draws_the_table_centred_at_zero_with_token_labels() -> None:
    table = torch.tensor([[0.5, -1.0, 0.0, 2.0, 0.1], [0.0, 3.0, -0.2, 0.0, 1.0]])
    fig = fh.transformer.plot_patching(table, tokens=TOKENS, layers=["L0", "L1"], label="logit difference")
    assert len(fig.axes) == 2   # the heatmap and its colorbar
    ax, bar = fig.axes
    assert ax.get_title() == "Activation patching"
    assert _ticks(ax.get_xticklabels()) == TOKENS
    assert _ticks(ax.get_yticklabels()) == ["L0", "L1"]
    (image,) = ax.images
    assert torch.equal(torch.as_tensor(image.get_array()), table)
    assert image.get_clim() == (-3.0, 3.0)
    assert image.get_cmap().name == "RdBu"
    assert bar.get_ylabel() == "logit difference"


def test_plot_patching_without_labels_numbers_rows_and_positions() -> None:
    fig = fh.transformer.plot_patching(torch.zeros(3, 4))
    ax = fig.axes[0]
    assert _ticks(ax.get_xticklabels()) == ["0", "1", "2", "3"]
    assert _ticks(ax.get_yticklabels()) == ["0", "1", "2"]
    assert ax.images[0].get_clim() == (-1.0, 1.0)    # an all-zero table still has a scale


def test_plot_patching_refuses_labels_that_do_not_match_the_table() -> None:
    with pytest.raises(ValueError) as info:
        fh.transformer.plot_patching(torch.zeros(2, 5), tokens=["a", "b"])
    assert str(info.value) == ("plot_patching: `tokens` has one label per entry (5), got 2: ['a', 'b']. "
                               "Pass as many labels as the tensor has entries along that axis.")
    with pytest.raises(ValueError) as info:
        fh.transformer.plot_patching(torch.zeros(2, 5, 1))
    assert str(info.value) == ("plot_patching: `table` is a `(layers, positions)` table, got shape (2, 5, 1). "
                               "Index or reshape it first.")


def test_plot_patterns_draws_one_axes_per_head_with_its_pattern() -> None:
    pattern = torch.rand(2, 4, 5, 5).softmax(-1)
    fig = fh.transformer.plot_patterns(pattern, tokens=TOKENS, heads=[3, 1, 0], example=1, ncols=2, title="layer 0")
    assert len(fig.axes) == 4   # three heads and the colorbar (the grid's fourth cell is removed)
    assert [ax.get_title() for ax in fig.axes[:3]] == ["head 3", "head 1", "head 0"]
    assert fig.get_suptitle() == "layer 0"
    for ax, head in zip(fig.axes[:3], [3, 1, 0]):
        assert torch.equal(torch.as_tensor(ax.images[0].get_array()), pattern[1, head])
        assert ax.images[0].get_clim() == (0.0, 1.0)
        assert _ticks(ax.get_xticklabels()) == TOKENS and _ticks(ax.get_yticklabels()) == TOKENS


def test_plot_patterns_of_all_heads_of_an_unbatched_pattern() -> None:
    fig = fh.transformer.plot_patterns(torch.rand(3, 2, 2))
    assert [ax.get_title() for ax in fig.axes[:-1]] == ["head 0", "head 1", "head 2"]


def test_plot_patterns_refuses_a_head_it_does_not_have() -> None:
    with pytest.raises(IndexError) as info:
        fh.transformer.plot_patterns(torch.rand(1, 4, 3, 3), heads=[4])
    assert str(info.value) == "plot_patterns: `heads` are in range(4), got 4. Pick heads the pattern has."


def _lens() -> fh.transformer.LogitLens:
    return fh.transformer.LogitLens(torch.randn(3, 2, 4, 10, generator=torch.Generator().manual_seed(0)),
                                    ("blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.resid_post"))


def test_plot_logit_lens_draws_the_probability_per_layer() -> None:
    lens = _lens()
    fig = fh.transformer.plot_logit_lens(lens, 7, position=2, example=1, name=" Paris")
    (ax,) = fig.axes
    torch.testing.assert_close(torch.as_tensor(ax.lines[0].get_ydata()), lens.prob(7)[:, 1, 2])
    assert _ticks(ax.get_xticklabels()) == list(lens.labels)
    assert ax.get_title() == "Logit lens: ' Paris' at position 2"
    assert ax.get_ylabel() == "probability"


def test_plot_logit_lens_draws_the_rank_upside_down() -> None:
    lens = _lens()
    ax = fh.transformer.plot_logit_lens(lens, 7, kind="rank").axes[0]
    assert torch.equal(torch.as_tensor(ax.lines[0].get_ydata()).long(), lens.rank(7)[:, 0, -1])
    assert ax.yaxis_inverted() and ax.get_ylabel() == "rank (0: top)"
    assert ax.get_title() == "Logit lens: token 7 at position -1"


def test_plot_logit_lens_refuses_another_kind() -> None:
    with pytest.raises(ValueError) as info:
        fh.transformer.plot_logit_lens(_lens(), 7, kind="logit")  # type: ignore[arg-type]
    assert str(info.value) == 'plot_logit_lens: `kind` is "prob" or "rank", got \'logit\'.'


def test_the_plots_name_the_extra_without_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    with pytest.raises(fh.ExtraError) as info:
        fh.transformer.plot_patching(torch.zeros(2, 2))
    assert str(info.value) == ("plot_patching: plotting needs matplotlib, got it not installed. "
                               "Install the extra: pip install 'funhooks[plot]'.")


def _stream(output: object) -> torch.Tensor:
    """A block's output stream: the tensor, or element 0 of the 1-tuple blocks return under transformers 4."""
    return output[0] if isinstance(output, tuple) else output


def test_the_docs_figures_from_a_small_gpt2() -> None:
    """Draws docs/images/{patching,patterns,logit_lens}.png (the figures docs/logit-lens.md shows),
    each from values checked against an independent computation."""
    model = gpt2("eager", initializer_range=0.3)   # weights that show
    clean, corrupt = torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 9, 3, 4, 5]])
    resid_pre = ["transformer.drop", "transformer.h.*"]
    _, clean_rec = fh.capture(model, fh.outputs(resid_pre))(clean)
    f = fh.capture(model, fh.patch(resid_pre, fh.arg("clean"), nth=fh.arg("layer"), index=fh.arg("pos")))

    def diff(layer: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        out, _ = f(corrupt, clean=clean_rec, layer=layer, pos=pos, use_cache=False)
        return out.logits[0, -1, 7] - out.logits[0, -1, 8]

    corrupt_out = model(corrupt)
    base = corrupt_out.logits[0, -1, 7] - corrupt_out.logits[0, -1, 8]
    table = torch.func.vmap(diff)(torch.arange(3).repeat_interleave(5), torch.arange(5).repeat(3)).reshape(3, 5) - base
    loop = torch.stack([torch.stack([diff(torch.tensor(L), torch.tensor(p)) for p in range(5)])
                        for L in range(3)]) - base
    torch.testing.assert_close(table, loop, atol=1e-5, rtol=1e-5)
    out = model(clean, output_attentions=True)
    stack = torch.stack([_stream(clean_rec[p]["output"]) for p in ("transformer.drop", "transformer.h.0", "transformer.h.1")])
    labels = ("blocks.0.resid_pre", "blocks.1.resid_pre", "blocks.1.resid_post")
    lens = fh.transformer.logit_lens(model, fh.transformer.ResidualStack(stack, labels))
    answer = int(out.logits[0, -1].argmax())
    assert int(lens.rank(answer)[-1, 0, -1]) == 0      # the last row is the model's own prediction
    figures = {
        "patching": fh.transformer.plot_patching(table, tokens=TOKENS, layers=["0 pre", "1 pre", "1 post"],
                                                 label="change in logit difference",
                                                 title="Patching resid_pre, clean into corrupt"),
        "patterns": fh.transformer.plot_patterns(out.attentions[0], tokens=TOKENS, title="layer 0"),
        "logit_lens": fh.transformer.plot_logit_lens(lens, answer, kind="rank"),
    }
    IMAGES.mkdir(exist_ok=True)
    for name, fig in figures.items():
        fig.savefig(IMAGES / f"{name}.png", dpi=DPI, metadata={"Software": None})
        assert (IMAGES / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("kind", ["prob", "rank"])
def test_plot_logit_lens_of_a_lens_made_from_a_record(kind: str) -> None:
    """Issue 36 item 18: a lens from a Record holds logits that require grad (the model's
    parameters do); every kind draws them."""
    model = gpt2("eager")
    pts = fh.transformer.points(model)
    _, rec = fh.capture(model, fh.outputs(pts.resid_post))(torch.tensor([[1, 2, 3, 4]]))
    lens = fh.transformer.logit_lens(model, rec)
    assert lens.logits.requires_grad
    ax = fh.transformer.plot_logit_lens(lens, 7, kind=kind).axes[0]
    expected = lens.prob(7) if kind == "prob" else lens.rank(7)
    assert torch.equal(torch.as_tensor(ax.lines[0].get_ydata()), expected[:, 0, -1].detach().float())
