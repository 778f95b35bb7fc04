"""Record: lookup, calls, stored, map, iteration, immutability, pytree, save/load, and the
references a Record does (not) hold."""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import pickle
import typing
import weakref
import zipfile
from pathlib import Path
from typing import Any

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

Pair = collections.namedtuple("Pair", "left right")
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


# -- the Mapping protocol (issue 11, item 17) ----------------------------------------------


def test_node_answers_in_get_keys_and_dict_for_absent_names(device: torch.device) -> None:
    """`in`, `get`, `keys()` and `dict()` on a node answer instead of raising for a name it lacks."""
    node = make_record(device)["0"]
    assert "grad" not in node and "output" in node
    assert node.get("grad") is None and node.get("grad", 7) == 7
    assert torch.equal(node.get("output"), torch.ones(2, device=device))
    assert list(node.keys()) == ["output", "input"]
    assert list(dict(node)) == ["output", "input"]


def test_missing_name_raises_a_key_error_that_is_a_record_error(device: torch.device) -> None:
    """`node[name]` for an absent name raises a KeyError subclass whose str is the plain message."""
    node = make_record(device)["0"]
    with pytest.raises(KeyError) as err:
        node["grad"]
    assert isinstance(err.value, fh.RecordError) and isinstance(err.value, fh.RecordKeyError)
    assert str(err.value) == (
        "Record: module '0' stored no 'grad', got names ['output', 'input']. "
        "Use one of those, or add a spec that stores it."
    )
    with pytest.raises(fh.RecordKeyError):
        node.calls("grad")


def test_name_with_several_calls_is_in_the_node_but_has_no_single_value(device: torch.device) -> None:
    """A name stored by several calls: `in` is True and `keys()` lists it; `node[name]` and
    `get` raise the "ran N times" RecordError, which is not a KeyError (so `get` cannot hide it)."""
    node = make_record(device)["2"]
    assert "output" in node and list(node.keys()) == ["output"] and len(node) == 1
    for attempt in (lambda: node["output"], lambda: node.get("output"), lambda: dict(node)):
        with pytest.raises(fh.RecordError) as err:
            attempt()
        assert not isinstance(err.value, KeyError)
        assert str(err.value) == (
            "Record: `rec['2']['output']` needs a module that ran exactly once, got 2 calls. "
            "Use `rec.calls('2', 'output')` for all of them."
        )
    assert {n: len(node.calls(n)) for n in node} == {"output": 2}


def test_record_answers_in_get_and_keys_and_raises_a_key_error_for_a_missing_path(device: torch.device) -> None:
    """`Record` has `get`, `keys`, `values`, `in`; a missing path raises a RecordKeyError."""
    rec = make_record(device)
    assert rec.get("1") is None and rec.get("1", 0) == 0 and list(rec.get("0")) == ["output", "input"]
    assert list(rec.keys()) == ["0", "2"] and [list(n) for n in rec.values()] == [["output", "input"], ["output"]]
    assert 0 not in rec and list(dict(rec)) == ["0", "2"]
    with pytest.raises(KeyError) as err:
        rec["1"]
    assert isinstance(err.value, fh.RecordError)
    assert str(err.value) == (
        "Record: no module path '1' in this record, got paths ['0', '2']. Check the selector, or that the module ran."
    )
    with pytest.raises(fh.RecordKeyError):
        rec.calls("1", "output")


# -- the public constructor validates (issue 11, item 27) -----------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([("fc", {})], ("Record: `data` maps module paths to `{name: calls}` dicts, got list. "
                        "Pass e.g. `{'fc': {'output': (value,)}}`.")),
        ({"a": 1}, ("Record: each module path maps to a dict `{name: calls}`, got int for 'a'. "
                    "Write e.g. `{'a': {'output': (value,)}}`.")),
        ({0: {"output": (1,)}}, ("Record: module paths are str, got 0 (int). "
                                 "Use the path `model.named_modules()` gives, e.g. 'features.0'.")),
        ({"a": {1: (1,)}}, ("Record: record names are str, got 1 (int) at 'a'. "
                            "Name each stored value with a str, e.g. 'output'.")),
        ({"a": {"output": 1}}, ("Record: each name maps to a tuple of per-call values, got int for 'a'/'output'. "
                                "Wrap a single call's value as `(value,)`.")),
    ],
)
def test_constructor_validates_its_input_with_exact_messages(data: Any, message: str) -> None:
    """`fh.Record(data)` checks `{path: {name: calls}}` with str keys and raises a TypeError that says so."""
    with pytest.raises(TypeError) as err:
        fh.Record(data)
    assert str(err.value) == message


