"""torch.compile: compiled capture functions, and the state of with_hooks on compiled models."""


import copy

import pytest
import torch
from helpers import RECORDS_IN_COMPILE
from torch import nn

import funhooks as fh

pytestmark = [
    # inductor's own use of deprecated torch.jit APIs, not ours
    pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning"),
]


def small() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))


@RECORDS_IN_COMPILE
def test_compiled_capture_equals_eager_without_graph_breaks_or_recompiles() -> None:
    """torch.compile(capture(...)) gives the eager Record, 0 graph breaks, no recompiles."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = small()
    f = fh.capture(model, [fh.outputs(nn.Linear), fh.inputs("2")])
    x = torch.randn(3, 4)
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 0
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True)
    out, rec = compiled(x)
    eager_out, eager_rec = fh.capture(model, [fh.outputs(nn.Linear, clone=True), fh.inputs("2", clone=True)])(x)
    assert torch.allclose(out, eager_out, atol=1e-6) and rec.equal(eager_rec, atol=1e-6)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(5):
        compiled(torch.randn(3, 4))
    assert counters["stats"]["unique_graphs"] == graphs
    fh.testing.assert_no_hooks(model)


def test_capture_of_a_compiled_model_records_eagerly() -> None:
    """capture on an OptimizedModule runs the inner model, so its Record is never empty."""
    model = small()
    compiled = torch.compile(model)
    x = torch.randn(2, 4)
    _, rec = fh.capture(compiled, fh.outputs("0", clone=True))(x)
    assert torch.allclose(rec["0"]["output"], model[0](x).detach())


@RECORDS_IN_COMPILE
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
def test_capture_records_inside_a_separately_compiled_submodule() -> None:
    """A module inside a submodule compiled on its own is recorded, equal to eager."""
    model = small()
    eager = small()
    model[2] = torch.compile(model[2])
    x = torch.randn(2, 4)
    model(x)  # the submodule is compiled before the capture exists
    out, rec = fh.capture(model, fh.outputs("**", clone=True))(x)  # `0` is eager, then ReLU(inplace=True)
    _, expected = fh.capture(eager, fh.outputs("**", clone=True))(x)
    assert list(rec) == ["0", "1", "2"]
    assert rec.equal(expected, atol=1e-6)
    assert torch.allclose(out, eager(x), atol=1e-6)


@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")
@pytest.mark.parametrize("route", ["compiled capture", "with_hooks on a compiled model",
                                   "with_hooks on a model compiled in place", "capture of a model compiled in place"])
def test_compiled_recording_gives_the_eager_record_on_every_torch(route: str) -> None:
    """Every way of recording compiled code (a compiled capture; a run or a capture on a model
    compiled before it, by ``torch.compile(model)`` or in place by ``model.compile()``) gives the
    eager Record and output on every torch release, graph breaks allowed (2.12 raised
    AttributeError from dynamo here), and leaves no hooks; the model recorded after a
    ReLU(inplace=True) changed its input."""
    model, eager = small(), small()
    x = torch.randn(3, 4)
    specs = [fh.outputs("**"), fh.inputs("2"), fh.observe("0", lambda m, args, out: out.sum(), name="total")]
    if route == "compiled capture":
        out, rec = torch.compile(fh.capture(model, specs))(x)
    elif route == "capture of a model compiled in place":
        model.compile()
        model(x)
        out, rec = fh.capture(model, specs)(x)
    else:
        compiled = torch.compile(model) if route == "with_hooks on a compiled model" else model
        if compiled is model:
            model.compile()
        compiled(x)  # compiled before the run
        with fh.with_hooks(compiled, specs) as run:
            out = compiled(x)
        rec = run.record
    clones = [fh.outputs("**", clone=True), fh.inputs("2", clone=True), specs[2]]
    expected_out, expected = fh.capture(eager, clones)(x)
    assert list(rec) == ["0", "1", "2"]
    assert rec.equal(expected, atol=1e-6)
    assert torch.allclose(out, expected_out, atol=1e-6)
    fh.testing.assert_no_hooks(model)


@RECORDS_IN_COMPILE
def test_with_hooks_on_a_model_compiled_before_the_run_records() -> None:
    """with_hooks on a model compiled before any run gives the eager Record, also over
    repeated runs without new graphs, and stores nothing once the block has exited."""
    from torch._dynamo.utils import counters

    model = small()
    compiled = torch.compile(model)
    x = torch.randn(3, 4)
    compiled(x)  # compiled before funhooks installed anything
    with fh.with_hooks(compiled, fh.outputs("**")) as run:
        y = compiled(x)
    with fh.with_hooks(model, fh.outputs("**", clone=True)) as eager:
        model(x)
    assert list(run.record) == ["0", "1", "2"]
    assert run.record.equal(eager.record, atol=1e-6)
    assert torch.allclose(run.record["2"]["output"], y)
    graphs = counters["stats"]["unique_graphs"]
    for _ in range(5):
        with fh.with_hooks(compiled, fh.outputs("**")) as again:
            compiled(x)
        assert again.record.equal(run.record, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs
    compiled(x)
    assert len(again.record.calls("0", "output")) == 1
    fh.testing.assert_no_hooks(model)


@RECORDS_IN_COMPILE
def test_with_hooks_on_a_model_with_a_compiled_submodule_records_its_paths() -> None:
    """A submodule compiled on its own is hooked at its plain path, no `_orig_mod.`."""
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    outer = nn.Sequential(torch.compile(inner), nn.Linear(4, 1))
    x = torch.randn(2, 4)
    outer(x)
    with fh.with_hooks(outer, fh.outputs("**")) as run:
        y = outer(x)
    assert list(run.record) == ["0", "0.0", "0.1", "1"]
    assert torch.allclose(run.record["1"]["output"], y)


@RECORDS_IN_COMPILE
def test_fit_on_a_compiled_model_gives_the_eager_statistics() -> None:
    """On a model compiled before training (`torch.compile(model)`), the activations are the
    compiled graph's copies (nothing to keep or check): the statistics are the eager model's,
    to the compiled kernels' rounding, and nothing is left on the model."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    compiled = torch.compile(copy.deepcopy(eager))
    batches = [(torch.randn(6, 4), torch.randn(6, 2)) for _ in range(4)]
    want, got = (fh.fit(m, batches, nn.functional.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1), fh.ActivationStats())
                 for m in (eager, compiled))
    assert got.paths == want.paths and len(got.stats) == 4
    for step_got, step_want in zip(got.stats, want.stats):
        for a, b in zip(step_got, step_want):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    fh.testing.assert_no_hooks(compiled)


