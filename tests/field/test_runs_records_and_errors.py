"""Field reliability (issue 11): records of real outputs (dataclasses, several backward passes,
parametrized weights), isolation (copies, kwargs, recursion, funhooks' own passes), and
errors a user can act on. Each test failed before the fix."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import funhooks as fh


def _mlp(device: torch.device | str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


# -- records of real outputs -------------------------------------------------------------------------


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "ok"


class _ReturnsDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> _Output:
        h = self.lin(x)
        return _Output(h * 2, h)


def test_dataclass_outputs_are_stored_by_their_fields(device: torch.device) -> None:
    """A dataclass output is stored as a detached copy of its fields: later changes to the
    live object do not reach the Record, in-place changes are caught, and `grads` stores
    the gradient of each field in the same dataclass."""
    model = nn.Sequential(_ReturnsDataclass()).to(device)
    x = torch.randn(2, 4, device=device)
    with fh.with_hooks(model, [fh.outputs("0"), fh.grads("0")]) as run:
        out = model(x)
        out.logits.sum().backward()
    stored = run.record["0"]["output"]
    assert isinstance(stored, _Output) and stored is not out and stored.note == "ok"
    assert not stored.logits.requires_grad and torch.equal(stored.logits, out.logits.detach())
    out.logits = torch.zeros(1)
    assert run.record["0"]["output"].logits.shape == (2, 3)
    grad = run.record["0"]["grad"]
    assert isinstance(grad, _Output) and torch.equal(grad.logits, torch.ones(2, 3, device=device))
    assert torch.equal(grad.hidden, 2 * grad.logits)  # `hidden` feeds `logits`
    with torch.no_grad(), fh.with_hooks(model, fh.outputs("0")) as stale:
        model(x).hidden.mul_(2)
    with pytest.raises(fh.StaleTensorError, match="the 'output' of module '0'"):
        stale.record


def test_grads_keep_every_backward_pass() -> None:
    """Two backward passes through one forward (`retain_graph=True`), or a gradient penalty:
    `grads` keeps one value per pass, in order, as a backward observer does."""
    model = _mlp()
    x = torch.randn(3, 4, requires_grad=True)
    specs = [fh.grads("2"), fh.observe("2", lambda m, go: go[0].clone(), event="backward_pre", name="go")]
    with fh.with_hooks(model, specs) as run:
        y = model(x)
        y.sum().backward(retain_graph=True)
        (3 * y.sum()).backward()
    grads = run.record.calls("2", "grad")
    assert len(grads) == 2 and torch.equal(grads[1], 3 * grads[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, run.record.calls("2", "go")))
    with fh.with_hooks(model, fh.grads("0")) as penalty:
        y = model(x).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        gx.pow(2).sum().backward()
    assert len(penalty.record.calls("0", "grad")) == 2


def test_param_grad_sees_parametrized_weights() -> None:
    """`param_grad` on a `weight_norm`-parametrized Linear records the originals of its
    weight under their own paths, beside its bias."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(3, 2)))
    spec = fh.observe(nn.Linear, lambda p, g: g.clone(), event="param_grad", name="g")
    with fh.with_hooks(model, spec) as run:
        model(torch.randn(4, 3)).sum().backward()
    originals = model[0].parametrizations.weight
    assert list(run.record) == ["0.bias", "0.parametrizations.weight.original0", "0.parametrizations.weight.original1"]
    assert torch.equal(run.record["0.parametrizations.weight.original1"]["g"], originals.original1.grad)
    assert torch.equal(run.record["0.bias"]["g"], model[0].bias.grad)


# -- isolation ----------------------------------------------------------------------------------------


def test_a_shallow_copy_made_inside_a_block_is_a_working_module() -> None:
    """`copy.copy(module)` inside a block computes with the copy's own attributes, inside and
    after the block; copies carry no leftover instance `forward`."""
    model = _mlp()
    x = torch.randn(2, 4)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        twin = copy.copy(model[0])
        twin.weight = nn.Parameter(torch.zeros_like(twin.weight))
        assert torch.equal(twin(x), twin.bias.expand(2, 8))
        model(x)
    assert "forward" not in twin.__dict__ and "__reduce_ex__" not in twin.__dict__
    assert torch.equal(twin(x), twin.bias.expand(2, 8))
    assert len(run.record.calls("0", "output")) == 1