# -- notes on absences (for the run core) -------------------------------------------------

LATE = "its gradient arrived after the `with_hooks` block had exited; call `backward()` inside the block."


def noted_record() -> fh.Record:
    return fh.Record._trusted(
        {"0": {"output": (torch.ones(1),)}},
        notes={("1", "grad"): LATE, ("1", None): "it ran in another thread", ("0", "grad"): LATE,
               ("2", "output"): "never shown for path '1'"},
    )


def test_missing_path_error_carries_the_notes_for_that_path() -> None:
    """A note on `(path, name)` or `(path, None)` explains a missing path in its error, in place of the generic fix."""
    with pytest.raises(fh.RecordKeyError) as err:
        noted_record()["1"]
    assert str(err.value) == (
        "Record: no module path '1' in this record, got paths ['0']. "
        "Note on `rec['1']`: it ran in another thread. "
        f"Note on `rec['1']['grad']`: {LATE}"
    )


def test_missing_name_error_carries_the_notes_for_that_name_and_its_path() -> None:
    """`rec[path][name]` and `rec.calls(path, name)` show the notes on `(path, name)` and `(path, None)`."""
    rec = noted_record()
    for attempt in (lambda: rec["0"]["grad"], lambda: rec.calls("0", "grad")):
        with pytest.raises(fh.RecordKeyError) as err:
            attempt()
        assert str(err.value) == f"Record: module '0' stored no 'grad', got names ['output']. Note on `rec['0']['grad']`: {LATE}"
    with pytest.raises(fh.RecordKeyError) as err:
        rec["0"]["input"]  # no note on it: the generic fix
    assert str(err.value) == (
        "Record: module '0' stored no 'input', got names ['output']. Use one of those, or add a spec that stores it."
    )


def test_notes_are_kept_by_map_and_dropped_by_pytree_and_pickle_and_ignored_by_equal() -> None:
    """Notes explain absences of one Record: `map` keeps them; they are no leaf, no context, not pickled, not compared."""
    rec = noted_record()
    plain = fh.Record({"0": {"output": (torch.ones(1),)}})
    assert rec.equal(plain) and plain.equal(rec)
    assert pytree.tree_flatten(rec)[1] == pytree.tree_flatten(plain)[1] and len(pytree.tree_leaves(rec)) == 1
    with pytest.raises(fh.RecordKeyError, match="Note on"):
        rec.map(lambda t: t * 2)["1"]
    for copy in (pytree.tree_map(lambda t: t, rec), pickle.loads(pickle.dumps(rec))):
        with pytest.raises(fh.RecordKeyError) as err:
            copy["1"]
        assert "Note" not in str(err.value)


def test_notes_must_be_sentences_keyed_by_path_and_name() -> None:
    """A malformed notes mapping is refused with the shape it needs."""
    with pytest.raises(TypeError) as err:
        fh.Record._trusted({}, notes={"1": "x"})
    assert str(err.value) == (
        "Record._trusted: `notes` maps `(path, name)` or `(path, None)` to a str, got '1': 'x'. "
        "Key each note by a (str, str | None) pair."
    )


def test_nodes_reached_by_get_values_and_items_carry_their_notes() -> None:
    """However a node is reached, a missing name in it shows its notes."""
    rec = noted_record()
    for node in (rec.get("0"), next(iter(rec.values())), next(v for _, v in rec.items())):
        with pytest.raises(fh.RecordKeyError, match="Note on `rec\\['0'\\]\\['grad'\\]`"):
            node["grad"]


# -- equal on every kind of tensor (issue 11, item 18) -------------------------------------

exotic_tensors = pytest.mark.filterwarnings(
    "ignore:Sparse .* tensor support is in beta state:UserWarning",
    "ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning",
)


def one(value: Any) -> fh.Record:
    return fh.Record({"m": {"v": (value,)}})


