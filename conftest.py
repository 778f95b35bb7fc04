"""Set before torch loads: bf16 matmuls on some CPUs die with SIGILL (exit 132) in oneDNN's
widest instruction set; AVX2 keeps the bf16 tests (autocast) running there."""

import os

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
