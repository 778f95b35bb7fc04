"""The library's own invariants, checked through the public kit on random models and specs."""

import os
import subprocess
import sys

import hypothesis
import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funhooks as fh
from funhooks.testing import (
    assert_no_hooks,
    assert_transparent,
    models_and_inputs,
    specs,
)

# The `device` fixture is function scoped but returns an immutable torch.device.
with_device = hypothesis.settings(
    suppress_health_check=[hypothesis.HealthCheck.function_scoped_fixture, hypothesis.HealthCheck.too_slow]
)


def _modules_by_path(model: nn.Module) -> dict[str, nn.Module]:
    return dict(fh._torch.named_modules(model))


def _call_counts(model: nn.Module, *args) -> dict[int, int]:
    """How often each module (by id) runs in `model(*args)`, counted with plain hooks."""
    counts: dict[int, int] = {}

    def count(module, args, output):
        counts[id(module)] = counts.get(id(module), 0) + 1

    handles = [m.register_forward_hook(count) for _, m in model.named_modules()]
    try:
        model(*args)
    finally:
        for h in handles:
            h.remove()
    return counts


def _draw_pair(data, **kwargs):
    """A drawn model and an input that needs grad (so even parameter-free models backprop)."""
    model, x = data.draw(models_and_inputs(**kwargs))
    return model, x.requires_grad_(True)


# -- the library's invariants, through the kit ----------------------------------------------


@with_device
@given(st.data())
def test_observers_are_transparent_on_random_models(device, data):
    """Observers change no output, input gradient, parameter gradient or buffer, on models
    with in-place activations and shared modules."""
    model, x = _draw_pair(data, device=device)
    assert_transparent(model, data.draw(specs(model)), x)


@with_device
@given(st.data())
def test_record_call_counts_equal_an_independent_count(device, data):
    """Each module's number of recorded outputs equals the calls a plain forward hook counts."""
    model, x = _draw_pair(data, device=device)
    with fh.with_hooks(model, fh.outputs("**", clone=True)) as run:
        counts = _call_counts(model, x)
    rec = run.record
    by_path = _modules_by_path(model)
    expected = {p: counts[id(m)] for p, m in by_path.items() if p and id(m) in counts}
    assert {p: len(rec.calls(p, "output")) for p in rec} == expected
    assert list(rec) == [p for p in by_path if p in expected]  # module order


FAULTS = ("spec_fn", "module_forward", "param_grad", "block_body", "keyboard_interrupt")


class Boom(Exception):
    """The exception a test injects."""


@given(st.data())
def test_no_hook_is_left_after_an_exception_at_a_random_point(data):
    """Whatever raises (a spec's function, a module, a gradient hook, the block body, a
    KeyboardInterrupt), the run removes every hook and leaves the dispatcher as it was."""
    model, x = _draw_pair(data)
    drawn = data.draw(specs(model))
    fault = data.draw(st.sampled_from(FAULTS))
    by_path = _modules_by_path(model)
    counts = _call_counts(model, x)
    path = data.draw(st.sampled_from(sorted(p for p, m in by_path.items() if p and id(m) in counts)))

    def boom(*args):
        raise Boom

    extra = []
    handles = []
    if fault == "spec_fn":
        extra.append(fh.observe(path, boom, name="boom"))
    elif fault == "module_forward":
        handles.append(by_path[path].register_forward_pre_hook(boom))
    elif fault == "param_grad":
        with_params = [p for p, m in by_path.items() if any(True for _ in m.parameters(recurse=False))]
        if with_params:
            extra.append(fh.observe(data.draw(st.sampled_from(with_params)), boom, event="param_grad", name="boom"))
    expected = KeyboardInterrupt if fault == "keyboard_interrupt" else (fh.HookError, Boom)
    try:
        with pytest.raises(expected):
            with fh.with_hooks(model, drawn + tuple(extra)):
                y = model(x)
                if fault == "block_body":
                    raise Boom
                if fault == "keyboard_interrupt":
                    raise KeyboardInterrupt
                y.sum().backward()
                if fault == "param_grad" and not extra:
                    raise Boom  # a model without parameters: fail in the body instead
    finally:
        for h in handles:
            h.remove()
    assert_no_hooks(model)
    assert fh.runs._core.scope.active() == ()


@given(st.data())
def test_record_save_load_round_trip(tmp_path_factory, data):
    """A Record of drawn specs on a drawn model saves and loads back equal."""
    model, x = _draw_pair(data)
    drawn = data.draw(specs(model, clone=True))
    with fh.with_hooks(model, drawn) as run:
        model(x).sum().backward()
    rec = run.record
    path = tmp_path_factory.mktemp("rec") / "rec.pt"
    rec.save(path)
    back = fh.Record.load(path)
    assert back.equal(rec)
    assert list(back) == list(rec)


def test_import_funhooks_does_not_import_hypothesis():
    """Hypothesis is an optional extra: `import funhooks` works without it (nor does it import
    transformers), and the kit says how to install it when a strategy or a check is asked for."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'hypothesis' or name.startswith('hypothesis.'):\n"
        "            raise ImportError('blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch, funhooks as fh\n"
        "model = torch.nn.Linear(1, 1)\n"
        "fh.testing.assert_no_hooks(model)\n"
        "fh.testing.assert_transparent(model, fh.outputs(''), torch.ones(1, 1))\n"
        "assert 'hypothesis' not in sys.modules and 'transformers' not in sys.modules\n"
        "for ask in (fh.testing.models_and_inputs, lambda: fh.testing.check_causality(model, torch.ones(2, 2))):\n"
        "    try:\n"
        "        ask()\n"
        "    except ImportError as err:\n"
        "        print(err)\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    message = (
        "funhooks.testing: the property-testing kit (strategies, `check_invariant`, the invariant checks) needs "
        "Hypothesis, got no module named 'hypothesis'. Install the test extra: `pip install funhooks[test]`."
    )
    assert done.stdout.splitlines() == [message, message]
