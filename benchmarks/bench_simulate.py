"""Benchmark: compile + simulate time for large plans, and how it grows.

The headline row is a 1024-device plan: PP 16 x DP 64, 1F1B, 64 microbatches, ZeRO-1,
an MLP of 16 layers (one per stage), simulated with unit costs (F=1, B=2, 0.1 per
message; the toy model is too small for FLOP-based costs to show a pipeline).
Two sweeps show the growth with devices (DP 1..64 at 64 microbatches) and with
microbatches (PP 16 x DP 16). Compile time is split into lowering (`pn.compile` without
checks) and the static checks (`check_plan`, the lockstep dry run). Prints a markdown
table; `--quick` leaves out the 1024-device row.

    .venv/bin/python benchmarks/bench_simulate.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import time

import piper_nb as pn
from piper_nb.compiler.checks import check_plan
from piper_nb.sim import CostModel, simulate

__all__ = ["build_program", "run"]


def build_program(pp: int, dp: int, microbatches: int, zero: int = 1) -> list:
    program = [*pn.schedules.one_f_one_b(ranks=pp, microbatches=microbatches, place=False)]
    for s in range(pp):
        devices = [s + pp * k for k in range(dp)]
        program += [pn.place({"PP": s}, devices=devices),
                    pn.replicate({"PP": s}, devices=devices, zero=zero)]
    return program


def run(pp: int, dp: int, microbatches: int) -> dict:
    gc.collect()  # each row starts from a clean heap
    model = pn.models.MLP(dim=8, depth=16)
    spec = pn.annotate(model, pn.cut_stages(model, pp))
    batch = model.example_batch(batch_size=microbatches * dp, seed=0)
    t0 = time.perf_counter()
    plan = pn.compile(spec, build_program(pp, dp, microbatches), batch, check=False)
    t1 = time.perf_counter()
    check_plan(plan)
    t2 = time.perf_counter()
    cost = CostModel.uniform(F=1, B=2, W=1, comm=0.1)
    t3 = time.perf_counter()
    trace = simulate(plan, cost)
    t4 = time.perf_counter()
    return {"devices": pp * dp, "pp x dp": f"{pp} x {dp}", "microbatches": microbatches,
            "instructions": sum(len(d.instrs) for d in plan.devices),
            "events": len(trace.events), "lower s": t1 - t0, "check s": t2 - t1,
            "simulate s": t4 - t3, "total s": t4 - t0,
            "step (units)": trace.step_time, "bubble": trace.bubble_fraction()}


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.2f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out the 1024-device row")
    args = ap.parse_args()
    growth = [(16, 1, 64), (16, 4, 64), (16, 16, 64)] + ([] if args.quick else [(16, 64, 64)])
    micro = [(16, 16, 16), (16, 16, 32), (16, 16, 128)]
    rows = []
    for pp, dp, m in growth + micro:
        rows.append(run(pp, dp, m))
        print(f"done {pp}x{dp}, {m} microbatches: {rows[-1]['total s']:.1f} s", flush=True)
    print("\n## compile + simulate, 1F1B, ZeRO-1, MLP 16 layers, unit costs\n")
    print(table(sorted(rows, key=lambda r: (r["microbatches"] != 64, r["devices"],
                                            r["microbatches"]))))


if __name__ == "__main__":
    main()
