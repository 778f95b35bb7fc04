"""The benchmark scripts still run: each one in its smoke mode (``--quick``).

These tests make no timing claim. They check that a script exits cleanly, writes its JSON
with the expected keys, and that its correctness check (done before any timing) passed.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

from bench_kit import BENCHMARKS, SMOKE_TIMEOUT_S, assert_common_keys, run_quick
from helpers import RECORDS_IN_COMPILE


def test_capture_smoke(tmp_path: pathlib.Path) -> None:
    """bench_capture runs every case on both models, all equal to the bare forward and hand hooks."""
    proc, result = run_quick("bench_capture.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "capture")
    assert result["correct"] is True
    for model in ("deep-narrow", "cnn"):
        cases = result["results"][model]["cases"]
        assert {"bare", "fh.with_hooks", "floor: one-line forward wrappers", "hand hooks, registered once",
                "hand hooks, per call"} <= set(cases)
        assert all(set(c) == {"seconds", "ratio", "calls_per_round"} for c in cases.values())
        assert all({"median", "p25", "p75"} == set(c["ratio"]) for c in cases.values())
        assert cases["bare"]["ratio"]["median"] == 1.0
    sparse = result["results"]["deep-narrow, 3 modules"]["cases"]
    assert set(sparse) == {"bare", "fh.with_hooks", "fh.capture", "hand hooks, per call"}


def test_capture_breakdown_smoke(tmp_path: pathlib.Path) -> None:
    """bench_capture --breakdown splits a with_hooks call into its four parts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_capture.py"), "--quick", "--breakdown", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "capture-breakdown.json").read_text())
    assert result["benchmark"] == "capture-breakdown"
    parts = list(result["parts_seconds"])
    assert parts[0] == "the bare forward" and parts[-1] == "building the Record" and len(parts) == 4
    assert result["parts_seconds"]["the bare forward"] > 0


