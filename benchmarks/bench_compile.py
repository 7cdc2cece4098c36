"""Compile time of large plans: 1F1B over S stages x M microbatches x DP replicas.

The headline case is 64 stages x 256 microbatches x DP 8 (a 64-layer MLP, 512 devices).
Prints a markdown table: DAG nodes, instructions, seconds for each phase; the gradient
check's share is the checks' time with it minus the deadlock dry run alone; the NCCL
check (`compiler/nccl.py`) is timed on its own.
Run: .venv/bin/python benchmarks/bench_compile.py [--quick]
"""

from __future__ import annotations

import gc
import sys
import time

import piper_nb as pn
from piper_nb.compiler.checks import check_collective_order, check_matching, dry_run
from piper_nb.compiler.gradflow import Flow
from piper_nb.compiler.nccl import check_nccl
from piper_nb.directives.spec import Place


def program(stages: int, micro: int, dp: int):
    out = []
    for d in pn.schedules.one_f_one_b(stages, micro, place=True):
        if isinstance(d, Place):
            devs = [r + k * stages for r in d.devices for k in range(dp)]
            out += [pn.place(d.filter, devs), pn.replicate(d.filter, devs, zero=0)]
        else:
            out.append(d)
    return out


def run(stages: int, micro: int, dp: int) -> dict:
    model = pn.models.MLP(dim=8, depth=stages)
    batch = model.example_batch(batch_size=micro * dp, seed=0)
    spec = pn.annotate(model, {f"layers.{i}": {"PP": i} for i in range(stages)})
    prog = program(stages, micro, dp)
    t0 = time.perf_counter()
    plan = pn.compile(spec, prog, batch, check=False)
    t1 = time.perf_counter()
    gc.disable()  # as pn.compile does around its own checks
    try:
        check_matching(plan)
        check_collective_order(plan)
        t2 = time.perf_counter()
        flow = Flow(plan)
        dry_run(plan, runs=flow.active)   # the deadlock dry run alone (one device per replicas)
        t3 = time.perf_counter()
        dry_run(plan, Flow(plan))         # the same, replaying gradients (what check_plan runs)
        t4 = time.perf_counter()
        check_nccl(plan)                  # NCCL's in-order streams
        t5 = time.perf_counter()
    finally:
        gc.enable()
    grads = max(0.0, (t4 - t3) - (t3 - t2))
    check = (t2 - t1) + (t5 - t3)
    return {"stages": stages, "micro": micro, "dp": dp, "devices": plan.world,
            "nodes": len(plan.dag.nodes), "instrs": sum(len(d.instrs) for d in plan.devices),
            "compile_s": t1 - t0, "check_s": check, "grads_s": grads, "nccl_s": t5 - t4,
            "total_s": t1 - t0 + check}


def main() -> None:
    quick = "--quick" in sys.argv
    cases = [(8, 32, 2), (16, 64, 2), (32, 128, 4), (64, 256, 8)]
    if quick:
        cases = cases[:2]
    print("| stages | microbatches | DP | devices | DAG nodes | instructions | compile s | "
          "checks s | of which gradient check s (% of compile) | of which NCCL check s | "
          "total s | us / instruction |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s, m, dp in cases:
        r = run(s, m, dp)
        per = 1e6 * r["total_s"] / r["instrs"]
        print(f"| {s} | {m} | {dp} | {r['devices']} | {r['nodes']} | {r['instrs']} | "
              f"{r['compile_s']:.2f} | {r['check_s']:.2f} | {r['grads_s']:.2f} "
              f"({100 * r['grads_s'] / r['compile_s']:.0f}%) | {r['nccl_s']:.2f} | "
              f"{r['total_s']:.2f} | {per:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
