"""benchmarks/gpu_check.py runs to completion without a GPU, in a dry mode that compiles
and checks every plan it would train and says what it would run and what it skips."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_the_gpu_check_dry_run_lists_every_case():
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    table = out[out.index("| case | status | detail |"):]
    for case in ("bf16", "nccl-1rank", "overlap", "memory", "step time", "nccl-pp2",
                 "nccl-dualpipev", "nccl-pp2-dp2-zero3", "nccl-pp2-dp2-ep2"):
        assert f"| {case} |" in table, case
    assert "| bf16 | would run |" in table   # compiled in bf16, trained only on a GPU
    assert "compiled and checked (NCCL check included)" in table
