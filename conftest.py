"""Set before torch loads: bf16 matmuls on some CPUs die with SIGILL (exit 132) in oneDNN's
widest instruction set; AVX2 keeps the bf16 tests (autocast) running there.

The integrations import their framework when imported (a missing one is an ExtraError), so
without their extra installed their doctests are not collected."""

import importlib.util
import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

_NEEDS = (("funhooks/integrations/lightning.py", ("lightning",)),
          ("funhooks/integrations/hf.py", ("transformers", "accelerate")),
          ("docs/trainers.md", ("lightning", "transformers", "accelerate")))
collect_ignore = [path for path, needs in _NEEDS if any(importlib.util.find_spec(n) is None for n in needs)]

import pytest  # noqa: E402
import torch  # noqa: E402

_OLDER_TORCH_WARNINGS = (
    # torch before 2.13: dynamo reads `.grad` of the non-leaf tensors it traces through pytrees
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor is being accessed:UserWarning",
    # torch 2.11-2.12: its own notice on building any sparse tensor
    "ignore:Sparse invariant checks are implicitly disabled:UserWarning",
    # torch 2.6: inductor's own notice when it caches a compiled graph
    "ignore:Skipping serialization of skipfiles_inline_module_allowlist:UserWarning",
    # torch 2.4: activation checkpointing's own use of its deprecated CPU autocast API
    r"ignore:`torch.cpu.amp.autocast\(args...\)` is deprecated:FutureWarning",
)
"""Warnings that older torch releases raise from their own code (the suite turns warnings into
errors); on torch 2.13, which CI runs, none of them is ignored."""


def pytest_collection_modifyitems(items: list) -> None:
    if torch.__version__ < (2, 13):
        for item in items:
            for spec in _OLDER_TORCH_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test and doctest starts from torch's seed 0: what it draws does not depend on
    which tests ran before it in its process (pytest-xdist hands the files to two processes in
    an order that changes from run to run)."""
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _denormals_back_on():
    """torch before 2.5 compiles inductor's CPU kernels with -ffast-math, and loading one turns on
    flush-to-zero for the process, which later tests (Hypothesis's subnormal floats) trip on:
    turn it off again after each test there."""
    yield
    if torch.__version__ < (2, 5):
        torch.set_flush_denormal(False)
