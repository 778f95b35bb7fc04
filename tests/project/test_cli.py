"""The ``funhooks`` command line.

The cases a user meets first (success, unknown module or attribute, a factory that raises, an
input size the model rejects) run as a user runs them, in subprocesses, concurrently (each
pays Python's and torch's start-up once); then each test checks one case's exit status and
its single line on stderr. The remaining paths call ``main`` in process.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from funhooks.cli import main

TIMEOUT_S = 180
MODELS = textwrap.dedent(
    """
    from torch import nn

    def cnn():
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 10))

    def broken():
        raise ValueError("no weights here\\nsecond line")

    def not_a_model():
        return 3

    instance = nn.Sequential(nn.Embedding(100, 16), nn.Linear(16, 2))

    def tiny_bert():
        import transformers

        cfg = transformers.BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                      intermediate_size=32, max_position_embeddings=16)
        return transformers.BertModel(cfg)
    """
)

CASES = {  # run in subprocesses: what a user sees, exit status and stderr included
    "ok": ["summary", "fh_cli_models:cnn", "--input-size", "2", "3", "4", "4"],
    "unknown_module": ["summary", "no_such_module_xyz:cnn", "--input-size", "1"],
    "unknown_attribute": ["summary", "fh_cli_models:cnnn", "--input-size", "1"],
    "factory_raises": ["summary", "fh_cli_models:broken", "--input-size", "1"],
    "rejected_size": ["summary", "fh_cli_models:cnn", "--input-size", "1", "5", "4", "4"],
    "demo": ["demo", "--out", "demo-out", "--fast"],
}
SCRIPT_CASES = {"unknown_attribute"}  # run with the installed console script, not `python -m`


def write_models(directory: Path) -> None:
    (directory / "fh_cli_models.py").write_text(MODELS)
    (directory / "fh_cli_bad_import.py").write_text("import no_such_dependency_xyz\n")


@pytest.fixture(scope="module")
def cli_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The working directory of the subprocess cases."""
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def results(cli_dir: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """Every case of CASES run with ``python -m funhooks`` (or the script) beside fh_cli_models.py."""
    cwd = cli_dir
    write_models(cwd)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(sys.executable).parent / "funhooks"

    def run(name: str) -> subprocess.CompletedProcess[str]:
        command = [str(script)] if name in SCRIPT_CASES and script.exists() else [sys.executable, "-m", "funhooks"]
        return subprocess.run([*command, *CASES[name]], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        futures = {name: pool.submit(run, name) for name in CASES}
        return {name: f.result() for name, f in futures.items()}


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The case failed with `code`, printing one line on stderr, nothing on stdout, no traceback."""
    assert result.returncode == code, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_summary_prints_the_table(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """`funhooks summary models:cnn --input-size 2 3 4 4` prints the table with shapes and totals."""
    result = results["ok"]
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "Sequential (Input shape: ['2 x 3 x 4 x 4'])"
    assert lines[4].split() == ["Conv2d", "2", "x", "8", "x", "4", "x", "4", "224", "True"]
    assert "Total params: 1,514" in lines


def test_unknown_module(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """A module that cannot be found is named in one line, exit status 1."""
    assert one_line_error(results["unknown_module"], 1) == (
        "funhooks summary: no module named 'no_such_module_xyz' (looked in the current directory and "
        "sys.path), got target 'no_such_module_xyz:cnn'. Check the spelling or install the package."
    )


def test_unknown_attribute(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """A missing factory is named, with the module's public names."""
    assert one_line_error(results["unknown_attribute"], 1) == (
        "funhooks summary: 'fh_cli_models' has no attribute 'cnnn', got target 'fh_cli_models:cnnn'. "
        "Public names there: ['broken', 'cnn', 'instance', 'nn', 'not_a_model', 'tiny_bert']."
    )


def test_factory_that_raises(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """A factory's exception is reported by type and first line."""
    assert one_line_error(results["factory_raises"], 1) == (
        "funhooks summary: the factory 'fh_cli_models:broken' raised ValueError: no weights here. Fix the factory."
    )


def test_input_size_the_model_rejects(results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    """An input size the model rejects names the size and the model's own error."""
    line = one_line_error(results["rejected_size"], 1)
    assert line.startswith("funhooks summary: Sequential rejected an input of size (1, 5, 4, 4): RuntimeError: ")
    assert "3 channels" in line and line.endswith("Pass the size the model expects with `--input-size` or `--kwarg`.")


def test_demo_fast_mode_writes_the_plots(results: dict[str, subprocess.CompletedProcess[str]], cli_dir: Path) -> None:
    """`funhooks demo --fast` trains, prints the summary and the stats (activations, gradients,
    update ratios, dead units), and writes six readable PNGs."""
    result = results["demo"]
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    out = result.stdout
    assert "Total params: 23,946" in out and "1 epoch(s) of 4 steps" in out
    assert "Validation accuracy:" in out and "near zero" in out
    assert "grad norm" in out and "log10 update ratio" in out and "Dead units, last step" in out
    folder = (cli_dir / "demo-out").resolve()
    assert f"Plots written to {folder}:" in out
    for name in ("layer_stats.png", "color_dim.png", "loss.png", "gradients.png", "update_ratio.png", "dead_units.png"):
        data = (folder / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name
        assert name in out


# -- in process: main() itself, for the paths argparse or the import machinery decide ------------------


@pytest.fixture
def in_models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory holds the test models; sys.path and sys.modules are restored after."""
    write_models(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("fh_cli_models", "fh_cli_bad_import"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return tmp_path


def run_main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_json_with_integer_inputs(in_models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--json` prints the plain data form; `--dtype int64` feeds an Embedding model."""
    code, out, err = run_main(["summary", "fh_cli_models:instance", "--input-size", "5", "7", "--dtype", "int64",
                               "--json"], capsys)
    assert (code, err) == (0, "")
    data = json.loads(out)
    assert data["input_shapes"] == [[5, 7]] and data["total"] == 100 * 16 + 16 * 2 + 2
    assert [r["shape"] for r in data["rows"]] == [[5, 7, 16], [5, 7, 2]]


def test_summary_with_keyword_inputs_and_depth(in_models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--kwarg NAME:DTYPE N...` feeds a Hugging Face model its keyword inputs; `--depth 1` lists
    the model and its children in the full table."""
    code, out, err = run_main(["summary", "fh_cli_models:tiny_bert", "--kwarg", "input_ids:int64", "2", "8",
                               "--kwarg", "attention_mask:int64", "2", "8", "--depth", "1"], capsys)
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == "BertModel (Input shape: ['input_ids: 2 x 8', 'attention_mask: 2 x 8'])"
    assert lines[2].split()[:4] == ["Layer", "(type)", "Input", "Shape"]
    assert [line.split()[0] for line in lines[5:8]] == ["embeddings", "encoder", "pooler"]
    assert lines[5].split()[2:6] == ["--", "[2,", "8,", "16]"]
    assert any(line.startswith("Total MACs: ") for line in lines)


def test_summary_layout_and_json(in_models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--layout full` prints the full table for positional inputs; with `--json` the layers,
    FLOPs and memory estimates come as data."""
    args = ["summary", "fh_cli_models:cnn", "--input-size", "2", "3", "4", "4", "--layout", "full"]
    code, out, _ = run_main(args, capsys)
    assert code == 0 and out.splitlines()[5].split()[:2] == ["0", "(Conv2d)"]
    code, out, _ = run_main([*args, "--json"], capsys)
    data = json.loads(out)
    assert [r["path"] for r in data["layers"]] == ["", "0", "1", "2", "3"]
    assert data["flops"] == 2 * (2 * 16 * 8 * 27 + 2 * 128 * 10) and data["param_bytes"] == 4 * 1514


def test_summary_help_documents_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`funhooks summary --help` explains --kwarg, --depth and --layout with an example."""
    code, out, _ = run_main(["summary", "--help"], capsys)
    text = " ".join(out.split())
    assert code == 0
    for words in ("--kwarg NAME[:DTYPE] N", "--depth N", "--layout {fastai,full}", "--kwarg input_ids:int64 2 16",
                  "implies --layout full"):
        assert words in text, words


def test_summary_of_a_python_file(in_models_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The target may be a .py file path instead of a module name."""
    code, out, _ = run_main(["summary", "fh_cli_models.py:cnn", "--input-size", "1", "3", "4", "4"], capsys)
    assert code == 0 and "Total params: 1,514" in out.splitlines()


@pytest.mark.parametrize(
    ("args", "code", "expected"),
    [
        (["summary", "fh_cli_models:not_a_model", "--input-size", "1"], 1,
         "funhooks summary: the factory 'fh_cli_models:not_a_model' returns an nn.Module, got int. Return the model."),
        (["summary", "fh_cli_bad_import:cnn", "--input-size", "1"], 1,
         "funhooks summary: importing 'fh_cli_bad_import' raised ModuleNotFoundError: No module named "
         "'no_such_dependency_xyz'. Fix that module."),
        (["summary", "missing.py:cnn", "--input-size", "1"], 1,
         "funhooks summary: the file 'missing.py' does not exist. Check the path."),
        (["summary", "fh_cli_models", "--input-size", "1"], 2,
         "funhooks summary: argument MODULE:FACTORY: the target is `MODULE:FACTORY`, got 'fh_cli_models'; "
         "write e.g. `mypkg.models:make_model`. Run `funhooks summary --help` for usage."),
        (["summary", "fh_cli_models:cnn"], 2,
         "funhooks summary: an input is required: pass `--input-size N [N ...]` or `--kwarg NAME N [N ...]`. "
         "Run `funhooks summary --help` for usage."),
        (["summary", "fh_cli_models:cnn", "--kwarg", "input ids", "2"], 2,
         "funhooks summary: argument --kwarg: takes `NAME[:DTYPE] N [N ...]` (DTYPE one of float32, float64, "
         "float16, bfloat16, int64), got 'input ids 2'; write e.g. `--kwarg input_ids:int64 2 16`. "
         "Run `funhooks summary --help` for usage."),
        (["summary", "fh_cli_models:cnn", "--kwarg", "x:int32", "2"], 2,
         "funhooks summary: argument --kwarg: takes `NAME[:DTYPE] N [N ...]` (DTYPE one of float32, float64, "
         "float16, bfloat16, int64), got 'x:int32 2'; write e.g. `--kwarg input_ids:int64 2 16`. "
         "Run `funhooks summary --help` for usage."),
        (["summary", "fh_cli_models:cnn", "--kwarg", "x", "2", "0"], 2,
         "funhooks summary: argument --kwarg: `--kwarg` takes positive integers, got '0'. "
         "Run `funhooks summary --help` for usage."),
        (["summary", "fh_cli_models:cnn", "--input-size", "1", "3", "4", "4", "--depth", "-1"], 2,
         "funhooks summary: argument --depth: `--depth` takes an integer >= 0, got '-1'. "
         "Run `funhooks summary --help` for usage."),
        (["summary", "fh_cli_models:cnn", "--input-size", "1", "-3"], 2,
         "funhooks summary: argument --input-size: `--input-size` takes positive integers, got '-3'. "
         "Run `funhooks summary --help` for usage."),
        ([], 2, "funhooks: the following arguments are required: command. Run `funhooks --help` for usage."),
    ],
)
def test_bad_arguments_give_one_line(in_models_dir: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                     code: int, expected: str) -> None:
    """Each bad argument gives exactly its one-line message and exit status (1: failed, 2: usage)."""
    assert run_main(args, capsys) == (code, "", expected + "\n")


def test_demo_with_an_unwritable_out_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`funhooks demo --out` under a file fails at once, in one line, before any training."""
    (tmp_path / "a_file").write_text("")
    code, out, err = run_main(["demo", "--out", str(tmp_path / "a_file" / "plots"), "--fast"], capsys)
    assert (code, out) == (1, "")
    assert err.startswith(f"funhooks demo: cannot write the plots into '{tmp_path / 'a_file' / 'plots'}': "
                          "NotADirectoryError: ")
    assert err.endswith("Pass a writable `--out`.\n") and err.count("\n") == 1