def _record_of(model: nn.Module, specs: list, x: torch.Tensor, compiled: bool) -> tuple[torch.Tensor, fh.Record]:
    f = fh.capture(model, specs)
    return torch.compile(f, fullgraph=True)(x) if compiled else f(x)


@RECORDS_IN_COMPILE
@pytest.mark.parametrize("separator", ["", "\x1f", "\x1e"])
def test_compiled_capture_of_every_kind_of_spec_equals_eager(separator: str) -> None:
    """Stores of copies (outputs, inputs, moved to the CPU), an observer and an editor on
    one model, and a module whose name holds the characters the compiled layout separates
    its rows with: the compiled Record and output are the eager ones, in one graph."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ModuleDict({f"a{separator}b": nn.Linear(8, 8)}), nn.ReLU(),
                          nn.Linear(8, 2))
    model[1].forward = lambda x: model[1][f"a{separator}b"](x)  # a ModuleDict has no forward of its own
    specs = [fh.outputs(nn.Linear, clone=True), fh.inputs("3", cpu=True, clone=True),
             fh.observe("2", lambda m, a, o: o.sum(), name="total"),
             fh.edit("0", lambda m, a, o: o * 2)]
    x = torch.randn(3, 4)
    torch._dynamo.reset()
    out, rec = _record_of(model, specs, x, compiled=True)
    eager_out, eager_rec = _record_of(model, specs, x, compiled=False)
    assert list(rec) == list(eager_rec) == ["0", f"1.a{separator}b", "2", "3"]
    assert torch.allclose(out, eager_out, atol=1e-6) and rec.equal(eager_rec, atol=1e-5)
    fh.testing.assert_no_hooks(model)


@RECORDS_IN_COMPILE
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf:UserWarning")  # dynamo's, on a block's input
@pytest.mark.parametrize("where", ["the model", "one block"])
def test_runs_on_modules_compiled_in_place_record_in_the_compiled_code(where: str) -> None:
    """``module.compile()`` (the model, or one block of it, as per-block compiling does): runs
    record through a recorder compiled like the module, with no graph break, no new graph
    over more runs than dynamo's recompile limit, and the eager Record; the module is called
    through its compiled code again after the block."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, eager = small(), small()
    compiled = model if where == "the model" else model[2]
    compiled.compile()
    x = torch.randn(3, 4)
    model(x)  # compiled before the runs
    counters.clear()
    specs = [fh.outputs("**", clone=True), fh.inputs("2"), fh.edit("0", lambda m, a, o: o * 2)]  # `0` is eager with one block
    expected_out, expected = fh.capture(eager, [specs[0], fh.inputs("2", clone=True), specs[2]])(x)
    for _ in range(torch._dynamo.config.recompile_limit + 2):
        with fh.with_hooks(model, specs) as run:
            out = model(x)
        assert list(run.record) == ["0", "1", "2"]
        assert run.record.equal(expected, atol=1e-6) and torch.allclose(out, expected_out, atol=1e-6)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1  # the run's recorder, once
    fh.testing.assert_no_hooks(model)
    assert model.__dict__.keys() == eager.__dict__.keys() | ({"_compiled_call_impl"} if compiled is model else set())
    model(x)
    assert counters["stats"]["unique_graphs"] == 1  # the module's own compiled code, unchanged


