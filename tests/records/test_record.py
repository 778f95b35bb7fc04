"""Record: lookup, map, frozen values, pytree (with key paths), properties."""

from __future__ import annotations

import collections
import gc
import pickle
import weakref
from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import funhooks as fh


def make_record(device: torch.device) -> fh.Record:
    return fh.Record({
        "0": {"output": (torch.ones(2, device=device),), "input": (((torch.zeros(2, device=device),), {}),)},
        "2": {"output": (torch.full((3,), 2.0, device=device), torch.full((3,), 3.0, device=device))},
    })


Pair = collections.namedtuple("Pair", "left right")


# -- lookup, map, frozen, pytree, the basics of equal and save --------------------------------


def test_lookup_single_call(device: torch.device) -> None:
    """`rec[path][name]` is the value of a module that ran once."""
    rec = make_record(device)
    assert torch.equal(rec["0"]["output"], torch.ones(2, device=device))
    args, kwargs = rec["0"]["input"]
    assert torch.equal(args[0], torch.zeros(2, device=device)) and kwargs == {}


def test_single_access_to_a_multi_call_value_raises_with_exact_message(device: torch.device) -> None:
    """A module that ran twice has no single value: the error points to `rec.calls`."""
    rec = make_record(device)
    with pytest.raises(fh.RecordError) as err:
        rec["2"]["output"]
    assert str(err.value) == (
        "Record: `rec['2']['output']` needs a module that ran exactly once, got 2 calls. "
        "Use `rec.calls('2', 'output')` for all of them."
    )
    assert isinstance(err.value, LookupError)


def test_calls_in_call_order(device: torch.device) -> None:
    """`rec.calls(path, name)` is a tuple of every call's value, in order."""
    calls = make_record(device).calls("2", "output")
    assert isinstance(calls, tuple) and [float(c[0]) for c in calls] == [2.0, 3.0]


def test_unknown_path_and_name_raise_with_exact_messages(device: torch.device) -> None:
    """Unknown paths and names list what is there."""
    rec = make_record(device)
    with pytest.raises(fh.RecordError) as err:
        rec["1"]
    assert str(err.value) == (
        "Record: no module path '1' in this record, got paths ['0', '2']. Check the selector, or that the module ran."
    )
    with pytest.raises(fh.RecordError) as err:
        rec["0"]["grad"]
    assert str(err.value) == (
        "Record: module '0' stored no 'grad', got names ['output', 'input']. "
        "Use one of those, or add a spec that stores it."
    )


def test_stored_is_the_single_values_in_module_order(device: torch.device) -> None:
    """`rec.stored(name)` lists one value per module that stored `name`."""
    rec = fh.Record({"a": {"output": (torch.ones(1, device=device),)}, "b": {"grad": (torch.zeros(1, device=device),)},
                     "c": {"output": (torch.zeros(1, device=device),)}})
    assert [float(t) for t in rec.stored()] == [1.0, 0.0]
    assert [float(t) for t in rec.stored("grad")] == [0.0]
    with pytest.raises(fh.RecordError):
        make_record(device).stored()  # "2" ran twice


def test_in_len_iter_items(device: torch.device) -> None:
    """Paths support `in`, `len` and iteration in module order; nodes are mappings."""
    rec = make_record(device)
    assert "0" in rec and "1" not in rec and len(rec) == 2 and list(rec) == ["0", "2"]
    assert [p for p, _ in rec.items()] == ["0", "2"]
    assert list(rec["0"]) == ["output", "input"] and len(rec["0"]) == 2 and "input" in rec["0"]


def test_map_applies_to_every_tensor_and_returns_a_new_record(device: torch.device) -> None:
    """`rec.map(fn)` maps every stored tensor (nested ones too); the original is unchanged."""
    rec = make_record(device)
    doubled = rec.map(lambda t: t * 2)
    assert torch.equal(doubled["0"]["output"], torch.full((2,), 2.0, device=device))
    assert [float(c[0]) for c in doubled.calls("2", "output")] == [4.0, 6.0]
    assert doubled["0"]["input"][1] == {}
    assert torch.equal(rec["0"]["output"], torch.ones(2, device=device))


