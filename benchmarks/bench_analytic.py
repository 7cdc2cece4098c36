"""The analytic model (`pn.CostModel.analytic`, per operator) against the GPU figures this
project measured, with the shipped constants and nothing else.

The figures are one H200's, from `gpu_check.py` (benchmarks/RESULTS.md, "On a GPU"):

- a 8192^3 bf16 matmul at 788 TFLOP/s (CUDA events, 50 repeats);
- the mid-size GPT (`gpu_check.mid_gpt`: TinyGPT 8 x 1024, sequence 1024, fp32, AdamW,
  4 microbatches on one rank): a median step of 150.4 ms;
- the 0.5 B Llama-shaped model (`gpu_check.llama`: bf16, AdamW, 2 microbatches on one
  rank): a median step 1.44 times the 53.8 ms the FLOPs-over-peak model of the time
  predicted for it, 77.5 ms;
- the same model in a plain PyTorch loop, `torch.compile`d: 0.81 of its eager step (the
  same session, by hand), against the model's `compiled=True` over its eager prediction.

Each plan is compiled on the meta device (the same instructions as on CPU; attention is
priced as the kernel a GPU runs either way) and simulated; the ratio is measured /
predicted. The matmul's efficiency is a constant of
the model taken from the first figure (`sim.gpus`), so its row checks the pricing, not the
constant; the two steps are predictions. A step's measured / predicted above 1, or a
rate's below 1, means the model is optimistic. `gpu_check.py` prints the same ratios for every
row it times, so a later GPU run extends this table.

Run: .venv/bin/python benchmarks/bench_analytic.py
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_check  # noqa: E402

import piper_nb as pn  # noqa: E402
from piper_nb.sim.op_counts import OpCounter  # noqa: E402
from piper_nb.sim.roofline import pass_time  # noqa: E402

MEASURED = {"matmul TFLOP/s": 788.0, "gpt-mid step ms": 150.4, "llama-0.5b step ms": 1.44 * 53.8,
            "llama-0.5b compiled / eager step": 0.81}


def matmul_rate(n: int = 8192) -> float:
    """TFLOP/s the model predicts for one n^3 bf16 matmul on an H200."""
    with OpCounter() as c:
        a = torch.empty(n, n, dtype=torch.bfloat16, device="meta")
        a @ a
    return 2 * n**3 / pass_time(c.tallies(), pn.sim.HARDWARE["H200"]) / 1e12


def step_ms(build, compiled: bool = False) -> tuple[float, float]:
    """(predicted step ms on an H200, seconds to price it) of a gpu_check plan on meta."""
    _, _, plan = build("meta")
    t0 = time.perf_counter()
    cost = pn.CostModel.analytic(plan, "H200", compiled=compiled)
    priced = time.perf_counter() - t0
    return pn.simulate(plan, cost).step_time * 1e3, priced


def compiled_over_eager(build) -> tuple[float, float]:
    (eager, _), (fused, priced) = step_ms(build), step_ms(build, compiled=True)
    return fused / eager, priced


def main() -> None:
    rows = {"matmul TFLOP/s": (matmul_rate(), 0.0),
            "gpt-mid step ms": step_ms(gpu_check.mid_gpt),
            "llama-0.5b step ms": step_ms(gpu_check.llama),
            "llama-0.5b compiled / eager step": compiled_over_eager(gpu_check.llama)}
    out = []
    for what, (predicted, priced) in rows.items():
        measured = MEASURED[what]
        digits = 1 if measured >= 10 else 3
        out.append({"what": what, "measured": round(measured, digits),
                    "predicted": round(predicted, digits),
                    "measured / predicted": round(measured / predicted, 3),
                    "priced in s": round(priced, 2)})
    print(json.dumps(out, indent=1))
    print("| on one H200 | measured | predicted | measured / predicted |")
    print("|---|---|---|---|")
    for o in out:
        print(f"| {o['what']} | {o['measured']} | {o['predicted']} | "
              f"{o['measured / predicted']} |")


if __name__ == "__main__":
    main()
