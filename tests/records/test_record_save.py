"""Record.save writes only what Record.load reads, atomically."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import os
import signal
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import funhooks as fh

Pair = collections.namedtuple("Pair", "left right")


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


# -- a full disk (issue 26, item 12) ---------------------------------------------------------

@contextlib.contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """Writes past `limit` bytes fail with a real `OSError` (EFBIG), as on a full disk."""
    resource = pytest.importorskip("resource")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the process is killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_save_onto_a_full_disk_raises_an_os_error_naming_the_file_and_keeps_the_old_one(tmp_path: Path) -> None:
    """The write error of the disk comes back as an `OSError` naming the file, not torch's
    `RuntimeError: [enforce fail at inline_container.cc]`; the old file is as it was."""
    old = fh.Record({"m": {"output": (torch.zeros(1),)}})
    path = tmp_path / "rec.pt"
    old.save(path)
    with file_size_limit(2**20), pytest.raises(OSError) as info:
        fh.Record({"m": {"output": (torch.ones(2**20),)}}).save(path)
    assert info.value.errno == errno.EFBIG and info.value.filename == str(path)
    assert str(info.value) == (
        f"[Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}; Record.save wrote nothing, and a file already at "
        f"this path is unchanged: {str(path)!r}"
    )
    assert fh.Record.load(path).equal(old) and list(tmp_path.iterdir()) == [path]