def quantized(values: torch.Tensor, scale: float = 0.5, zero_point: int = 3) -> torch.Tensor:
    return torch.quantize_per_tensor(values, scale, zero_point, torch.quint8)


@exotic_tensors
def test_equal_answers_for_sparse_tensors_by_layout_and_values() -> None:
    """Sparse tensors are equal when layout, shape, dtype and values agree, whatever their index layout."""
    dense = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    other = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 5.0]])
    uncoalesced = torch.sparse_coo_tensor([[0, 1, 1], [1, 0, 0]], [1.0, 1.5, 0.5], (2, 3), check_invariants=True)
    explicit_zero = torch.sparse_coo_tensor([[0, 1, 1], [1, 0, 2]], [1.0, 2.0, 0.0], (2, 3), check_invariants=True)
    assert one(dense.to_sparse()).equal(one(dense.to_sparse()))
    assert one(dense.to_sparse()).equal(one(uncoalesced)) and one(dense.to_sparse()).equal(one(explicit_zero))
    assert not one(dense.to_sparse()).equal(one(other.to_sparse()))
    assert not one(dense.to_sparse()).equal(one(dense)) and not one(dense.to_sparse()).equal(one(dense.to_sparse_csr()))
    for layout in ("to_sparse_csr", "to_sparse_csc"):
        assert one(getattr(dense, layout)()).equal(one(getattr(dense, layout)()))
        assert not one(getattr(dense, layout)()).equal(one(getattr(other, layout)()))
    block = torch.zeros(4, 4)
    block[:2, 2:] = 1.0
    assert one(block.to_sparse_bsr((2, 2))).equal(one(block.to_sparse_bsr((2, 2))))
    assert one(block.to_sparse_bsr((2, 2))).equal(one(block.to_sparse_bsr((1, 1))))  # same values, other blocks
    assert not one(block.to_sparse_bsr((2, 2))).equal(one((block * 2).to_sparse_bsr((2, 2))))


def test_equal_answers_for_meta_tensors_by_shape_and_dtype() -> None:
    """Meta tensors hold no values: equal when shape and dtype agree; never equal to a real tensor."""
    meta = torch.empty(2, 3, device="meta")
    assert one(meta).equal(one(torch.empty(2, 3, device="meta")))
    assert not one(meta).equal(one(torch.empty(3, 2, device="meta")))
    assert not one(meta).equal(one(torch.empty(2, 3, device="meta", dtype=torch.float16)))
    assert not one(meta).equal(one(torch.zeros(2, 3))) and not one(torch.zeros(2, 3)).equal(one(meta))


@exotic_tensors
def test_equal_answers_for_quantized_tensors_by_scheme_parameters_and_int_values() -> None:
    """Quantized tensors are equal when qscheme, scales, zero points and int values agree."""
    values = torch.tensor([0.0, 1.0, 2.5])
    assert one(quantized(values)).equal(one(quantized(values)))
    assert not one(quantized(values)).equal(one(quantized(values + 1)))
    assert not one(quantized(values)).equal(one(quantized(values, scale=0.25)))
    assert not one(quantized(values)).equal(one(quantized(values, zero_point=4)))
    assert not one(quantized(values)).equal(one(values))
    scales, zero_points = torch.tensor([0.5, 0.25]), torch.tensor([0, 1])
    channels = torch.quantize_per_channel(torch.ones(2, 3), scales, zero_points, 0, torch.qint8)
    assert one(channels).equal(one(torch.quantize_per_channel(torch.ones(2, 3), scales, zero_points, 0, torch.qint8)))
    assert not one(channels).equal(one(torch.quantize_per_channel(torch.ones(2, 3), scales, zero_points * 2, 0, torch.qint8)))
    assert not one(channels).equal(one(torch.quantize_per_channel(torch.ones(2, 3), scales * 2, zero_points, 0, torch.qint8)))


def test_equal_answers_for_dtypes_without_comparison_kernels() -> None:
    """float8 tensors (no kernel for a tolerant `isclose`) compare by value, with a tolerance too."""
    x = torch.tensor([1.0, 2.0]).to(torch.float8_e4m3fn)
    assert one(x).equal(one(x.clone())) and not one(x).equal(one((x.float() * 2).to(torch.float8_e4m3fn)))
    assert one(x).equal(one(x.clone()), rtol=1e-3) and not one(x).equal(one((x.float() * 2).to(torch.float8_e4m3fn)), rtol=1e-3)


