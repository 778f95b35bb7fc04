"""The plan cache holds no user's value (issue 36, item 3): a patch tensor, a steering
vector, a mean, a clean Record or a tensor a spec's function closes over dies when the user
drops it, while the model lives; interventions run again and again do not fill the cache,
and plain specs (``fh.outputs``) still reuse their plan run after run."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from torch import nn

import funhooks as fh

pytestmark = pytest.mark.usefixtures("frozen_heap")  # each gc.collect() walks only what its test made


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))


def _in_block(model: nn.Module, spec: fh.Spec) -> None:
    with fh.with_hooks(model, spec):
        model(torch.ones(1, 3))


def _captured(model: nn.Module, spec: fh.Spec) -> None:
    fh.capture(model, spec)(torch.ones(1, 3))


RUNS = {"with_hooks": _in_block, "capture": _captured}

SPECS: dict[str, Callable[[torch.Tensor], fh.Spec]] = {
    "patch": lambda t: fh.patch("0", t),
    "steer": lambda t: fh.steer("0", t[0]),
    "steer scale": lambda t: fh.steer("0", torch.ones(3), scale=t[0, 0]),
    "scale": lambda t: fh.scale("0", t),
    "ablate mean": lambda t: fh.ablate("0", mean=t),
    "patch op": lambda t: fh.patch("0", t, op="linear"),
    "edit closure": lambda t: fh.edit("0", lambda module, args, output: output + t),
    "observe closure": lambda t: fh.observe("0", lambda module, args, output: output * t),
}


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("kind", SPECS)
def test_a_dropped_intervention_value_dies_while_the_model_lives(run: str, kind: str) -> None:
    model = _model()
    value = torch.full((1, 3), 0.5)
    ref = weakref.ref(value)
    RUNS[run](model, SPECS[kind](value))
    del value
    gc.collect()
    assert ref() is None, f"{kind} under {run} kept its value alive"
    assert model[0].weight.shape == (3, 3)  # the model lives


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("kind", ["patch", "ablate"])
def test_a_dropped_clean_record_dies_while_the_model_lives(run: str, kind: str) -> None:
    model = _model()
    _, record = fh.capture(model, fh.outputs("0"))(torch.zeros(1, 3))
    stored = weakref.ref(record["0"]["output"])
    spec = fh.patch("0", record) if kind == "patch" else fh.ablate("0", mean=record)
    RUNS[run](model, spec)
    del record, spec
    gc.collect()
    assert stored() is None
    fh.testing.assert_no_hooks(model)


def test_a_standard_points_patch_value_dies_while_the_model_lives() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    points = fh.transformer.points(model)
    value = torch.zeros(16)
    ref = weakref.ref(value)
    with fh.with_hooks(model, fh.steer(points.resid_pre[1], value)):
        model(torch.tensor([[1, 2, 3]]))
    del value
    gc.collect()
    assert ref() is None


def test_interventions_run_again_and_again_keep_nothing_and_plain_plans_stay_cached() -> None:
    """Forty fresh steering vectors, each run once: every one dies, and a plain spec's run
    before and after them wraps the module with the very same forward (its plan reused)."""
    model = _model()

    def wrapped() -> object:
        with fh.with_hooks(model, fh.outputs("0")):
            return model[0].__dict__["forward"]

    first = wrapped()
    refs = []
    for i in range(40):
        vector = torch.full((3,), float(i))
        refs.append(weakref.ref(vector))
        _in_block(model, fh.steer("0", vector))
        del vector
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert wrapped() is first


def test_a_kept_intervention_spec_still_works_run_after_run() -> None:
    """Reusing an intervention's plan changes nothing a run gives: the same spec object run
    twice edits the same way, and its per-call mask (an `index` tensor) is right each time."""
    model = _model()
    spec = fh.scale("0", 0.0, index=torch.tensor([0]), dim=0)
    outs = []
    for _ in range(2):
        with fh.with_hooks(model, [spec, fh.outputs("0")]) as run:
            model(torch.ones(2, 3))
        outs.append(run.record["0"]["output"])
    assert torch.equal(outs[0], outs[1])
    assert bool((outs[0][0] == 0).all()) and not bool((outs[0][1] == 0).all())


def test_a_per_call_index_tensor_dies_with_the_call() -> None:
    """A mask an intervention keeps between calls does not keep the per-call tensor it was
    made from alive."""
    model = _model()
    f = fh.capture(model, fh.scale("0", 0.0, index=fh.arg("pos"), dim=0))
    pos = torch.tensor([1])
    ref = weakref.ref(pos)
    f(torch.ones(2, 3), pos=pos)
    del pos
    gc.collect()
    assert ref() is None
    out, _ = f(torch.ones(2, 3), pos=torch.tensor([0]))
    assert out.shape == (2, 2)


def _forward_of(model: nn.Sequential, spec: fh.Spec) -> object:
    with fh.with_hooks(model, spec):
        return model[0].__dict__["forward"]


@pytest.mark.parametrize("make", [
    lambda model: fh.hook_outputs(list(model)),
    lambda model: fh.Hook(model[0], _mean),
    lambda model: fh.outputs([model[0], model[2]]),
    lambda model: fh.observe(_is(model[0]), _mean),
], ids=["hook_outputs", "Hook", "module list", "predicate closing over a module"])
def test_specs_naming_the_models_own_modules_keep_their_plan_cached(make: Callable[[nn.Sequential], fh.Spec]) -> None:
    """Modules of the model are not values of the user's a cache could keep alive: a spec
    selecting them by instance (fastai's spellings) reuses its plan run after run."""
    model = _model()
    spec = make(model)
    assert _forward_of(model, spec) is _forward_of(model, spec)


def _is(first: nn.Module) -> Callable[[str, nn.Module], bool]:
    return lambda path, module: module is first


def _mean(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output.mean()


def test_a_probe_outside_the_model_dies_while_the_model_lives() -> None:
    """A function closing over a module outside the model (a probe) holds the user's tensors:
    its plan is not cached, and the probe's weight dies with it."""
    model = _model()
    probe = nn.Linear(3, 1)
    weight = weakref.ref(probe.weight)
    _in_block(model, fh.observe("0", lambda module, args, output: probe(output)))
    del probe
    gc.collect()
    assert weight() is None


def _wrapped(model: nn.Sequential, specs: list[fh.Spec]) -> tuple[object, torch.Tensor]:
    """The forward a block wraps module `0` with (its plan's own, when the plan is reused), and
    what the model gives inside the block."""
    with fh.with_hooks(model, specs):
        return model[0].__dict__["forward"], model(torch.ones(2, 3))


INTERVENTIONS = {kind: make for kind, make in SPECS.items() if "closure" not in kind}


@pytest.mark.parametrize("kind", INTERVENTIONS)
def test_a_reused_intervention_spec_reuses_its_plan(kind: str) -> None:
    """Issue 37: the same intervention spec object in block after block (a sweep's usual loop)
    is planned once: each block wraps the module with the very same forward, alone or beside
    plain specs built afresh each time, and edits the same way; another spec object with the
    same value is planned for itself."""
    model, spec = _model(), INTERVENTIONS[kind](torch.full((1, 3), 0.5))
    first, out = _wrapped(model, [spec])
    again, out_again = _wrapped(model, [spec])
    assert again is first and torch.equal(out_again, out)
    beside, _ = _wrapped(model, [spec, fh.outputs("2")])
    assert _wrapped(model, [spec, fh.outputs("2")])[0] is beside
    other, out_other = _wrapped(model, [INTERVENTIONS[kind](torch.full((1, 3), 0.5))])
    assert other is not first and torch.equal(out_other, out)


def test_a_reused_intervention_spec_keeps_no_model_alive() -> None:
    """What a spec keeps of its runs dies with the model: a model dropped while the spec lives
    is freed, and so is one a spec beside it closes over (whose plan the spec never keeps)."""
    spec = fh.patch("0", torch.zeros(1, 3))
    for closes_over in (False, True):
        model = _model()
        ref = weakref.ref(model)
        seen = fh.observe("2", lambda module, args, output, model=model: output.sum())  # reaches the model
        specs = [spec, seen] if closes_over else [spec]
        _wrapped(model, specs)
        _wrapped(model, specs)
        del model, seen, specs
        gc.collect()
        assert ref() is None, f"a model kept alive by a reused intervention spec (closed over: {closes_over})"