def test_map_leaves_non_tensors_alone() -> None:
    """Non-tensor values pass through `map` unchanged."""
    rec = fh.Record({"a": {"shape": ((2, 3),), "tag": ("x",)}})
    assert rec.map(lambda t: t + 1)["a"]["shape"] == (2, 3)


def test_every_kind_of_assignment_raises_frozen_error(device: torch.device) -> None:
    """Attribute, item and deletion on a Record or a node raise FrozenError."""
    rec = make_record(device)
    attempts = [
        lambda: setattr(rec, "_data", {}),
        lambda: setattr(rec, "extra", 1),
        lambda: delattr(rec, "_data"),
        lambda: rec.__setitem__("0", {}),
        lambda: rec.__delitem__("0"),
        lambda: rec["0"].__setitem__("output", 1),
        lambda: setattr(rec["0"], "_values", {}),
    ]
    for attempt in attempts:
        with pytest.raises(fh.FrozenError):
            attempt()
    assert list(rec) == ["0", "2"]


def test_frozen_error_messages() -> None:
    """FrozenError says what was attempted and to build a new value."""
    rec = fh.Record({})
    with pytest.raises(fh.FrozenError) as err:
        rec.x = 1  # type: ignore[attr-defined]
    assert str(err.value) == "Record: a frozen value cannot be assigned to, got `.x = ...`. Build a new one."
    with pytest.raises(fh.FrozenError) as err:
        rec["a"] = 1  # type: ignore[index]
    assert str(err.value) == "Record: a frozen value cannot be assigned to, got `['a'] = ...`. Build a new one."
    assert isinstance(err.value, AttributeError)


def test_constructor_copies_its_input(device: torch.device) -> None:
    """Changing the dict a Record was built from changes nothing in the Record."""
    data = {"a": {"output": [torch.ones(1, device=device)]}}
    rec = fh.Record(data)
    data["a"]["output"].append(torch.zeros(1, device=device))
    data["b"] = {}
    assert list(rec) == ["a"] and len(rec.calls("a", "output")) == 1


def test_constructor_needs_a_tuple_of_calls() -> None:
    """A bare tensor is not silently split into rows as if each were a call."""
    with pytest.raises(TypeError) as err:
        fh.Record({"fc": {"output": torch.ones(2, 3)}})
    assert str(err.value) == (
        "Record: each name maps to a tuple of per-call values, got Tensor for 'fc'/'output'. "
        "Wrap a single call's value as `(value,)`."
    )


def test_pytree_sees_every_tensor(device: torch.device) -> None:
    """tree_map over a Record maps its tensors and rebuilds a Record of the same shape."""
    rec = make_record(device)
    leaves = pytree.tree_leaves(rec)
    assert len([t for t in leaves if isinstance(t, torch.Tensor)]) == 4
    neg = pytree.tree_map(lambda t: -t if isinstance(t, torch.Tensor) else t, rec)
    assert isinstance(neg, fh.Record) and list(neg) == list(rec)
    assert torch.equal(neg["0"]["output"], -torch.ones(2, device=device))
    assert len(rec.tensors()) == 4


def test_pytree_through_torch_func_vmap() -> None:
    """A Record returned from a vmapped function comes back batched."""
    def f(x: torch.Tensor) -> fh.Record:
        return fh.Record({"a": {"output": (x * 2,)}})

    rec = torch.func.vmap(f)(torch.arange(6.0).reshape(3, 2))
    assert rec["a"]["output"].shape == (3, 2)


def test_equal_compares_structure_and_values(device: torch.device) -> None:
    """`equal` is exact by default and tolerant with `atol`; structure must match."""
    a = make_record(device)
    assert a.equal(make_record(device))
    b = a.map(lambda t: t + 1e-7)
    assert not a.equal(b) and a.equal(b, atol=1e-5)
    assert not a.equal(fh.Record({"0": {"output": (torch.ones(2, device=device),)}}))