class _FastPath(nn.Module):
    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        raise RuntimeError("no fast kernel here")


class _WithFallback(nn.Module):
    """Try the fast child, fall back when it raises (a common kernel-selection pattern)."""

    def __init__(self) -> None:
        super().__init__()
        self.fast = _FastPath()

    def forward(self, x: torch.Tensor, *, scale: float) -> torch.Tensor:
        try:
            return self.fast(x, scale=scale * 10)
        except RuntimeError:
            return x * scale


def test_each_module_keeps_its_own_keyword_inputs_when_a_child_raises() -> None:
    """A child that raises inside a parent that catches: each keeps its own kwargs, in
    `with_hooks` and in a capture function alike."""
    model = _WithFallback()
    x = torch.ones(2)
    with fh.with_hooks(model, fh.inputs(["", "**"])) as run:
        model(x, scale=2.0)
    _, rec = fh.capture(model, fh.inputs(["", "**"]))(x, scale=2.0)
    for record in (run.record, rec):
        assert record[""]["input"][1] == {"scale": 2.0}
        assert record["fast"]["input"][1] == {"scale": 20.0}


def test_a_spec_function_that_calls_the_model_does_not_recurse() -> None:
    """A spec's own function runs isolated: calling the model there runs it unhooked."""
    model = _mlp()
    x = torch.randn(2, 4)

    def again(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    with fh.with_hooks(model, fh.observe("0", again)) as run:
        y = model(x)
    assert len(run.record.calls("0", "again")) == 1
    assert torch.equal(run.record["0"]["again"], y.sum())


def test_funhooks_own_passes_are_invisible_to_open_runs() -> None:
    """`module_summary`, `layer_info`, `model_sizes`, `dummy_eval` inside an open run on the
    same model add nothing to its Record (their meta-device calls included)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        fh.module_summary(model, x)
        fh.layer_info(model, x)
        fh.model_sizes(model, size=(4,))
        fh.dummy_eval(model, size=(4,))
        model(x)
    assert len(run.record.calls("0", "output")) == 1 and run.record["0"]["output"].device.type == "cpu"


def test_funhooks_own_spec_errors_say_what_to_do_not_to_fix_the_function() -> None:
    """An error funhooks' own spec function raises (ActivationStats meeting an LSTM's tuple
    output) names the module and the fix, and never tells the user to fix funhooks' code."""
    model = nn.Sequential(nn.LSTM(3, 4))
    batches = [(torch.randn(2, 5, 3), torch.randn(2, 5, 4))]
    with pytest.raises(fh.HookError) as err:
        fh.fit(model, batches, lambda out, y: out[0].sum(), torch.optim.SGD(model.parameters(), lr=0.1),
               fh.ActivationStats(), progress=False)
    assert "stopped at module '0': ActivationStats: statistics need a tensor output, got tuple" in str(err.value)
    assert "Fix the function" not in str(err.value)


# -- errors a user can act on ------------------------------------------------------------------------


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output


def test_an_unhashable_spec_function_is_refused_when_the_spec_is_built() -> None:
    """Specs are values: an unhashable function fails at construction, not at `with_hooks`."""
    with pytest.raises(fh.SpecError) as err:
        fh.observe("0", _Unhashable(), name="same")
    assert str(err.value) == (
        "observe: `fn` is hashable (a spec is a value, compared and cached by its function), got an unhashable "
        "_Unhashable. Make it hashable (e.g. `@attrs.frozen` or `@dataclasses.dataclass(frozen=True)`), or pass "
        "a function."
    )
    with pytest.raises(fh.SelectorError, match="a predicate is hashable"):
        fh.select(_Unhashable())


