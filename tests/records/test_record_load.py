"""Record.load refuses, with a RecordError naming the file, what save did not write."""

from __future__ import annotations

import collections
import os
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import funhooks as fh

Pair = collections.namedtuple("Pair", "left right")


def quantized(values: torch.Tensor, scale: float = 0.5, zero_point: int = 3) -> torch.Tensor:
    return torch.quantize_per_tensor(values, scale, zero_point, torch.quint8)


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


def refused_message(path: Path) -> str:
    return (
        "Record.load: a Record file holds only plain data and is read with `torch.load(weights_only=True)`, got "
        f"{str(path)!r}, whose pickle it refuses (it needs code to load, or is damaged). Load only files written by "
        "`Record.save`; use `torch.load(..., weights_only=False)` only on a file from a source you trust."
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
    if problem.startswith("a set") and torch.__version__ < (2, 5):  # its `weights_only` loader refuses sets
        assert load_error(path) == refused_message(path)
    else:
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
    assert load_error(path) == refused_message(path)
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
    if torch.__version__ < (2, 5):  # its `weights_only` loader cannot read jagged tensors: save refuses them
        with pytest.raises(TypeError, match="must load with `torch.load"):
            fh.Record({"m": {"jagged": (kinds.pop("jagged"),)}}).save(tmp_path / "jagged.pt")
        assert not os.listdir(tmp_path)
    rec = fh.Record({"m": {name: (t,) for name, t in kinds.items()}})
    rec.save(tmp_path / "rec.pt")
    back = fh.Record.load(tmp_path / "rec.pt")
    assert back.equal(rec)
    assert {name: back["m"][name].layout for name in ("coo", "csr")} == {"coo": torch.sparse_coo, "csr": torch.sparse_csr}
    assert back["m"]["meta"].is_meta and back["m"]["quantized"].is_quantized
    assert all(back["m"][name].is_nested for name in ("nested", "jagged") if name in kinds)
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
    assert load_error(path) == refused_message(path)
