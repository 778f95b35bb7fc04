"""Field reliability: funhooks the way research code uses it (inference, checkpointing,
transforms inside a block, learned embeddings, models edited between runs, dataclass and
several-pass outputs, copies, errors a user can act on). Each test failed before the fix."""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import funhooks as fh


def _mlp(device: torch.device | str = "cpu") -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).to(device)


# -- execution modes ----------------------------------------------------------------------------


def test_runs_work_under_inference_mode_and_keep_values_as_returned(device: torch.device) -> None:
    """Under `torch.inference_mode()` a run records; an in-place op after the module leaves
    the stored value as the module returned it (inference tensors keep no version counter,
    so they are stored as copies)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True)).to(device)
    x = torch.randn(8, 4, device=device)
    with torch.inference_mode(), fh.with_hooks(model, [fh.outputs("0"), fh.inputs("1")]) as run:
        y = model(x)
    with torch.no_grad():
        expected = model[0](x)
    assert torch.equal(run.record["0"]["output"], expected) and (expected < 0).any()
    assert torch.equal(run.record["1"]["input"][0][0], expected)
    assert torch.equal(y, expected.relu())
    fh.testing.assert_no_hooks(model)


def test_an_inference_tensor_passed_through_outside_inference_mode_is_stored(device: torch.device) -> None:
    """An input made inside inference mode and passed through an `Identity` outside it."""
    with torch.inference_mode():
        x = torch.randn(2, 4, device=device)
    model = nn.Sequential(nn.Identity(), nn.Flatten()).to(device)
    with fh.with_hooks(model, fh.outputs("**")) as run:
        model(x)
    assert torch.equal(run.record["0"]["output"], x) and torch.equal(run.record["1"]["output"], x)


def test_runs_under_autocast_store_the_dtype_the_module_computed(device: torch.device) -> None:
    """Under `torch.autocast` the stored values are the bf16 the modules produced, and the
    gradients of a mixed-precision backward are recorded."""
    model = _mlp(device)
    x = torch.randn(4, 4, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16), fh.with_hooks(model, [fh.outputs("2"), fh.grads("2")]) as run:
        y = model(x)
        y.float().sum().backward()
    assert run.record["2"]["output"].dtype == torch.bfloat16 and torch.equal(run.record["2"]["output"], y.detach())
    assert run.record["2"]["grad"].dtype == torch.bfloat16


class _Checkpointed(nn.Module):
    """A block whose body runs under activation checkpointing."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=self.reentrant) if self.reentrant is not None else self.body(x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_modules_are_recorded_once_with_their_gradients(reentrant: bool, device: torch.device) -> None:
    """The recomputation during backward is not a new call: one call per forward, and the
    gradients, backward events and editors of a checkpointed region equal the plain model's."""
    x = torch.randn(5, 4, device=device, requires_grad=True)
    specs = [fh.outputs("**"), fh.inputs("body.0"), fh.grads("body.0"),
             fh.observe("body.2", lambda m, gi, go: go[0].clone(), event="backward", name="grad_out"),
             fh.edit("body.1", lambda m, a, o: o * 2)]
    records, grads = [], []
    for mode in (reentrant, None):
        model = _Checkpointed(mode).to(device)
        with fh.with_hooks(model, specs) as run:
            model(x).pow(2).sum().backward()
        records.append(run.record)
        grads.append([p.grad for p in model.parameters()])
        fh.testing.assert_no_hooks(model)
    checkpointed, plain = records
    assert all(len(checkpointed.calls(p, n)) == 1 for p, node in checkpointed.items() for n in node)
    assert checkpointed.equal(plain, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_transform_of_the_model_inside_a_block_raises_pointing_to_capture(transform: str) -> None:
    """`vmap(model)` / `grad` of the model inside a block would store values that escape
    the transform: a TransformError says so and points to `fh.capture`."""
    model = _mlp()
    x = torch.randn(5, 4)
    with fh.with_hooks(model, fh.outputs("0")) as run:
        with pytest.raises(fh.TransformError) as err:
            if transform == "vmap":
                torch.func.vmap(model)(x)
            else:
                torch.func.grad(lambda t: model(t).sum())(x)
    assert str(err.value) == (
        "with_hooks: values stored by side effect cannot leave a torch.func transform, got module '0' called "
        "inside `vmap`/`grad` while the `with_hooks` block was entered outside it. Call `fh.capture(model, specs)` "
        "inside the transform instead: its Record comes back batched."
    )
    assert len(run.record) == 0
    fh.testing.assert_no_hooks(model)


def test_pure_functions_called_inside_a_block_are_unseen_by_it() -> None:
    """`vmap(activation_grads(...))` and `vmap(capture(...))` inside a block return their own
    batched Records; the block around them stores nothing of their calls."""
    model = _mlp()
    x = torch.randn(5, 4)
    with fh.with_hooks(model, fh.outputs("**")) as run:
        loss, grads = torch.func.vmap(fh.activation_grads(model, "0", lambda out: out.sum()))(x)
        _, captured = torch.func.vmap(fh.capture(model, fh.outputs("0")))(x)
    assert len(run.record) == 0
    assert grads["0"]["grad"].shape == (5, 8) and captured["0"]["output"].shape == (5, 8)


# -- leaks and caches -------------------------------------------------------------------------------


def _specs_reaching(model: nn.Module) -> list[list[fh.Spec]]:
    """Specs that hold the model itself: a closure, a predicate, a list with the root."""
    scaled = fh.observe("0", lambda m, a, o: o * model[2].weight.sum(), name="scaled")
    first = fh.select(lambda path, m: m is model[0])
    return [[scaled], [fh.outputs(first)], [fh.outputs([model, model[0]])]]


def test_a_spec_closing_over_the_model_does_not_keep_it_alive() -> None:
    """Plans are cached per model; a spec whose function or predicate reaches the model
    itself must not pin it: once the user drops the model, it is freed."""
    model = _mlp()
    alive = weakref.ref(model)
    for specs in _specs_reaching(model):
        with fh.with_hooks(model, specs):
            model(torch.randn(2, 4))
    del model, specs
    gc.collect()
    assert alive() is None


class _Positions(nn.Module):
    """A learned positional embedding: the module returns its own parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos, self.keep, self.head = _Positions(), nn.Identity(), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.keep(x) + self.pos(x))


def test_grads_of_persistent_tensors_leave_no_hook_behind() -> None:
    """`grads` on a module returning a parameter, or the caller's leaf input through an
    `Identity`: the gradient is recorded and no tensor hook stays after the block, so a
    training loop does not pile one up per step."""
    model = _Embedded()
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(3):
        with fh.with_hooks(model, fh.grads(["pos", "keep"])) as run:
            model(x).sum().backward()
        assert not model.pos.table._backward_hooks and not x._backward_hooks
    assert torch.allclose(run.record["pos"]["grad"], model.head.weight.sum(0).expand(3, 4))
    assert torch.allclose(run.record["keep"]["grad"], run.record["pos"]["grad"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = fh.train(model, [(x.detach(), torch.zeros(3, 2))] * 20, nn.functional.mse_loss, opt,
                     specs=fh.grads("pos"), progress=False)
    assert len(list(steps)) == 20
    assert not model.pos.table._backward_hooks
    fh.testing.assert_no_hooks(model)


def test_plans_follow_module_list_and_sequential_edits() -> None:
    """`insert`, `del` and `pop` edit `_modules` without PyTorch's registration hook: the
    next run sees the model as it is now (paths, values, selectors)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    x = torch.randn(2, 4)
    spec = fh.outputs("**")
    with fh.with_hooks(model, spec) as run:
        model(x)
    assert list(run.record) == ["0", "1", "2"]
    model.insert(1, nn.ReLU())
    with fh.with_hooks(model, spec) as run:
        model(x)
    assert list(run.record) == ["0", "1", "2", "3"]
    assert torch.equal(run.record["1"]["output"], model[0](x).relu().detach())
    del model[1]
    model.pop(2)
    with fh.with_hooks(model, spec) as run:
        model(x)
    assert list(run.record) == ["0", "1"]
    with pytest.raises(fh.SelectorError, match="selector '2'"):
        fh.with_hooks(model, fh.outputs("2"))


def test_a_list_of_many_modules_keeps_its_order_in_stored() -> None:
    """`hook_outputs(list)` of thousands of modules: `stored` follows the list's order."""
    model = nn.Sequential(*[nn.Identity() for _ in range(2000)])
    chosen = [model[i] for i in range(1999, -1, -3)]
    x = torch.randn(1)
    with fh.with_hooks(model, fh.hook_outputs(chosen)) as run:
        model(x)
    assert len(run.stored) == len(chosen) and list(run.record)[:2] == ["1", "4"]


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