def test_equal_compares_the_structure_of_each_value(device: torch.device) -> None:
    """Containers must match too: other dict keys, a list for a tuple or another type of leaf are not equal."""
    t = torch.ones(2, device=device)
    assert not one({"a": t}).equal(one({"b": t}))
    assert not one((t, 1)).equal(one([t, 1]))
    assert not one((1, 2)).equal(one((1, 2.0)))
    assert one({"a": (t, [1, None])}).equal(one({"a": (t.clone(), [1, None])}))
    assert one(float("nan")).equal(one(float("nan")))  # as tensors compare with equal_nan=True


# Drawn pairs of tensors of one kind, the second often a re-encoding of the first's values.
cells = st.lists(st.sampled_from([0.0, 1.0, -2.0, 0.5]), min_size=6, max_size=6).map(
    lambda xs: torch.tensor(xs).reshape(2, 3))


@st.composite
def dense_pairs(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor]:
    a = draw(cells)
    b = draw(st.one_of(st.just(a.clone()), cells))
    return a, b


def _sparse(draw: st.DrawFn, dense: torch.Tensor) -> torch.Tensor:
    layout = draw(st.sampled_from(["coo", "uncoalesced", "csr", "csc"]))
    if layout == "uncoalesced":  # every cell split into two entries that add up to it
        idx = torch.cartesian_prod(torch.arange(2), torch.arange(3)).T
        half = dense.reshape(-1) / 2
        return torch.sparse_coo_tensor(torch.cat([idx, idx], 1), torch.cat([half, half]), (2, 3),
                                       check_invariants=True)
    return {"coo": dense.to_sparse, "csr": dense.to_sparse_csr, "csc": dense.to_sparse_csc}[layout]()


@exotic_tensors
@given(dense_pairs(), st.data())
def test_equal_on_sparse_tensors_is_equality_of_layout_and_dense_values(pair: tuple, data: st.DataObject) -> None:
    """For sparse tensors `equal` answers (never raises) and agrees with comparing layouts and dense values."""
    a, b = (_sparse(data.draw, t) for t in pair)
    expected = a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense())
    assert one(a).equal(one(b)) == expected == one(b).equal(one(a))
    assert one(a).equal(one(a))


@exotic_tensors
@given(dense_pairs(), st.sampled_from([0.5, 0.25]), st.sampled_from([0.5, 0.25]), st.sampled_from([0, 3]),
       st.sampled_from([0, 3]), st.booleans())
def test_equal_on_quantized_tensors_is_equality_of_parameters_and_int_values(
    pair: tuple, scale_a: float, scale_b: float, zero_a: int, zero_b: int, per_channel: bool
) -> None:
    """For quantized tensors `equal` agrees with comparing qscheme, scales, zero points and int values."""
    if per_channel:
        a = torch.quantize_per_channel(pair[0], torch.tensor([scale_a, 0.5]), torch.tensor([zero_a, 0]), 0, torch.quint8)
        b = torch.quantize_per_channel(pair[1], torch.tensor([scale_b, 0.5]), torch.tensor([zero_b, 0]), 0, torch.quint8)
    else:
        a, b = quantized(pair[0], scale_a, zero_a), quantized(pair[1], scale_b, zero_b)
    expected = scale_a == scale_b and zero_a == zero_b and torch.equal(a.int_repr(), b.int_repr())
    assert one(a).equal(one(b)) == expected == one(b).equal(one(a))


@given(st.sampled_from([(2, 3), (3, 2), (6,)]), st.sampled_from([(2, 3), (3, 2), (6,)]),
       st.sampled_from([torch.float32, torch.int64]), st.sampled_from([torch.float32, torch.int64]))
def test_equal_on_meta_tensors_is_equality_of_shape_and_dtype(shape_a: tuple, shape_b: tuple, dtype_a: torch.dtype,
                                                              dtype_b: torch.dtype) -> None:
    """For meta tensors `equal` agrees with comparing shape and dtype."""
    a, b = torch.empty(shape_a, dtype=dtype_a, device="meta"), torch.empty(shape_b, dtype=dtype_b, device="meta")
    assert one(a).equal(one(b)) == (shape_a == shape_b and dtype_a == dtype_b)


