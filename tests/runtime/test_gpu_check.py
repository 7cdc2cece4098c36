"""benchmarks/gpu_check.py runs to completion without a GPU, in a dry mode that compiles and
checks every plan it would train, lists every probe with what it would do, gives the
multi-rank plans their static / emulated status, and says what one GPU cannot show."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
PROBES = ("nccl-collectives", "stream-coupling", "stream-coupling-old", "cpu-tensor",
          "tinygpt-fp32", "tinygpt-bf16", "tinygpt-float8", "hf-llama", "matmul-bf16", "matmul-fp32",
          "hbm-stream", "matmul-fp8", "gpt-mid step",
          "gpt-mid memory", "llama-0.5b vs torch", "llama-0.5b step", "llama-0.5b memory",
          "llama-0.5b compiled vs torch")
MULTI_RANK = ("nccl-pp2", "nccl-dualpipev", "nccl-pp2-dp2-zero3", "nccl-pp2-dp2-ep2")
TRAINED = ("cpu-tensor", "tinygpt-fp32", "tinygpt-bf16", "tinygpt-float8", "hf-llama",
           "gpt-mid step", "gpt-mid memory", "llama-0.5b vs torch", "llama-0.5b step", "llama-0.5b memory",
           "llama-0.5b compiled vs torch")


def _table(out: str) -> dict[str, tuple[str, str]]:
    """case -> (status, detail), from the markdown table the check prints."""
    table = out[out.index("| case | status | detail |"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        case, status, detail = (cell.strip() for cell in line.strip().strip("|").split(" | ", 2))
        rows[case] = (status, detail)
    return rows


def test_the_gpu_check_dry_run_lists_every_probe_and_what_one_gpu_cannot_show():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _table(proc.stdout)
    assert set(rows) == set(PROBES) | set(MULTI_RANK)
    for case in PROBES:
        assert rows[case][0] == "would run", (case, rows[case])
    for case in TRAINED:   # its plan compiled, and so checked, on CPU
        assert rows[case][1].endswith("compiled and checked (NCCL check included)"), case
    for case in MULTI_RANK:
        status, detail = rows[case]
        assert status == "static + emulated", case
        assert "compiler.nccl.check_nccl" in detail and "nccl-emulated" in detail, case
        assert "two ranks on one GPU" in detail, case
    note = proc.stdout[proc.stdout.index("What one GPU cannot show"):]
    assert "NCCL refuses two ranks on one GPU" in note and "Duplicate GPU detected" in note
    assert "nccl-emulated" in note and "check_nccl" in note
    # the hand-written stream programs the coupling probes launch, old coupling included
    assert "nccl:group:0#b: wait(i2)" in proc.stdout
    assert "shared: wait(c1) rec(i1) wait(d1) wait(c2) rec(i2) wait(d2)" in proc.stdout
    # the bf16 Llama-shaped rows: what each compares, on a model of at least 0.3 B parameters
    llama = {case: rows[f"llama-0.5b {case}"][1] for case in ("vs torch", "step", "memory")}
    assert "plain PyTorch loop" in llama["vs torch"] and "bf16 autocast" in llama["vs torch"]
    assert "bf16, 2 microbatches, AdamW, 1 rank on NCCL" in llama["vs torch"]
    assert "CostModel.analytic(plan, 'H200')" in llama["step"]
    assert "max_memory_allocated" in llama["memory"] and "for_cuda(nccl=False)" in llama["memory"]
    compiled = rows["llama-0.5b compiled vs torch"][1]   # issue 60: both under torch.compile
    assert "pn.compile_regions" in compiled and "plain loop under torch.compile" in compiled
    params = re.search(r"llama-0\.5b \(([\d.]+) B parameters\), compiled on the meta", proc.stdout)
    assert params and float(params[1]) >= 0.3, proc.stdout
