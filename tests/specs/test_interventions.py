"""Interventions (issue 14): patch, steer, scale, ablate as specs; per-call values from the
call's keyword arguments; a whole activation-patching sweep as one vmapped call, equal to
the Python loop (and to TransformerLens where it is installed); errors that name the spec,
the module and the fix, with the model left as it was."""

from __future__ import annotations

import collections

import hypothesis
import hypothesis.strategies as st
import pytest
import torch
from helpers import (
    PATCH_LAYERS,
    PATCH_POSITIONS,
    PATCH_VOCAB,
    PATCH_WIDTH,
    RECORDS_IN_COMPILE,
    patching_gpt2,
    patching_prompts,
)
from torch import nn

import funhooks as fh

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

VOCAB, LAYERS, WIDTH, POSITIONS = PATCH_VOCAB, PATCH_LAYERS, PATCH_WIDTH, PATCH_POSITIONS
RESID_PRE = ["transformer.drop", "transformer.h.*"]
"""resid_pre of layer L is the output of the module before block L: `drop`, then `h.0`, ..."""


def _logit_diff(out: object) -> torch.Tensor:
    logits = out.logits  # type: ignore[attr-defined]
    return logits[0, -1, 7] - logits[0, -1, 8]


def _mlp(device: torch.device | str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).to(device)


# -- what each intervention does ------------------------------------------------------------------


def test_patching_from_a_clean_record_reproduces_the_clean_run(device: torch.device) -> None:
    """`patch(where, record)` puts the clean run's output in place: patching every block
    of a corrupted run with the clean Record gives the clean logits."""
    model = patching_gpt2(device)
    clean, corrupt = patching_prompts(device)
    with torch.no_grad():
        clean_out, rec = fh.capture(model, fh.outputs("transformer.h.*"))(clean)
        with fh.with_hooks(model, fh.patch("transformer.h.1", rec)):
            patched = model(corrupt)
        plain = model(corrupt)
    assert torch.allclose(patched.logits, clean_out.logits, atol=1e-6)
    assert not torch.allclose(plain.logits, clean_out.logits, atol=1e-3)
    fh.testing.assert_no_hooks(model)