# -- save writes only what load reads (issue 11, item 15) ----------------------------------

class Point(typing.NamedTuple):
    x: torch.Tensor
    y: int


class ModelOutput(collections.OrderedDict):
    """What a HuggingFace model returns: an OrderedDict subclass (pytree-registered there)."""


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class Tagged(torch.Tensor):
    """A tensor subclass: its class must be imported to load it."""


def saved_and_loaded(rec: fh.Record, path: Path) -> fh.Record:
    rec.save(path)
    return fh.Record.load(path)


def test_namedtuples_round_trip_as_namedtuples_with_the_same_name_and_fields(tmp_path: Path) -> None:
    """A namedtuple comes back as a namedtuple of that name and those fields, nested ones too; no code runs."""
    rec = fh.Record({"m": {"output": (Pair(torch.ones(2), {"p": Point(torch.zeros(1), 3)}), [Pair(1, 2)])}})
    back = saved_and_loaded(rec, tmp_path / "rec.pt")
    first, second = back.calls("m", "output")
    assert type(first).__name__ == "Pair" and type(first)._fields == ("left", "right")
    assert type(first.right["p"]).__name__ == "Point" and first.right["p"].y == 3
    assert type(second[0]) is type(first) and second[0] == (1, 2)
    assert back.equal(rec)
    torch.load(tmp_path / "rec.pt", weights_only=True)


def test_torch_return_types_round_trip_as_the_real_type(tmp_path: Path) -> None:
    """`torch.max(x, 0)` and `topk` values come back as `torch.return_types.max` / `.topk`."""
    x = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    rec = fh.Record({"m": {"max": (x.max(0),), "topk": ({"k": x.topk(1)},)}})
    back = saved_and_loaded(rec, tmp_path / "rec.pt")
    assert type(back["m"]["max"]) is torch.return_types.max and type(back["m"]["topk"]["k"]) is torch.return_types.topk
    assert torch.equal(back["m"]["max"].indices, torch.tensor([1, 0])) and back.equal(rec)


@pytest.mark.parametrize(
    ("value", "where", "type_name", "fix"),
    [
        (ModelOutput(logits=torch.ones(1)), "rec['m']['output']", "ModelOutput", "Store `dict(value)` instead."),
        ((1, Output(torch.ones(1))), "rec['m']['output'][1]", "Output", "Store `dataclasses.asdict(value)` instead."),
        ({"t": torch.ones(1).as_subclass(Tagged)}, "rec['m']['output']['t']", "Tagged",
         "Store `value.as_subclass(torch.Tensor)` instead."),
        (collections.namedtuple("Renamed", ["a", "def"], rename=True)(1, 2), "rec['m']['output']", "Renamed",
         "Store `value._asdict()` instead."),
    ],
)
def test_save_refuses_what_load_could_not_rebuild_with_exact_message(
    tmp_path: Path, value: Any, where: str, type_name: str, fix: str
) -> None:
    """Mapping subclasses (HF ModelOutput), dataclasses, tensor subclasses: refused, naming where, what and the fix."""
    path = tmp_path / "rec.pt"
    with pytest.raises(TypeError) as err:
        fh.Record({"m": {"output": (value,)}}).save(path)
    assert str(err.value) == (
        "Record.save: stored values are tensors, numbers, str, bool, None, dtypes, devices and sizes in tuples, "
        f"lists, dicts and namedtuples, got {type_name} at `{where}`, so nothing was written to {str(path)!r}. {fix}"
    )
    assert list(tmp_path.iterdir()) == []


def test_save_names_the_call_of_a_module_that_ran_several_times(tmp_path: Path) -> None:
    """The location says which call holds the refused value."""
    with pytest.raises(TypeError, match=r"got Output at `rec.calls\('m', 'output'\)\[1\]\['o'\]`"):
        fh.Record({"m": {"output": ({"o": 1}, {"o": Output(torch.ones(1))})}}).save(tmp_path / "rec.pt")