def test_an_editor_returning_the_wrong_shape_names_the_spec_and_module() -> None:
    """An editor must return what it replaces, shaped alike; the error names both."""
    model = _mlp()
    halve = fh.edit("0", lambda m, a, o: o[:, :2], name="halve")
    with pytest.raises(fh.HookError) as err:
        with fh.with_hooks(model, halve):
            model(torch.randn(3, 4))
    assert str(err.value) == (
        "with_hooks: an editor returns a value with the structure and shapes of the output it replaces (or None), "
        "got a Tensor of shape (3, 2) from edit('0', <lambda>, name='halve') on module '0', where the output is a Tensor of "
        "shape (3, 8). Return a value shaped like the output."
    )
    shrink = fh.edit("2", lambda m, gi, go: (gi[0][:1],), event="backward")
    with pytest.raises(fh.HookError, match=r"from edit\('2', <lambda>, event='backward'\) on module '2', where the "
                                           r"grad_input is a tuple of 1 \(a Tensor of shape \(3, 8\)\)"):
        with fh.with_hooks(model, shrink):
            model(torch.randn(3, 4)).sum().backward()
    fh.testing.assert_no_hooks(model)


def test_selecting_the_second_path_of_a_shared_module_says_which_path_to_use() -> None:
    """`m[2] is m[0]`: funhooks names it by its first path, and the message says so."""
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(model, fh.outputs("2"))
    assert str(err.value) == (
        "with_hooks: selector '2' in spec outputs('2') matched module '2' of Sequential, which is the same module "
        "as '0' (registered at both paths); funhooks names a shared module by its first path and records every "
        "call there. Select '0'."
    )


def test_gradients_that_arrive_after_the_block_are_explained() -> None:
    """`backward()` after the block: the Record says the gradient came too late."""
    model = _mlp()
    with fh.with_hooks(model, [fh.outputs("0"), fh.grads("0")]) as run:
        loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    with pytest.raises(KeyError) as err:
        run.record["0"]["grad"]
    assert str(err.value) == (
        "Record: module '0' stored no 'grad', got names ['output']. Note on `rec['0']['grad']`: its output needed "
        "a gradient but none reached it while the `with_hooks` block was open (the backward ran after the block "
        "exited, or not at all): call `backward()` inside the block."
    )


class _Layers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.h:
            x = layer(x)
        return x


def test_a_container_that_never_runs_is_explained() -> None:
    """Selecting only a ModuleList is refused with the fix; reading one matched by `**`
    says it is a container that never runs itself."""
    model = _Layers()
    with pytest.raises(fh.SelectorError) as err:
        fh.with_hooks(model, fh.outputs("h"))
    assert str(err.value) == (
        "with_hooks: outputs('h') selects only containers that never run themselves, got module 'h' (ModuleList). "
        "Select the modules inside it, e.g. 'h.*'."
    )
    with fh.with_hooks(model, fh.outputs("**")) as run:
        model(torch.randn(1, 2))
    with pytest.raises(KeyError, match=r"Note on `rec\['h'\]`: 'h' is a ModuleList, a container that is never "
                                       r"called itself: select the modules inside it \('h.\*'\)"):
        run.record["h"]


@pytest.mark.parametrize("order", ["editor first", "recorder first"])
def test_a_recording_sees_the_edited_value_whatever_the_order(order: str) -> None:
    """One rule, on every route: recordings of a call see its values after every editor,
    whatever the spec order or the nesting of runs."""
    model = _mlp()
    x = torch.randn(2, 4)
    zero = fh.edit("0", lambda m, a, o: torch.zeros_like(o))
    record = fh.outputs("0")
    specs = [zero, record] if order == "editor first" else [record, zero]
    with fh.with_hooks(model, specs) as run:
        model(x)
    _, captured = fh.capture(model, specs)(x)
    outer_spec, inner_spec = (zero, record) if order == "editor first" else (record, zero)
    with fh.with_hooks(model, outer_spec) as outer, fh.with_hooks(model, inner_spec) as inner:
        model(x)
    nested = (inner if order == "editor first" else outer).record
    for rec in (run.record, captured, nested):
        assert torch.equal(rec["0"]["output"], torch.zeros(2, 8))
