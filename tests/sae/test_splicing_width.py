"""An SAE of another width than its standard point's is refused by ``fh.sae.splice`` itself,
before any forward, with a SpecError naming the point, its module, both widths and the fix; the
widths the points carry are those of the values the model makes there, on every family."""

from __future__ import annotations

import pytest
import torch

import funhooks as fh
from sae_kit import SAE
from transformer_models import BUILDERS, gpt2, inputs

IDS = torch.arange(12).reshape(2, 6) % 50
_SIZED = ("embed", "pos_embed", "resid_pre", "resid_post", "attn_out", "mlp_in", "mlp_pre", "mlp_post", "mlp_out",
          "q", "k", "v", "z", "result", "final_norm", "logits")


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_every_points_width_is_that_of_its_value_and_a_wrong_sae_is_refused_by_splice(family: str) -> None:
    model = BUILDERS[family]()
    pts = fh.transformer.points(model)
    taken = [p if p.paths[0][0] is None else p[0] for p in (getattr(pts, n) for n in _SIZED) if p.kind != "none"]
    _, rec = fh.capture(model, [fh.outputs(p) for p in taken])(**inputs(family))
    for point, key in ((p, p.keys[0]) for p in taken):
        value = rec[key]["output"]
        assert point.width == value.shape[-1], (family, point)
        assert point.heads == (value.shape[-2] if point.heads else 0), (family, point)
        if point.kind == "result":
            continue  # computed on the output projection, not a value to splice at
        fh.sae.splice(point, SAE(point.width, 8))
        with pytest.raises(fh.SpecError, match=rf"d_in={point.width + 1}, got `{point!r}`".replace("[", r"\[")):
            fh.sae.splice(point, SAE(point.width + 1, 8))
    fh.testing.assert_no_hooks(model)


def test_the_width_error_is_raised_by_splice_before_any_module_runs_naming_the_point_and_the_fix() -> None:
    model = gpt2()
    pts = fh.transformer.points(model)
    calls = []
    handle = model.transformer.wte.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        with pytest.raises(fh.SpecError) as err:
            fh.capture(model, fh.sae.splice(pts.resid_post[1], SAE(48, 8)))(IDS)
    finally:
        handle.remove()
    assert calls == []
    assert str(err.value) == (
        "sae.splice: the SAE reads vectors of its width d_in=48, got `resid_post[1]` (module `transformer.h.1`), whose "
        "values on this model are of width 32, for the SAE. Splice it at the point it was trained on, or train one of "
        "width 32.")
    with pytest.raises(fh.SpecError, match=r"d_in=32, got `mlp_post\[0\]` \(module `transformer.h.0.mlp.c_proj`\), "
                       r"whose values on this model are of width 128.*train one of width 128"):
        fh.sae.splice(pts.mlp_post[0], SAE(32, 8))
    fh.testing.assert_no_hooks(model)


def test_a_head_point_takes_an_sae_as_wide_as_one_head_or_all_and_names_both_otherwise() -> None:
    model = gpt2()
    pts = fh.transformer.points(model)
    for d_in in (8, 32):
        out, rec = fh.capture(model, fh.sae.splice(pts.z[0], SAE(d_in, 16)))(IDS)
        assert rec["blocks.0.z.sae"]["features"].shape[-1] == 16
    with pytest.raises(fh.SpecError, match=r"d_in=12, got `z\[0\]` \(module `transformer.h.0.attn.c_proj`\), whose "
                       r"values on this model are of 4 heads of width 8, 32 flattened.*train one of width 8 or 32"):
        fh.sae.splice(pts.z[0], SAE(12, 16))
    fh.testing.assert_no_hooks(model)


def test_at_a_module_path_the_width_is_still_checked_at_the_first_call() -> None:
    model = gpt2()
    with pytest.raises(fh.HookError, match=r"d_in=48, got values of width 32.*transformer.h.1") as err:
        fh.capture(model, fh.sae.splice("transformer.h.1", SAE(48, 8)))(IDS)
    assert isinstance(err.value.__cause__, fh.SpecError)
    fh.testing.assert_no_hooks(model)
