"""Set before torch loads: bf16 matmuls on some CPUs die with SIGILL (exit 132) in oneDNN's
widest instruction set; AVX2 keeps the bf16 tests (autocast) running there.

The integrations import their framework when imported (a missing one is an ExtraError), so
without their extra installed their doctests are not collected."""

import importlib.util
import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

_NEEDS = (("funhooks/lightning.py", ("lightning",)), ("funhooks/hf.py", ("transformers", "accelerate")),
          ("docs/trainers.md", ("lightning", "transformers", "accelerate")))
collect_ignore = [path for path, needs in _NEEDS if any(importlib.util.find_spec(n) is None for n in needs)]