def test_memory_smoke(tmp_path: pathlib.Path) -> None:
    """bench_memory finds no copies with `detach` and `cpu` on the CPU, and only copies with `clone`."""
    proc, result = run_quick("bench_memory.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "memory")
    assert result["correct"] is True
    for model in ("deep-narrow", "cnn"):
        variants = result["results"][model]
        assert variants["detach=True (default)"]["copied_bytes"] == 0
        assert variants["clone=True"]["copied_bytes"] == variants["clone=True"]["stored_bytes"] > 0


def test_vmap_smoke(tmp_path: pathlib.Path) -> None:
    """bench_vmap's vmapped Record equals the stacked per-example Records (or it says it skipped)."""
    proc, result = run_quick("bench_vmap.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "vmap")
    if "skipped" in result:
        assert "capture" in result["skipped"]
        return
    assert result["correct"] is True
    assert {"loop", "vmap"} == set(result["results"]["deep-narrow"]["cases"])


@RECORDS_IN_COMPILE
def test_compile_smoke(tmp_path: pathlib.Path) -> None:
    """bench_compile's hooked compiled model records what the eager one does and leaves no hooks."""
    proc, result = run_quick("bench_compile.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "compile")
    assert result["backend"] == "eager"
    assert {"compiled bare", "eager bare"} <= set(result["results"]["deep-narrow"]["cases"])
    assert not result["failures"]
    assert result["correct"] is True


def test_store_smoke(tmp_path: pathlib.Path) -> None:
    """bench_store's cases all read back what they wrote; it reports write, read and memory results."""
    proc, result = run_quick("bench_store.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "store")
    assert result["correct"] is True
    write = result["results"]["write"]
    assert {"torch.save per batch", "save_file per batch", "fh.ActivationWriter", "fh.ActivationWriter, fsync=True"} <= set(write)
    assert all(set(c) == {"MB/s", "ratio_to_faster_plain_loop"} for c in write.values())
    assert set(result["results"]["read"]) == {"ds[indices]", "DataLoader(shuffle=True)"}
    assert len(result["results"]["rss"]["sizes"]) == 2 and result["results"]["rss"]["peak_max_over_min"] >= 1.0


def test_patch_smoke(tmp_path: pathlib.Path) -> None:
    """bench_patch's vmapped sweep equals the Python loop (and every peer that imports), and
    its recorded attention patterns equal HF's `output_attentions`."""
    proc, result = run_quick("bench_patch.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "patch")
    assert result["correct"] is True
    sweep = result["results"]["sweep"]
    expected = {"python loop", "fh vmap", "hand-batched torch hooks", "fh per-row patch (one batched forward)"}
    assert expected <= set(sweep["cases"]) and sweep["speedup"] > 0
    assert sweep["cases"]["python loop"]["ratio"]["median"] == 1.0
    assert {"bare", "fh.with_hooks op_outputs(attn, softmax)", "fh.capture op_outputs(attn, softmax)"} <= set(
        result["results"]["record"]["cases"])
    assert set(result["results"]["unselected"]["cases"]) == {"mlp of block 0, bare", "mlp of block 0, inside an open op run"}


def test_atp_smoke(tmp_path: pathlib.Path) -> None:
    """bench_atp's sweep equals the loop, attribution patching correlates with it, and its
    cost is timed in forward passes with every point and with one."""
    proc, result = run_quick("bench_atp.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "atp")
    assert result["correct"] is True
    sweep = result["results"]["sweep"]
    per_row = "fh per-row patch (one batched forward)"
    assert set(sweep["cases"]) == {"python loop", "fh vmap", per_row, "fh attribution_patching"}
    assert 0 < sweep["correlation"] <= 1
    passes = result["results"]["forward_passes"]
    assert {"bare forward (corrupted)", "fh attribution_patching, 1 point"} <= set(passes["cases"])


def test_circuits_smoke(tmp_path: pathlib.Path) -> None:
    """bench_circuits' EAP agrees with the hand-written floor and is timed beside it, on two depths."""
    proc, result = run_quick("bench_circuits.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "circuits")
    assert result["correct"] is True
    for depth in ("12 layers", "4 layers"):
        timed = result["results"][depth]
        assert set(timed["cases"]) == {"bare forward (clean)", "floor: corrupted fwd + clean fwd + bwd", "fh.circuits.eap"}
        assert timed["edges"] > 0


def test_train_smoke(tmp_path: pathlib.Path) -> None:
    """bench_train's folds equal the fastai-style hooks and the hand loop; the trainer cases run."""
    proc, result = run_quick("bench_train.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "train")
    cases = result["results"]
    assert {"bare loop", "fh.fit + ActivationStats()", "fh.fit + GradientStats() + UpdateRatio()"} <= set(cases)
    assert cases["bare loop"]["ratio"]["median"] == 1.0
    trainers = result["frameworks"]["results"]
    assert {"lightning.Trainer", "transformers.Trainer"} <= set(trainers)
    assert set(result["frameworks"]["against_fit"]) == {n for n in trainers if "FoldCallback" in n}


def test_points_smoke(tmp_path: pathlib.Path) -> None:
    """bench_points' pairs record the same tensors (resid_post as the blocks' outputs, z as the
    output projections' inputs split into heads) and report points / paths for both."""
    proc, result = run_quick("bench_points.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "points")
    assert result["correct"] is True
    assert all(result["checks"].values())
    cases = result["results"]["cases"]
    assert set(cases) == {"bare", "fh.capture outputs(transformer.h.*)", "fh.capture outputs(pts.resid_post)",
                          "fh.capture inputs(h.*.attn.c_proj)", "fh.capture outputs(pts.z)"}
    assert all(set(c) == {"seconds", "ratio", "calls_per_round"} for c in cases.values())
    assert cases["bare"]["ratio"]["median"] == 1.0
    assert set(result["results"]["points_to_paths"]) == {"resid_post", "z"}
    assert all(r > 0 for r in result["results"]["points_to_paths"].values())


def test_sae_smoke(tmp_path: pathlib.Path) -> None:
    """bench_sae's splices give their hand-written hooks' logits and features, and it reports
    funhooks / hand hook for each pair."""
    proc, result = run_quick("bench_sae.py", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert_common_keys(result, "sae")
    assert result["correct"] is True
    assert set(result["results"]["splice_to_hand"]) == {"record", "ablate", "reconstruction", "output"}
    assert all(r > 0 for r in result["results"]["splice_to_hand"].values())
