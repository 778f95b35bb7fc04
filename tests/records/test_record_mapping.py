"""Record: the Mapping protocol of Records and nodes, the validating constructor, notes on absences."""

from __future__ import annotations

import collections
import pickle
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import funhooks as fh


def make_record(device: torch.device) -> fh.Record:
    return fh.Record({
        "0": {"output": (torch.ones(2, device=device),), "input": (((torch.zeros(2, device=device),), {}),)},
        "2": {"output": (torch.full((3,), 2.0, device=device), torch.full((3,), 3.0, device=device))},
    })


Pair = collections.namedtuple("Pair", "left right")


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
