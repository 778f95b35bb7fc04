"""Attribution patching (issue 29): `(clean - corrupt) · d metric / d activation` for every
point and position from one clean forward and one corrupted forward and backward, equal to the
estimate computed by hand with plain autograd, close to the real patching sweep, per head on
GPT-2's attention output before the projection; errors that name the module and the fix."""

from __future__ import annotations

import copy

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from torch import nn

import funhooks as fh

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, LAYERS, WIDTH, HEADS = 40, 2, 16, 2
RESID_PRE = ["transformer.drop", "transformer.h.*"]
Z = "transformer.h.*.attn.c_proj"
"""The heads' outputs before the projection (TransformerLens' ``z``): the input of ``c_proj``."""


def _gpt2(device: torch.device | str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=16,
                                     bos_token_id=0, eos_token_id=0, attn_implementation="eager")
    return transformers.GPT2LMHeadModel(config).eval().to(device)


def _prompts(device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    clean = torch.tensor([[1, 2, 3, 4, 5], [5, 4, 3, 2, 1]], device=device)
    corrupt = clean.clone()
    corrupt[:, 2] = 9
    return clean, corrupt


def logit_diff(out: object) -> torch.Tensor:
    return out.logits[..., -1, 7] - out.logits[..., -1, 8]  # type: ignore[attr-defined]


def _by_hand(model: nn.Module, modules: list[nn.Module], clean: torch.Tensor, corrupt: torch.Tensor, *,
             inputs: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(clean, corrupt, d metric / d corrupt) per module, with registered hooks and retain_grad."""
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, *args: object) -> None:
        value = args[0][0] if inputs else args[1]  # type: ignore[index]
        if isinstance(value, tuple):  # a block's output under transformers 4.x: (hidden,)
            value = value[0]
        if value.requires_grad:
            value.retain_grad()
        seen.append(value)

    handles = [m.register_forward_pre_hook(keep) if inputs else m.register_forward_hook(keep) for m in modules]
    try:
        with torch.no_grad():
            model(clean, use_cache=False)
        clean_values, seen[:] = list(seen), []
        logit_diff(model(corrupt, use_cache=False)).sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return [(c, v.detach(), v.grad) for c, v in zip(clean_values, seen)]


def test_table_equals_the_estimate_computed_by_hand(device: torch.device) -> None:
    """Each row is `((clean - corrupt) * grad).sum((0, 2))` of the residual stream before a layer,
    the grad from plain autograd with retain_grad, bit for bit; the metrics are the model's."""
    model, (clean, corrupt) = _gpt2(device), _prompts(device)
    result = fh.attribution_patching(model, RESID_PRE, logit_diff)(clean, corrupt, use_cache=False)
    modules = [model.transformer.drop, *model.transformer.h]
    expected = torch.stack([((c - v) * g).sum((0, 2)) for c, v, g in _by_hand(model, modules, clean, corrupt,
                                                                               inputs=False)])
    assert result.points == ("transformer.drop", "transformer.h.0", "transformer.h.1")
    assert torch.equal(result.table, expected)
    with torch.no_grad():
        assert torch.equal(result.clean, logit_diff(model(clean)).sum())
        assert torch.allclose(result.corrupt, logit_diff(model(corrupt)).sum(), atol=1e-6)
    assert all(p.grad is None for p in model.parameters())
    fh.testing.assert_no_hooks(model)


def test_heads_of_the_attention_output_before_the_projection_equal_the_hand_estimate(device: torch.device) -> None:
    """`inputs=True, heads=n` on `attn.c_proj`: one column per head, the hand estimate summed over
    the batch and each head's slice of the last axis."""
    model, (clean, corrupt) = _gpt2(device), _prompts(device)
    atp = fh.attribution_patching(model, Z, logit_diff, inputs=True, heads=HEADS)
    result = atp(clean, corrupt, use_cache=False)
    modules = [block.attn.c_proj for block in model.transformer.h]
    expected = torch.stack([((c - v) * g).reshape(2, 5, HEADS, WIDTH // HEADS).sum((0, 3))
                            for c, v, g in _by_hand(model, modules, clean, corrupt, inputs=True)])
    assert tuple(result.table.shape) == (LAYERS, 5, HEADS)
    assert torch.equal(result.table, expected)
    assert torch.allclose(result.table.sum(-1), fh.attribution_patching(model, Z, logit_diff, inputs=True)(
        clean, corrupt, use_cache=False).table, atol=1e-7)


def test_table_correlates_with_the_vmapped_patching_sweep() -> None:
    """The estimate tracks the real sweep (vmapped `fh.patch` minus the corrupted metric): a
    positive correlation (0.99 measured on this model; docs/interventions.md)."""
    model, (clean, corrupt) = _gpt2(), _prompts()
    result = fh.attribution_patching(model, RESID_PRE, logit_diff)(clean, corrupt, use_cache=False)
    _, clean_rec = fh.capture(model, fh.outputs(RESID_PRE))(clean)
    f = fh.capture(model, fh.patch(RESID_PRE, clean_rec, nth=fh.arg("layer"), index=fh.arg("pos")))

    def patched(layer: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return logit_diff(f(corrupt, layer=layer, pos=pos, use_cache=False)[0]).sum()

    rows = len(result.points)
    sweep = torch.func.vmap(patched)(torch.arange(rows).repeat_interleave(5), torch.arange(5).repeat(rows))
    real = sweep.reshape(rows, 5) - result.corrupt
    correlation = torch.corrcoef(torch.stack([real.flatten(), result.table.flatten()]))[0, 1]
    assert correlation > 0


@hypothesis.given(seed=st.integers(0, 2**16), batch=st.integers(1, 3), positions=st.integers(1, 4))
def test_estimate_is_the_patch_where_the_metric_is_linear_in_the_point(seed: int, batch: int, positions: int) -> None:
    """Where everything after the point is linear, each entry equals the real patch of that
    position (every example of the batch at once) minus the corrupted metric."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    clean, corrupt = torch.randn(batch, positions, 3), torch.randn(batch, positions, 3)
    result = fh.attribution_patching(model, "1", lambda out: out[..., 0])(clean, corrupt)
    with torch.no_grad():
        hidden_clean, hidden_corrupt = model[1](model[0](clean)), model[1](model[0](corrupt))
        for pos in range(positions):
            patched = hidden_corrupt.clone()
            patched[:, pos] = hidden_clean[:, pos]
            change = model[2](patched)[..., 0].sum() - result.corrupt
            assert torch.allclose(result.table[0, pos], change, atol=1e-5)


def test_a_module_called_twice_gives_a_row_per_call() -> None:
    """A shared module's calls are rows of their own, in call order, under its path."""
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    result = fh.attribution_patching(model, "0", lambda out: out.sum())(torch.randn(1, 4, 3), torch.randn(1, 4, 3))
    assert result.points == ("0", "0") and tuple(result.table.shape) == (2, 4)


def test_inputs_of_another_shape_are_refused() -> None:
    """A corrupted prompt of another length is refused, not broadcast."""
    model, (clean, _) = _gpt2(), _prompts()
    atp = fh.attribution_patching(model, "transformer.drop", logit_diff)
    with pytest.raises(fh.InterventionError) as err:
        atp(clean, clean[:, :4], use_cache=False)
    assert str(err.value) == (
        "attribution_patching: `clean` and `corrupt` have the same shape, got (2, 5) and (2, 4). Pad or truncate "
        "the prompts to one length.")
    fh.testing.assert_no_hooks(model)


class _ShorterWithoutGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if torch.is_grad_enabled() else x[:1]


def test_a_value_of_another_shape_in_the_second_pass_is_refused_not_broadcast() -> None:
    """activation_grads' probe of a value whose shape changed between its two passes raises
    (a probe would otherwise broadcast and sum the gradient over the batch)."""
    model = nn.Sequential(nn.Linear(3, 3), _ShorterWithoutGrad())
    with pytest.raises(fh.HookError) as err:
        fh.activation_grads(model, "1", lambda out: out.sum())(torch.randn(2, 3))
    assert str(err.value.__cause__) == (
        "activation_grads: every selected module runs the same way in both forward passes, got module '1' "
        "giving a value of shape (2, 3) where the first pass saw (1, 3). Pass inputs of the same shape to both "
        "passes.")


def test_element_dim_and_heads_that_do_not_fit_are_refused() -> None:
    """Each names the module, the value's shape and what to pass."""
    model, (clean, corrupt) = _gpt2(), _prompts()
    with pytest.raises(fh.InterventionError) as err:
        fh.attribution_patching(model, "transformer.h.0.attn", logit_diff, element=2)(clean, corrupt)
    assert str(err.value) == (
        "attribution_patching: a point is a floating tensor, or the item `element` of a tuple, list or dict, got "
        "tuple with element=2 at module 'transformer.h.0.attn'. Pass the `element` of the value to attribute.")
    with pytest.raises(fh.InterventionError) as err:
        fh.attribution_patching(model, Z, logit_diff, inputs=True, heads=3)(clean, corrupt)
    assert str(err.value) == (
        "attribution_patching: `heads` divides the last axis of the point's value, got heads=3 for a value of "
        "shape (2, 5, 16) at module 'transformer.h.0.attn.c_proj'. Pass the number of heads concatenated there.")
    with pytest.raises(fh.InterventionError) as err:
        fh.attribution_patching(model, Z, logit_diff, inputs=True, heads=2, dim=-1)(clean, corrupt)
    assert str(err.value) == (
        "attribution_patching: `dim` is an axis of the point's value other than the one split into heads, got "
        "dim=-1 for a value of shape (2, 5, 16) at module 'transformer.h.0.attn.c_proj'. Pass the position axis.")
    fh.testing.assert_no_hooks(model)


def test_points_of_different_position_sizes_are_refused() -> None:
    """Rows must line up: points with another size along `dim` raise, naming each shape."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(fh.InterventionError) as err:
        fh.attribution_patching(model, ["0", "2"], lambda out: out.sum(), dim=-1)(torch.randn(2, 3), torch.randn(2, 3))
    assert str(err.value) == (
        "attribution_patching: every point has the same size along `dim` (and the same heads), got "
        "{'0': (4,), '2': (2,)} for dim=-1. Select points of one kind per call.")


# -- issue 36: values with None items (SDPA attention, GPT-2's block arguments), standard points ---------------

import transformer_models as tm  # noqa: E402  (the small models of every family)

CAUSAL = ("gpt2", "llama", "neox")


def _tm_prompts(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    clean = tm.inputs(name)["input_ids"]
    corrupt = clean.clone()
    corrupt[:, 2] = 9
    return clean, corrupt


def tm_metric(out: object) -> torch.Tensor:
    return out.logits[..., -1, 7] - out.logits[..., -1, 8]  # type: ignore[attr-defined]


def _hand_item(model: nn.Module, modules: list[nn.Module], clean: torch.Tensor, corrupt: torch.Tensor, *,
               inputs: bool = False) -> torch.Tensor:
    """The estimate per module of item 0 of its output (or of its first positional argument),
    with plain hooks and retain_grad: ``((clean - corrupt) * grad).sum((0, 2))`` per row."""
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, *args: object) -> None:
        value = args[0][0] if inputs else args[1]  # type: ignore[index]
        value = value if isinstance(value, torch.Tensor) else value[0]  # type: ignore[index]
        if value.requires_grad:
            value.retain_grad()
        seen.append(value)

    handles = [m.register_forward_pre_hook(keep) if inputs else m.register_forward_hook(keep) for m in modules]
    try:
        with torch.no_grad():
            model(clean)
        clean_values, seen[:] = list(seen), []
        tm_metric(model(corrupt)).sum().backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return torch.stack([((c - v.detach()) * v.grad).sum((0, 2)) for c, v in zip(clean_values, seen)])


@pytest.mark.parametrize("name", CAUSAL)
def test_attention_modules_returning_none_under_sdpa_are_points(name: str) -> None:
    """Every Hugging Face attention module under SDPA (the default) returns ``(output, None)``:
    `element=0` takes the output and leaves the None alone (was torch.func's `Expected tensors,
    got NoneType`); the table is the hand estimate's."""
    model, (clean, corrupt) = tm.BUILDERS[name]("sdpa"), _tm_prompts(name)
    pts = fh.transformer.points(model)
    result = fh.attribution_patching(model, pts.attn, tm_metric)(clean, corrupt)
    attn = [m for _, m in pts.attn.resolve(model)]
    torch.testing.assert_close(result.table, _hand_item(model, attn, clean, corrupt), rtol=1e-5, atol=1e-6)
    fh.testing.assert_no_hooks(model)


@pytest.mark.parametrize("name", CAUSAL)
def test_activation_grads_of_an_sdpa_attention_module_give_none_for_its_none_item(name: str) -> None:
    model, (clean, _) = tm.BUILDERS[name]("sdpa"), _tm_prompts(name)
    attn = fh.transformer.points(model).attn
    loss, rec = fh.activation_grads(model, attn, lambda out: tm_metric(out).sum())(clean)
    path = next(iter(rec))
    output, grad = rec[path]["output"], rec[path]["grad"]
    assert output[1] is None and grad[1] is None
    assert grad[0].shape == output[0].shape and bool(grad[0].abs().sum() > 0)
    fh.testing.assert_no_hooks(model)


def test_inputs_of_gpt2_blocks_whose_arguments_hold_nones_and_a_cache() -> None:
    """GPT-2's blocks take ``(hidden, cache, mask, encoder_hidden)`` positionally, Nones among
    them: `inputs=True` attributes argument 0 and leaves the others alone."""
    model, (clean, corrupt) = tm.gpt2("sdpa"), _tm_prompts("gpt2")
    result = fh.attribution_patching(model, "transformer.h.*", tm_metric, inputs=True)(clean, corrupt)
    expected = _hand_item(model, list(model.transformer.h), clean, corrupt, inputs=True)
    torch.testing.assert_close(result.table, expected, rtol=1e-5, atol=1e-6)
    fh.testing.assert_no_hooks(model)


@pytest.mark.parametrize("name", CAUSAL)
def test_standard_points_are_attributed_as_their_modules_are(name: str) -> None:
    """`pts.resid_pre` (issue 29's ask, refused before with a message about selectors): the
    table of the modules holding it, rows named by the points' Record paths."""
    model, (clean, corrupt) = tm.BUILDERS[name]("sdpa"), _tm_prompts(name)
    pts = fh.transformer.points(model)
    result = fh.attribution_patching(model, pts.resid_pre, tm_metric)(clean, corrupt)
    by_path = fh.attribution_patching(model, [p for _, p in pts.resid_pre.paths], tm_metric)(clean, corrupt)
    assert result.points == pts.resid_pre.keys
    assert torch.equal(result.table, by_path.table)
    one = fh.attribution_patching(model, pts.resid_post[1], tm_metric)(clean, corrupt)
    assert one.points == ("blocks.1.resid_post",) and tuple(one.table.shape) == (1, clean.shape[1])
    fh.testing.assert_no_hooks(model)


def test_a_head_point_gives_a_column_per_head_as_the_module_input_does() -> None:
    """`pts.z` with `heads=` equals `inputs=True, heads=` on `attn.c_proj` (GPT-2)."""
    model, (clean, corrupt) = _gpt2(), _prompts()
    z = fh.transformer.points(model).z
    result = fh.attribution_patching(model, z, logit_diff, heads=HEADS)(clean, corrupt, use_cache=False)
    by_input = fh.attribution_patching(model, Z, logit_diff, inputs=True, heads=HEADS)(clean, corrupt, use_cache=False)
    assert result.points == ("blocks.0.z", "blocks.1.z")
    assert torch.equal(result.table, by_input.table)
    whole = fh.attribution_patching(model, z, logit_diff)(clean, corrupt, use_cache=False)
    torch.testing.assert_close(whole.table, result.table.sum(-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(fh.InterventionError) as err:
        fh.attribution_patching(model, z, logit_diff, heads=4)(clean, corrupt, use_cache=False)
    assert str(err.value) == (
        "attribution_patching: `heads` is the number of heads of the point's value (axis -2 of (..., head, d_head)), "
        "got heads=4 for a value of shape (2, 5, 2, 8) at 'blocks.0.z'. Pass heads=2.")
    with pytest.raises(fh.SpecError) as spec_err:
        fh.attribution_patching(model, z, logit_diff, inputs=True)
    assert str(spec_err.value) == (
        "attribution_patching: a standard point says itself where its value is (an output, an input or an op's "
        "result), got `inputs=True` with z. Leave `inputs` out.")
    fh.testing.assert_no_hooks(model)


def test_the_estimate_by_plain_autograd_equals_torch_func_grads_with_in_place_ops_and_batch_norm() -> None:
    """Outside transforms the corrupted pass is differentiated by plain autograd: the table is
    the one `fh.activation_grads` (torch.func.grad) gives, with an in-place ReLU after the point
    and a batch norm in training mode, whose statistics are updated once per call, as by one
    plain corrupted forward; no parameter gets a `.grad`."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(5), nn.ReLU(inplace=True), nn.Linear(4, 2)).train()
    clean, corrupt = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
    twin, plain = copy.deepcopy(model), copy.deepcopy(model)
    result = fh.attribution_patching(model, "0", lambda out: out[..., 0])(clean, corrupt)
    with torch.no_grad():
        clean_value = twin[0](clean)
    _, rec = fh.activation_grads(twin, "0", lambda out: out[..., 0].sum())(corrupt)
    expected = ((clean_value - rec["0"]["output"]) * rec["0"]["grad"]).sum((0, 2))
    assert torch.equal(result.table[0], expected)
    plain(corrupt)
    assert torch.equal(model[1].running_mean, plain[1].running_mean)
    assert all(p.grad is None for p in model.parameters())
