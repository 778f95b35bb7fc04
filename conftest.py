"""Set before torch loads: bf16 matmuls on some CPUs die with SIGILL (exit 132) in oneDNN's
widest instruction set; AVX2 keeps the bf16 tests (autocast) running there.

The integrations import their framework when imported (a missing one is an ExtraError), so
without their extra installed their doctests are not collected."""

import importlib.util
import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

collect_ignore = [path for path, needs in (("funhooks/lightning.py", "lightning"), ("funhooks/hf.py", "accelerate"))
                  if importlib.util.find_spec(needs) is None]