def test_save_load_round_trip_with_weights_only(device: torch.device, tmp_path: Path) -> None:
    """`save` then `load` gives an equal Record; the file loads with weights_only=True."""
    rec = make_record(device)
    rec.save(tmp_path / "rec.pt")
    back = fh.Record.load(tmp_path / "rec.pt", map_location=device)
    assert back.equal(rec) and list(back) == list(rec)
    assert isinstance(back["0"]["input"], tuple)
    torch.load(tmp_path / "rec.pt", weights_only=True)  # no code to execute in the file


def test_save_load_keeps_shapes_dtypes_and_devices(tmp_path: Path) -> None:
    """Values observers often return (shapes, dtypes, devices) save and load as they were."""
    rec = fh.Record({"a": {"meta": ((torch.Size([2, 3]), torch.float16, torch.device("cpu"), 1 + 2j),)}})
    rec.save(tmp_path / "rec.pt")
    assert fh.Record.load(tmp_path / "rec.pt")["a"]["meta"] == (torch.Size([2, 3]), torch.float16, torch.device("cpu"), 1 + 2j)


def test_save_refuses_values_that_need_code(tmp_path: Path) -> None:
    """A stored object that is not plain data is refused at save time, with the fix."""
    rec = fh.Record({"a": {"obj": (nn.ReLU(),)}})
    with pytest.raises(TypeError) as err:
        rec.save(tmp_path / "rec.pt")
    assert str(err.value) == (
        "Record.save: stored values are tensors, numbers, str, bool, None, dtypes, devices and sizes in tuples, "
        f"lists, dicts and namedtuples, got ReLU at `rec['a']['obj']`, so nothing was written to {str(tmp_path / 'rec.pt')!r}. "
        "Store plain data instead, such as the tensors it holds."
    )
    assert list(tmp_path.iterdir()) == []


def test_load_of_another_file_raises_with_exact_message(tmp_path: Path) -> None:
    """Loading a file that `save` did not write says so."""
    path = tmp_path / "t.pt"
    torch.save({"weights": torch.ones(1)}, path)
    with pytest.raises(fh.RecordError) as err:
        fh.Record.load(path)
    assert str(err.value) == (
        f"Record.load: expected a file written by `Record.save`, got dict from {str(path)!r}. "
        "Load it with `torch.load` instead."
    )


def test_record_pickles(device: torch.device) -> None:
    """A Record pickles to an equal Record."""
    rec = make_record(device)
    assert pickle.loads(pickle.dumps(rec)).equal(rec)


@pytest.mark.usefixtures("frozen_heap")
def test_record_holds_no_reference_to_the_model() -> None:
    """After the run and the model are dropped, the model is collected while the Record lives."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    with fh.with_hooks(model, [fh.outputs("**"), fh.inputs("**"), fh.grads("**")]) as run:
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()
    rec = run.record
    ref = weakref.ref(model)
    del model, run
    gc.collect()
    assert ref() is None
    assert len(rec) == 3


class _Sentinel:
    """An object kept alive only by an autograd node's context."""


