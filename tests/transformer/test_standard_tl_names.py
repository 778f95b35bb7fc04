"""docs/transformers.md's table "TransformerLens name -> funhooks point", checked row by row
against TransformerLens itself (issue 36 item 20): a `HookedTransformer` built from the same
GPT-2 weights, with no weight processing (no folded norms, no centring), run on the same
tokens; every TransformerLens hook named in a row holds the value of the funhooks point named
beside it, at every layer. Runs where the `tl` extra (transformer-lens 3.9, with
`HookedTransformer`; `.ci/run` installs it) is installed; skipped with the reason otherwise."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import funhooks as fh
from tests.transformer_models import HEADS, HIDDEN, LAYERS, POSITIONS, VOCAB, gpt2

tl = pytest.importorskip("transformer_lens", reason="the `tl` extra (transformer-lens) is not installed: "
                         "pip install 'funhooks[tl]' to check the table against TransformerLens")
if not hasattr(tl, "HookedTransformer"):  # transformer_lens raises ImportError from its __getattr__ in 4.0
    pytest.skip("this transformer-lens has no `HookedTransformer` (removed in TransformerLens 4): "
                "pip install 'transformer-lens<4' to check the table", allow_module_level=True)

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"
SECTION = "## TransformerLens name -> funhooks point"
CODE = re.compile(r"`([^`]+)`")
POINT = re.compile(r"pts\.(\w+)(\[L\])?$")


def _rows() -> list[tuple[str, str, bool]]:
    """(TransformerLens hook name with `L` for the layer, funhooks point name, per layer) for every
    hook named in the table; a row's later names without a prefix take the first one's."""
    text = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    pairs = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[1].startswith("`pts."):
            continue
        hooks, names = CODE.findall(cells[0]), CODE.findall(cells[1])
        assert len(hooks) == len(names), line
        prefix = hooks[0].rpartition(".")[0]
        for hook, name in zip(hooks, names, strict=True):
            point = POINT.fullmatch(name)
            assert point is not None, line
            pairs.append((hook if "." in hook or not prefix else f"{prefix}.{hook}", point[1], bool(point[2])))
    return pairs


def _hooked_transformer(model: torch.nn.Module) -> torch.nn.Module:
    cfg = tl.HookedTransformerConfig(
        n_layers=LAYERS, d_model=HIDDEN, n_ctx=POSITIONS, d_head=HIDDEN // HEADS, n_heads=HEADS, d_mlp=4 * HIDDEN,
        d_vocab=VOCAB, act_fn="gelu_new", normalization_type="LN", eps=model.config.layer_norm_epsilon,
        positional_embedding_type="standard", use_hook_mlp_in=True, use_attn_result=True,
        default_prepend_bos=False)
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    hooked = tl.HookedTransformer(cfg)
    hooked.load_and_process_state_dict(convert_gpt2_weights(model, cfg), fold_ln=False, center_writing_weights=False,
                                       center_unembed=False, fold_value_biases=False)
    return hooked.eval()


@pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning")
def test_every_row_of_the_table_holds_transformer_lens_value() -> None:
    model = gpt2("eager")
    rows = _rows()
    assert ("blocks.L.hook_mlp_in", "resid_mid", True) in rows          # the stream before ln2 ...
    assert ("blocks.L.ln2.hook_normalized", "mlp_in", True) in rows     # ... and the MLP's input
    assert len(rows) >= 17
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    hooked = _hooked_transformer(model)
    with torch.no_grad():
        tl_logits, cache = hooked.run_with_cache(ids)
    pts = fh.transformer.points(model)
    out, rec = fh.capture(model, [fh.outputs(getattr(pts, name)) for name in {n for _, n, _ in rows}])(ids)
    torch.testing.assert_close(tl_logits, out.logits, atol=1e-5, rtol=1e-4)
    for hook, name, per_layer in rows:
        for layer in range(LAYERS) if per_layer else [None]:
            theirs = cache[hook.replace(".L.", f".{layer}.")]
            ours = rec[name if layer is None else f"blocks.{layer}.{name}"]["output"]
            if name == "pos_embed":  # the model's own (1, position, d_model); TransformerLens broadcasts it
                assert ours.shape[0] == 1, hook
                ours = ours.expand_as(theirs)
            assert theirs.shape == ours.shape, (hook, name)
            if name == "attn_scores":  # masked: -inf in TransformerLens, the dtype's minimum under eager
                masked = ours < torch.finfo(ours.dtype).min / 2
                assert torch.equal(theirs.isneginf(), masked), hook
                theirs, ours = theirs[~masked], ours[~masked]
            torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-4, msg=lambda m: f"{hook} vs pts.{name}: {m}")