@RECORDS_IN_COMPILE
def test_a_plan_made_before_module_compile_is_made_again() -> None:
    """A run before ``model.compile()``, one after it and one after compiling is undone: each
    records the eager Record the way the model is called then (through the compiled recorder
    only while the model is compiled: no graph break)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model, eager = small(), small()
    x = torch.randn(3, 4)
    _, expected = fh.capture(eager, fh.outputs("**", clone=True))(x)
    records = []
    for state in ("eager", "compiled", "undone"):
        if state == "compiled":
            model.compile()
        elif state == "undone":
            model._compiled_call_impl = None
        counters.clear()
        with fh.with_hooks(model, fh.outputs("**", clone=True)) as run:
            model(x)
        records.append(run.record)
        assert not counters["graph_break"]
        assert counters["stats"]["unique_graphs"] == (1 if state == "compiled" else 0)
    assert all(rec.equal(expected, atol=1e-6) for rec in records)


def test_a_copy_made_in_a_block_of_a_module_compiled_in_place_is_the_plain_copy() -> None:
    """``copy.deepcopy`` drops a module's compiled call (PyTorch's own ``__getstate__``); a copy
    made inside a block on a module compiled in place is the same as one made outside it."""
    model = small()
    model.compile()
    x = torch.randn(3, 4)
    model(x)
    outside = copy.deepcopy(model)
    with fh.with_hooks(model, fh.outputs("0")):
        inside = copy.deepcopy(model)
    assert inside.__dict__.keys() == outside.__dict__.keys()
    assert "_compiled_call_impl" not in inside.__dict__
    fh.testing.assert_no_hooks(inside)
    assert torch.allclose(inside(x), model(x))


def test_non_strict_export_inside_a_block_exports_the_editors() -> None:
    """``torch.export.export(model, strict=False)`` inside a block runs the model in Python: the
    run's editors are in the exported program, and the model is left as it was."""
    model = small()
    x = torch.randn(3, 4)
    with fh.with_hooks(model, fh.edit("2", lambda m, a, o: -o)):
        program = torch.export.export(model, (x,), strict=False)
    fh.testing.assert_no_hooks(model)
    assert torch.allclose(program.module()(x), -model(x), atol=1e-6)


@RECORDS_IN_COMPILE
@pytest.mark.filterwarnings("ignore:While compiling, we found certain side effects:UserWarning")
def test_strict_export_of_a_capture_gives_its_values() -> None:
    """A module calling a capture function (its model registered as a submodule) exports in
    strict mode, one graph: the program returns the edited output and the stored values.
    (Export warns of "side effects" on the modules: the recording sets their ``forward`` in
    their ``__dict__`` and restores it, inside the trace.)"""
    model = small()
    f = fh.capture(model, [fh.outputs("0", clone=True), fh.edit("2", lambda m, a, o: -o)])

    class Exported(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out, rec = f(x)
            return out, rec["0"]["output"]

    x = torch.randn(3, 4)
    program = torch.export.export(Exported(), (x,), strict=True)
    out, stored = program.module()(x)
    with torch.no_grad():
        assert torch.allclose(out, -model(x), atol=1e-6) and torch.allclose(stored, model[0](x), atol=1e-6)
    fh.testing.assert_no_hooks(model)