class _Tracked(torch.autograd.Function):
    """Identity whose graph node holds a sentinel, so a weakref tells when the graph died."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.sentinel = _Sentinel()
        _SENTINELS.append(weakref.ref(ctx.sentinel))
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad


_SENTINELS: list[weakref.ref] = []


class Tracked(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Tracked.apply(x)


@pytest.mark.usefixtures("frozen_heap")
def test_detached_record_holds_no_reference_to_the_graph() -> None:
    """With detach=True no stored tensor has a grad_fn and the graph dies with the output."""
    model = nn.Sequential(nn.Linear(3, 3), Tracked(), nn.Tanh(), nn.Linear(3, 1))
    with fh.with_hooks(model, [fh.outputs("**"), fh.inputs("**"), fh.grads("**")]) as run:
        y = model(torch.randn(2, 3, requires_grad=True))
    rec = run.record
    assert all(t.grad_fn is None and not t.requires_grad for t in rec.tensors())
    sentinel = _SENTINELS[-1]
    assert sentinel() is not None
    del y, run
    gc.collect()
    assert sentinel() is None
    assert len(rec) == 4


def test_undetached_record_keeps_the_graph() -> None:
    """With detach=False the stored output is the live tensor (a contrast to the above)."""
    model = nn.Sequential(nn.Linear(3, 1))
    with fh.with_hooks(model, fh.outputs("0", detach=False)) as run:
        y = model(torch.randn(2, 3))
    assert run.record["0"]["output"] is y


def test_repr_summarises_shapes() -> None:
    """The repr shows paths, names and shapes, not tensor contents."""
    rec = fh.Record({"fc": {"output": (torch.ones(2, 3),)}})
    assert repr(rec) == "Record({\n  'fc': {'output': [Tensor(2, 3)]}\n})"
    assert repr(fh.Record()) == "Record({})"


# -- properties ----------------------------------------------------------------------
names = st.sampled_from(["output", "input", "grad", "stat"])
values = st.one_of(
    st.builds(lambda n: torch.arange(float(n)), st.integers(0, 4)),
    st.integers(-5, 5),
    st.floats(allow_nan=False, width=32),
    st.none(),
    st.tuples(st.builds(lambda n: torch.ones(n, 2), st.integers(1, 3)), st.dictionaries(st.just("k"), st.booleans())),
    st.builds(lambda a, n: Pair(a, torch.ones(n)), st.integers(-5, 5), st.integers(0, 2)),
    st.builds(lambda n: torch.arange(float(n + 1)).max(0), st.integers(0, 3)),
)
records = st.dictionaries(
    st.text("abc.", min_size=0, max_size=4),
    st.dictionaries(names, st.lists(values, min_size=1, max_size=3), min_size=1, max_size=3),
    max_size=4,
).map(fh.Record)


@given(records)
def test_save_load_round_trip_property(tmp_path_factory: pytest.TempPathFactory, rec: fh.Record) -> None:
    """Any Record of plain data survives save -> load unchanged, order included."""
    path = tmp_path_factory.mktemp("rec") / "rec.pt"
    rec.save(path)
    back = fh.Record.load(path)
    assert back.equal(rec) and list(back) == list(rec)


@given(records)
def test_pytree_round_trip_property(rec: fh.Record) -> None:
    """Flatten then unflatten gives an equal Record."""
    leaves, spec = pytree.tree_flatten(rec)
    assert pytree.tree_unflatten(leaves, spec).equal(rec)


# -- key paths (issue 13) -----------------------------------------------------------------


def test_key_paths_name_the_path_the_name_and_the_call(device: torch.device) -> None:
    """`tree_flatten_with_path` / `keystr` give `.calls(path, name)[call]`, then the place inside the value."""
    rec = make_record(device)
    paths = [pytree.keystr(kp) for kp, _ in pytree.tree_flatten_with_path(rec)[0]]
    assert paths == [
        ".calls('0', 'output')[0]", ".calls('0', 'input')[0][0][0]",
        ".calls('2', 'output')[0]", ".calls('2', 'output')[1]",
    ]
    named = pytree.tree_map_with_path(lambda kp, t: (pytree.keystr(kp), tuple(t.shape)), rec)
    assert isinstance(named, fh.Record) and named.calls("2", "output")[1] == (".calls('2', 'output')[1]", (3,))


@given(records)
def test_key_paths_lead_to_their_leaves_property(rec: fh.Record) -> None:
    """Every key path gets its leaf back, with `key_get` and as the Python expression `rec<keystr>`."""
    pairs, spec = pytree.tree_flatten_with_path(rec)
    leaves = pytree.tree_leaves(rec)
    assert len(pairs) == len(leaves) and all(a is b for (_, a), b in zip(pairs, leaves))
    for kp, leaf in pairs:
        assert pytree.key_get(rec, kp) is leaf
        assert eval(f"rec{pytree.keystr(kp)}", {"rec": rec}) is leaf
    assert spec == pytree.tree_structure(rec)