def test_save_refuses_dict_keys_load_could_not_read_with_exact_message(tmp_path: Path) -> None:
    """Dict keys must be plain too."""
    path = tmp_path / "rec.pt"
    with pytest.raises(TypeError) as err:
        fh.Record({"m": {"stats": ({frozenset({1}): 1},)}}).save(path)
    assert str(err.value) == (
        "Record.save: dict keys in stored values are str, numbers, bool, None, dtypes, devices or tuples of them, "
        f"got a frozenset key at `rec['m']['stats']`, so nothing was written to {str(path)!r}. Use such keys, e.g. `str(key)`."
    )


class Owner:
    """An object `torch.load(weights_only=True)` refuses."""


def test_save_refuses_what_weights_only_load_would_refuse_with_exact_message(tmp_path: Path) -> None:
    """An object hidden where the value walk cannot see (a tensor attribute) is caught by reading the file back."""
    path = tmp_path / "rec.pt"
    path.write_bytes(b"the previous file")
    tensor = torch.ones(1)
    tensor.owner = Owner()  # type: ignore[attr-defined]
    with pytest.raises(TypeError) as err:
        fh.Record({"m": {"output": (tensor,)}}).save(path)
    assert str(err.value) == (
        "Record.save: a saved Record must load with `torch.load(weights_only=True)`, got values that pickle to "
        "something it refuses (such as an object set as an attribute of a stored tensor), so nothing was written to "
        f"{str(path)!r}. Store plain data only; the error's cause names what was refused."
    )
    assert path.read_bytes() == b"the previous file" and list(tmp_path.iterdir()) == [path]


def test_a_save_that_fails_half_way_leaves_no_file_and_the_old_file_as_it_was(tmp_path: Path) -> None:
    """Writing goes to a temporary file in the same directory, renamed only once complete."""
    tensor = torch.ones(1)
    tensor.fn = lambda: None  # type: ignore[attr-defined]  # pickling fails after the file was opened
    with pytest.raises(Exception, match="pickle"):
        fh.Record({"m": {"output": (tensor,)}}).save(tmp_path / "new.pt")
    assert list(tmp_path.iterdir()) == []
    old = tmp_path / "old.pt"
    fh.Record({"m": {"output": (torch.zeros(1),)}}).save(old)
    with pytest.raises(Exception, match="pickle"):
        fh.Record({"m": {"output": (tensor,)}}).save(old)
    assert fh.Record.load(old).equal(fh.Record({"m": {"output": (torch.zeros(1),)}}))
    assert list(tmp_path.iterdir()) == [old]


# -- load refuses, with a RecordError, what save did not write (issue 11, item 16) ----------


def saved_bytes(tmp_path: Path) -> bytes:
    path = tmp_path / "good.pt"
    fh.Record({"m": {"output": (torch.arange(64.0),)}}).save(path)
    return path.read_bytes()


def load_error(path: Path) -> str:
    with pytest.raises(fh.RecordError) as err:
        fh.Record.load(path)
    return str(err.value)


def truncated_message(path: Path, detail: str) -> str:
    return (
        "Record.load: a Record file is a complete archive as `Record.save` writes it, got a truncated or corrupt "
        f"file {str(path)!r} ({detail}). Write it again with `Record.save`."
    )


def malformed_message(path: Path, problem: str) -> str:
    return (
        "Record.load: a Record file holds `{path: {name: [value, ...]}}` of plain data, got "
        f"{problem} in {str(path)!r}. The file was altered or not written by `Record.save`; write it again."
    )