def test_a_vmapped_sweep_over_layers_and_positions_equals_the_python_loop(device: torch.device) -> None:
    """One `vmap` over (layer, position) pairs of `patch(..., nth=arg, index=arg)` gives the
    logit difference of every single patch, equal to calling the function once per patch."""
    model = patching_gpt2(device)
    clean, corrupt = patching_prompts(device)
    f = fh.capture(model, fh.patch(RESID_PRE, fh.arg("clean"), nth=fh.arg("layer"), index=fh.arg("pos")))
    with torch.no_grad():
        _, rec = fh.capture(model, fh.outputs(RESID_PRE))(clean)

        def metric(layer: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            out, _ = f(corrupt, clean=rec, layer=layer, pos=pos, use_cache=False)
            return _logit_diff(out)

        layers = torch.arange(LAYERS, device=device).repeat_interleave(POSITIONS)
        positions = torch.arange(POSITIONS, device=device).repeat(LAYERS)
        swept = torch.func.vmap(metric)(layers, positions).reshape(LAYERS, POSITIONS)
        loop = torch.tensor([[metric(layer, pos) for pos in range(POSITIONS)] for layer in range(LAYERS)])
    assert torch.allclose(swept.cpu(), loop, atol=1e-5)
    assert swept[:, 2].abs().sum() > 0 and torch.allclose(swept[:, :2], swept[0, 0].expand(LAYERS, 2))
    fh.testing.assert_no_hooks(model)


def test_the_sweep_equals_transformer_lens_get_act_patch_resid_pre() -> None:
    """On one model (TransformerLens' bridge wraps the same HF GPT-2, weights shared), the
    vmapped sweep equals `patching.get_act_patch_resid_pre`."""
    tl = pytest.importorskip("transformer_lens")
    tokenizers = pytest.importorskip("tokenizers")
    from transformer_lens.model_bridge import TransformerBridge  # TransformerLens 3.9 and 4 both have it here

    model = patching_gpt2()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(
        tokenizers.models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")))
    bridge = TransformerBridge.boot_transformers("gpt2", hf_model=model, tokenizer=tok)
    clean, corrupt = patching_prompts()
    with torch.no_grad():
        _, cache = bridge.run_with_cache(clean)
        expected = tl.patching.get_act_patch_resid_pre(bridge, corrupt, cache, lambda logits: logits[0, -1, 7] - logits[0, -1, 8])
        _, rec = fh.capture(model, fh.outputs(RESID_PRE))(clean)
        f = fh.capture(model, fh.patch(RESID_PRE, rec, nth=fh.arg("layer"), index=fh.arg("pos")))
        layers = torch.arange(LAYERS).repeat_interleave(POSITIONS)
        positions = torch.arange(POSITIONS).repeat(LAYERS)
        swept = torch.func.vmap(lambda l, p: _logit_diff(f(corrupt, layer=l, pos=p, use_cache=False)[0]))(layers, positions)
    assert torch.allclose(swept.reshape(LAYERS, POSITIONS), expected, atol=1e-5)


def test_steer_scale_and_ablate_edit_the_chosen_positions_only(device: torch.device) -> None:
    """`steer` adds `scale * vector`, `scale` multiplies, `ablate` zeroes, each at `index`
    along `dim` only; elsewhere the output is untouched."""
    model = nn.Sequential(nn.Identity()).to(device)
    x = torch.ones(2, 3, 4, device=device)
    vector = torch.arange(4.0, device=device)
    cases = {fh.steer("0", vector, scale=2.0, index=1): x[:, 1] + 2 * vector,
             fh.scale("0", 3.0, index=1): 3 * x[:, 1],
             fh.ablate("0", index=1): torch.zeros_like(x[:, 1]),
             fh.patch("0", 5.0, index=-2): torch.full_like(x[:, 1], 5.0)}
    for spec, at_one in cases.items():
        with fh.with_hooks(model, spec):
            y = model(x)
        assert torch.equal(y[:, 1], at_one), spec
        assert torch.equal(y[:, [0, 2]], x[:, [0, 2]]), spec


def test_vmap_over_steering_vectors_gives_one_output_per_vector(device: torch.device) -> None:
    """`vmap` over N steering vectors given per call gives N steered outputs in one call."""
    model = _mlp(device)
    x = torch.randn(5, 4, device=device)
    f = fh.capture(model, fh.steer("1", fh.arg("v"), scale=fh.arg("k")))
    vectors = torch.randn(3, 6, device=device)
    out, _ = torch.func.vmap(lambda v: f(x, v=v, k=0.5))(vectors)
    for i in range(3):
        assert torch.allclose(out[i], model[2](model[1](model[0](x)) + 0.5 * vectors[i]), atol=1e-6)


def test_mean_ablation_from_a_record_equals_mean_ablation_from_a_fold(device: torch.device) -> None:
    """The mean a Record gives (its values over calls and batch) and the one folding
    `OutputMeans` over the same batches gives are the same ablation."""
    model = _mlp(device)
    batches = [torch.randn(4, 4, device=device) for _ in range(3)]
    means = fh.OutputMeans("0")
    folded = fh.fold(means, fh.evaluate(model, batches, specs=means.specs))
    with fh.with_hooks(model, fh.outputs("0")) as run, torch.no_grad():
        for b in batches:
            model(b)
    x = torch.randn(2, 4, device=device)
    outs = []
    for mean in (folded, run.record):
        with fh.with_hooks(model, fh.ablate("0", mean=mean)), torch.no_grad():
            outs.append(model(x))
    with torch.no_grad():
        expected = model[2](model[1](model[0](torch.cat(batches)).mean(0))).expand(2, 3)
    assert torch.allclose(outs[0], expected, atol=1e-5) and torch.allclose(outs[1], expected, atol=1e-5)


def test_tuple_outputs_are_edited_on_one_element_and_the_rest_passes_on() -> None:
    """GPT-2's attention returns `(output, weights)`: a patch edits `element` 0 and hands
    the other item on as it was; namedtuples, lists and dicts keep their type."""
    model = patching_gpt2()
    clean, corrupt = patching_prompts()
    with torch.no_grad():
        _, rec = fh.capture(model, fh.outputs("transformer.h.*.attn"))(clean)
        spec = fh.patch("transformer.h.*.attn", rec)
        out, got = fh.capture(model, [spec, fh.outputs("transformer.h.0.attn")])(corrupt)
        plain, unpatched = fh.capture(model, fh.outputs("transformer.h.0.attn"))(corrupt)
    attn_out, weights = got["transformer.h.0.attn"]["output"]
    assert torch.equal(attn_out, rec["transformer.h.0.attn"]["output"][0])
    assert torch.equal(weights, unpatched["transformer.h.0.attn"]["output"][1])
    assert not torch.allclose(out.logits, plain.logits, atol=1e-4)
    Pair = collections.namedtuple("Pair", "a b")

    class Out(nn.Module):
        def __init__(self, kind: type) -> None:
            super().__init__()
            self.kind = kind

        def forward(self, x: torch.Tensor) -> object:
            if self.kind is dict:
                return {"a": x, "b": x}
            return self.kind([x, x]) if self.kind is list else self.kind(x, x)

    for kind in (Pair, list, dict):
        module = Out(kind)
        with fh.with_hooks(module, fh.scale("", 2.0, element="b" if kind is dict else 1)):
            y = module(torch.ones(2))
        a, b = (y["a"], y["b"]) if kind is dict else y
        assert type(y) is kind and torch.equal(a, torch.ones(2)) and torch.equal(b, 2 * torch.ones(2))


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # dynamo's own
@pytest.mark.parametrize("route", ["with_hooks", "capture", "functional", "vmap",
                                   pytest.param("compile", marks=RECORDS_IN_COMPILE)])
def test_a_recording_on_an_edited_module_sees_the_edited_value_on_every_route(route: str) -> None:
    """The documented rule holds for interventions: a recording of the same call sees the
    value after every editor, whatever the order of the specs and the route."""
    model = _mlp()
    x = torch.randn(3, 4)
    specs = [fh.outputs("0", clone=True), fh.scale("0", fh.arg("k")), fh.steer("0", torch.ones(6))]
    k = torch.tensor(0.5)
    if route == "with_hooks":
        with fh.with_hooks(model, [specs[0], fh.scale("0", k), specs[2]]) as run:
            model(x)
        rec = run.record
    elif route == "capture":
        rec = fh.capture(model, specs)(x, k=k)[1]
    elif route == "functional":
        rec = fh.functional(model, specs)(dict(model.named_parameters()), x, k=k)[1]
    elif route == "vmap":
        rec = torch.func.vmap(lambda row: fh.capture(model, specs)(row, k=k))(x)[1]
    else:
        rec = torch.compile(fh.capture(model, specs), backend="eager", fullgraph=True)(x, k=k)[1]
    assert torch.allclose(rec["0"]["output"], model[0](x) * 0.5 + 1, atol=1e-6)
    fh.testing.assert_no_hooks(model)


# -- properties ---------------------------------------------------------------------------------


@hypothesis.given(fh.testing.models_and_inputs())
def test_patching_every_module_with_a_record_of_the_same_input_changes_nothing(model_and_input: tuple) -> None:
    """Property: on any model (tuple outputs, shared modules, in-place activations), patching
    every module with what the same input stored leaves the output exactly as it was."""
    model, x = model_and_input
    model.eval()
    with torch.no_grad():
        expected, rec = fh.capture(model, fh.outputs("**", clone=True))(x)
        got, _ = fh.capture(model, fh.patch("**", rec))(x)
    assert torch.equal(got, expected)
    fh.testing.assert_no_hooks(model)


@hypothesis.given(fh.testing.models_and_inputs(), st.lists(st.floats(-2, 2), min_size=1, max_size=4))
def test_vmap_over_per_call_factors_equals_one_call_per_factor(model_and_input: tuple, factors: list) -> None:
    """Property: `vmap` over per-call values gives what calling once per value gives."""
    model, x = model_and_input
    model.eval()
    first = next(p for p, _ in model.named_children())
    f = fh.capture(model, fh.scale(first, fh.arg("k")))
    ks = torch.tensor(factors)
    with torch.no_grad():
        swept, _ = torch.func.vmap(lambda k: f(x, k=k))(ks)
        loop = torch.stack([f(x, k=k)[0] for k in ks])
    assert torch.allclose(swept, loop, atol=1e-5)


# -- bad input: one line naming the spec, the module and the fix; the model left as it was --------


def _raises(model: nn.Module, call: object, error: type, message: str) -> None:
    x = torch.randn(2, 4)
    with torch.no_grad():
        before = model(x)
        with pytest.raises(error) as err:
            call()  # type: ignore[operator]
        assert str(err.value) == message
        assert torch.equal(model(x), before)
    fh.testing.assert_no_hooks(model)


def test_a_value_with_another_batch_size_raises_naming_the_spec_module_and_fix() -> None:
    """A Record of a run with another batch: the sizes, the spec, the module, the fix."""
    model = _mlp()
    _, rec = fh.capture(model, fh.outputs("0"))(torch.randn(3, 4))
    _raises(model, lambda: fh.capture(model, fh.patch("0", rec))(torch.randn(2, 4)), fh.InterventionError, (
        "capture: an intervention's value broadcasts to the value it edits, got shape (3, 6) where the edited value "
        "has shape (2, 6), at module '0' for patch('0', <Record of 1 module>). Its batch size 3 is not the model's 2: "
        "make the source run with the same batch (or 1), and under `vmap` map only over the values' first dimension."
    ))


def test_per_call_values_with_the_wrong_batch_size_under_vmap_raise() -> None:
    """Under `vmap`, each call's value has the wrong batch size: said per call."""
    model = _mlp()
    f, x = fh.capture(model, fh.patch("0", fh.arg("v"))), torch.randn(2, 4)
    _raises(model, lambda: torch.func.vmap(lambda v: f(x, v=v))(torch.randn(5, 3, 6)),
            fh.InterventionError, (
        "capture: an intervention's value broadcasts to the value it edits, got shape (3, 6) where the edited value "
        "has shape (2, 6), at module '0' for patch('0', fh.arg('v')). Its batch size 3 is not the model's 2: "
        "make the source run with the same batch (or 1), and under `vmap` map only over the values' first dimension."
    ))


def test_a_stack_of_values_passed_without_vmap_raises_pointing_to_vmap() -> None:
    """N values passed to one call (vmap forgotten): the fix says to map over them."""
    model = _mlp()
    f = fh.capture(model, fh.patch("0", fh.arg("v")))
    _raises(model, lambda: f(torch.randn(2, 4), v=torch.randn(5, 2, 6)), fh.InterventionError, (
        "capture: an intervention's value broadcasts to the value it edits, got shape (5, 2, 6) where the edited "
        "value has shape (2, 6), at module '0' for patch('0', fh.arg('v')). It has one leading dimension more than "
        "the value it edits: map over it with `torch.func.vmap` to get one edited output per entry."
    ))


def test_a_record_lacking_the_patched_module_raises_listing_what_it_holds() -> None:
    """The Record has no value for one of the selected modules."""
    model = _mlp()
    _, rec = fh.capture(model, fh.outputs("0"))(torch.randn(2, 4))
    f = fh.capture(model, fh.patch(["0", "2"], fh.arg("clean")))
    _raises(model, lambda: f(torch.randn(2, 4), clean=rec), fh.InterventionError, (
        "capture: a Record given to an intervention holds the 'output' of every module it edits, got none (its "
        "paths: ['0']), at module '2' for patch(['0', '2'], fh.arg('clean')). Record those modules in the source run "
        "with the same selector (e.g. `fh.outputs`, `fh.op_outputs`)."
    ))


def test_a_missing_per_call_value_raises_before_the_model_runs() -> None:
    """A capture function called without the keyword argument its specs read."""
    model = _mlp()
    _raises(model, lambda: fh.capture(model, fh.steer("0", fh.arg("v")))(torch.randn(2, 4)), fh.InterventionError, (
        "capture: every `fh.arg` of the specs is a keyword argument of the call, got none for ['v'] (read by "
        "steer('0', fh.arg('v'))). Call it as `f(..., v=value)`."
    ))


def test_an_index_past_the_positions_raises() -> None:
    """An int `index` outside the positions of `dim`."""
    model = _mlp()
    _raises(model, lambda: fh.capture(model, fh.scale("0", 2.0, index=7))(torch.randn(2, 4)), fh.InterventionError, (
        "capture: `index` is a position along dim 1 (size 6), got 7, at module '0' for scale('0', 2.0, index=7). "
        "Pass an index in [-6, 6)."
    ))


def test_per_call_values_are_refused_where_no_call_gives_them() -> None:
    """`with_hooks` has no call to take `fh.arg` values from; a name the model's forward
    takes would be ambiguous. Both are refused before anything is attached."""
    model = _mlp()
    _raises(model, lambda: fh.with_hooks(model, fh.patch("0", fh.arg("v"))), fh.SpecError, (
        "with_hooks: `fh.arg` values come from the keyword arguments of a call of `fh.capture` or `fh.functional`, "
        "got `fh.arg('v')` in patch('0', fh.arg('v')). Put the value itself in the spec, or call "
        "`fh.capture(model, specs)(x, v=value)`."
    ))
    _raises(model, lambda: fh.capture(model, fh.steer("0", fh.arg("input"))), fh.SpecError, (
        "capture: an `fh.arg` name is a keyword argument for the specs alone, got 'input' in "
        "steer('0', fh.arg('input')), which Sequential.forward takes too. Rename it, e.g. `fh.arg('input_value')`."
    ))


@pytest.mark.parametrize(("build", "message"), [
    (lambda: fh.patch("0", "abc"),
     "patch: `value` is a tensor, a number, a Record or `fh.arg(name)`, got 'abc'. Pass one of those."),
    (lambda: fh.steer("0", fh.Record()),
     "steer: `vector` is a tensor, a number or `fh.arg(name)`, got <Record of 0 modules>. Pass one of those."),
    (lambda: fh.scale("0", 2.0, index="a"),
     ("scale: `index` is None, an int, a sequence of ints, a tensor, `fh.arg(name)` or `fh.steps(...)`, got 'a'. "
      "Pass the positions "
      "to edit along `dim`.")),
    (lambda: fh.ablate("0", nth=-1),
     ("ablate: `nth` is None, an int >= 0, a tensor or `fh.arg(name)`, got -1. Pass the index of the module to edit "
      "among those the selector matches.")),
    (lambda: fh.arg("not a name"), "arg: `name` is a keyword argument name, got 'not a name'. Pass e.g. 'clean' or 'pos'."),
])
def test_bad_arguments_are_refused_when_the_spec_is_built(build: object, message: str) -> None:
    """Constructors check their arguments: a SpecError with the rule and the fix."""
    with pytest.raises(fh.SpecError) as err:
        build()  # type: ignore[operator]
    assert str(err.value) == message


def test_intervention_specs_are_frozen_values_with_a_readable_repr() -> None:
    """Specs are values: frozen, hashable, picklable, shown as they were written."""
    import pickle

    spec = fh.patch(RESID_PRE, fh.arg("clean"), nth=fh.arg("layer"), index=fh.arg("pos"))
    assert repr(spec) == (
        "patch(['transformer.drop', 'transformer.h.*'], fh.arg('clean'), index=fh.arg('pos'), nth=fh.arg('layer'))")
    assert spec.args == ("clean", "pos", "layer") and hash(spec) == hash(spec)
    assert repr(pickle.loads(pickle.dumps(spec))) == repr(spec)
    assert repr(fh.ablate("h.0", op="softmax")) == "ablate('h.0', op='softmax')"
    assert repr(fh.steer("h.0", torch.ones(8), scale=4.0)) == "steer('h.0', <Tensor of shape (8,)>, scale=4.0)"
    with pytest.raises(AttributeError):
        spec.where = "x"  # type: ignore[misc]