def test_load_of_a_truncated_or_empty_file_raises_with_exact_message(tmp_path: Path) -> None:
    """A file cut short (a copy interrupted, a full disk) says so, instead of EOFError or a miniz error."""
    good = saved_bytes(tmp_path)
    for name, content, detail in [
        ("half.pt", good[: len(good) // 2], "its zip directory is missing or damaged"),
        ("two.pt", good[:2], "its zip directory is missing or damaged"),
        ("empty.pt", b"", "it is empty"),
    ]:
        (tmp_path / name).write_bytes(content)
        assert load_error(tmp_path / name) == truncated_message(tmp_path / name, detail)


def test_load_of_a_file_with_damaged_tensor_bytes_raises_instead_of_returning_wrong_values(tmp_path: Path) -> None:
    """Each part of the archive is checked against its CRC-32: a flipped byte in a tensor is not read silently."""
    good = bytearray(saved_bytes(tmp_path))
    marker = torch.arange(64.0).numpy().tobytes()[40:48]
    at = good.index(marker)
    good[at] ^= 0xFF
    path = tmp_path / "flipped.pt"
    path.write_bytes(good)
    assert load_error(path) == truncated_message(path, "its part 'archive/data/0' fails its CRC-32 check")


def test_load_of_a_foreign_file_raises_with_exact_message(tmp_path: Path) -> None:
    """A text file or another zip archive is not a Record: a RecordError, not `KeyError('101')`."""
    text, archive = tmp_path / "notes.txt", tmp_path / "other.zip"
    text.write_text("hello")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("readme.txt", "hi")
    for path, what in [(text, "a file that is not a zip archive"), (archive, "a zip archive that `torch.save` did not write")]:
        assert load_error(path) == (
            f"Record.load: expected a file written by `Record.save`, got {what} from {str(path)!r}. "
            "Pass the path of a saved Record."
        )


def test_load_of_a_newer_format_version_raises_with_exact_message(tmp_path: Path) -> None:
    """A file from a newer funhooks is refused rather than misread."""
    path = tmp_path / "new.pt"
    torch.save({"format": "funhooks.Record", "version": 99, "data": {"a": {"b": [1]}}}, path)
    assert load_error(path) == (
        f"Record.load: this funhooks reads Record files of format version 1 to 2, got version 99 in {str(path)!r}. "
        "Upgrade funhooks to read it."
    )


@pytest.mark.parametrize(
    ("blob", "problem"),
    [
        ({"format": "funhooks.Record", "version": 1, "data": [1]}, "list for `data`"),
        ({"format": "funhooks.Record", "version": "1", "data": {}}, "version '1'"),
        ({"format": "funhooks.Record", "version": 2, "data": {}}, "the keys ['format', 'version', 'data']"),
        ({"format": "funhooks.Record", "version": 1, "data": {1: {}}}, "the path 1"),
        ({"format": "funhooks.Record", "version": 1, "data": {"a": [1]}}, "list for the path 'a'"),
        ({"format": "funhooks.Record", "version": 1, "data": {"a": {2: [1]}}}, "the name 2 at 'a'"),
        ({"format": "funhooks.Record", "version": 1, "data": {"a": {"b": 1}}}, "int for the calls of 'a'/'b'"),
        ({"format": "funhooks.Record", "version": 1, "data": {"a": {"b": [(1, {2, 3})]}}}, "a set at `rec['a']['b'][1]`"),
        ({"format": "funhooks.Record", "version": 2, "data": {"a": {"b": [1]}}, "types": [("a", "b", 0)]},
         "the type entry ('a', 'b', 0)"),
        ({"format": "funhooks.Record", "version": 2, "data": {"a": {"b": [1]}},
          "types": [("a", "b", 0, (), "namedtuple", "P", ("x",))]}, "a type entry for `rec['a']['b']`, which holds no tuple of its length"),
        ({"format": "funhooks.Record", "version": 2, "data": {"a": {"b": [(1,)]}},
          "types": [("a", "b", 0, (), "namedtuple", "P", ("import os",))]},
         "the type entry ('a', 'b', 0, (), 'namedtuple', 'P', ('import os',))"),
        ({"format": "funhooks.Record", "version": 2, "data": {"a": {"b": [(1,)]}},
          "types": [("a", "b", 0, (), "torch.return_types", "__class__", ())]},
         "the type entry ('a', 'b', 0, (), 'torch.return_types', '__class__', ())"),
    ],
)
def test_load_validates_the_whole_structure_with_exact_messages(tmp_path: Path, blob: dict, problem: str) -> None:
    """Malformed content raises a RecordError saying what is wrong, not AttributeError or a half-built Record."""
    path = tmp_path / "bad.pt"
    torch.save(blob, path)
    assert load_error(path) == malformed_message(path, problem)


class Payload:
    """A pickle that would run code: unpickling it creates a directory."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.target),))


def test_load_refuses_a_pickle_that_would_run_code_with_exact_message(tmp_path: Path) -> None:
    """Malicious pickles stay refused (`weights_only=True`): the code never runs."""
    path, target = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"format": "funhooks.Record", "version": 2, "data": {"a": {"b": [Payload(target)]}}, "types": []}, path)
    assert load_error(path) == (
        "Record.load: a Record file holds only plain data and is read with `torch.load(weights_only=True)`, got "
        f"{str(path)!r}, whose pickle it refuses (it needs code to load, or is damaged). Load only files written by "
        "`Record.save`; use `torch.load(..., weights_only=False)` only on a file from a source you trust."
    )
    assert not target.exists()


def test_load_of_an_archive_missing_a_tensor_raises_with_exact_message(tmp_path: Path) -> None:
    """An archive whose pickle refers to a tensor that is not there is corrupt."""
    good, path = tmp_path / "good.pt", tmp_path / "cut.pt"
    saved_bytes(tmp_path)
    with zipfile.ZipFile(good) as z, zipfile.ZipFile(path, "w") as out:
        for name in z.namelist():
            if "/data/" not in name:
                out.writestr(name, z.read(name))
    assert load_error(path) == truncated_message(path, "a tensor its pickle refers to is missing")


def test_load_reads_format_version_1_files(tmp_path: Path) -> None:
    """Files written before namedtuples were kept (format version 1) still load."""
    path = tmp_path / "v1.pt"
    torch.save({"format": "funhooks.Record", "version": 1, "data": {"a": {"output": [torch.ones(1), (1, "x")]}}}, path)
    assert fh.Record.load(path).equal(fh.Record({"a": {"output": (torch.ones(1), (1, "x"))}}))


@pytest.mark.filterwarnings(
    "ignore:Sparse .* tensor support is in beta state:UserWarning",
    "ignore:torch.quantize_per_tensor, torch.quantize_per_channel:UserWarning",
    "ignore:The PyTorch API of nested tensors is in prototype stage:UserWarning",
    "ignore:TypedStorage is deprecated:UserWarning",  # torch's own, from loading a quantized tensor
)
def test_every_kind_of_tensor_round_trips(tmp_path: Path) -> None:
    """Sparse, quantized, meta, nested, float8, complex, views and Parameters save and load equal."""
    dense = torch.tensor([[0.0, 1.5], [2.0, 0.0]])
    kinds = {
        "coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "quantized": quantized(dense),
        "meta": torch.empty(2, 3, device="meta"), "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        "jagged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)], layout=torch.jagged),
        "float8": dense.to(torch.float8_e4m3fn), "complex": torch.tensor([1 + 2j]), "view": torch.arange(10.0)[::3],
        "parameter": nn.Parameter(torch.ones(2)),
    }
    rec = fh.Record({"m": {name: (t,) for name, t in kinds.items()}})
    back = saved_and_loaded(rec, tmp_path / "rec.pt")
    assert back.equal(rec)
    assert {name: back["m"][name].layout for name in ("coo", "csr")} == {"coo": torch.sparse_coo, "csr": torch.sparse_csr}
    assert back["m"]["meta"].is_meta and back["m"]["quantized"].is_quantized and back["m"]["jagged"].is_nested
    assert type(back["m"]["parameter"]) is nn.Parameter


def test_save_to_a_missing_directory_names_the_file_asked_for(tmp_path: Path) -> None:
    """The error names the path given, not the temporary file beside it."""
    with pytest.raises(FileNotFoundError) as err:
        fh.Record({"m": {"output": (1,)}}).save(tmp_path / "missing" / "rec.pt")
    assert err.value.filename == str(tmp_path / "missing" / "rec.pt")


def test_load_of_an_archive_with_a_damaged_pickle_raises_with_exact_message(tmp_path: Path) -> None:
    """A pickle cut short inside an archive whose checksums agree (so written that way) is refused too."""
    path = tmp_path / "cut.pt"
    saved_bytes(tmp_path)
    with zipfile.ZipFile(tmp_path / "good.pt") as z, zipfile.ZipFile(path, "w") as out:
        for name in z.namelist():
            out.writestr(name, z.read(name)[:10] if name.endswith("data.pkl") else z.read(name))
    assert load_error(path) == (
        "Record.load: a Record file holds only plain data and is read with `torch.load(weights_only=True)`, got "
        f"{str(path)!r}, whose pickle it refuses (it needs code to load, or is damaged). Load only files written by "
        "`Record.save`; use `torch.load(..., weights_only=False)` only on a file from a source you trust."
    )


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
