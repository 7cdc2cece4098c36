"""Benchmark: start-up time and per-step dispatch overhead, IPyParallelCluster vs LocalCluster.

Both clusters run the same plan (an MLP cut into `n` pipeline stages, 1F1B over 4
microbatches; tiny, so a step is mostly dispatch). Start-up is split into starting the
engines (ipyparallel's controller and engines; LocalCluster has none) and starting the
workers (spawn, import torch, join the process group). Per step, the driver's wall time
around `cluster.step` is compared with the step time the workers measure (barrier to the
last instruction): the difference is what dispatching costs, shipping the batch, relaying
commands and gathering the answers. Medians over `--steps` steps after a warm-up. Prints a
markdown table.

    .venv/bin/python benchmarks/bench_cluster.py [--n 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import piper_nb as pn
from piper_nb.cluster.ipp import IPyParallelCluster
from piper_nb.cluster.local import LocalCluster

__all__ = ["make_plan", "measure"]


def make_plan(n: int, dim: int = 16):
    model = pn.models.MLP(dim=dim, depth=2 * n)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, n))
    program = [*[pn.place({"PP": s}, [s]) for s in range(n)],
               *pn.schedules.one_f_one_b(ranks=n, microbatches=4)]
    return pn.compile(spec, program, batch), batch


def measure(make_cluster, plan, batch, steps: int) -> dict:
    t0 = time.perf_counter()
    cluster = make_cluster()
    t1 = time.perf_counter()
    cluster.start()
    t2 = time.perf_counter()
    try:
        cluster.reset(plan, pn.optim.SGD(0.01))   # ships the plan
        t3 = time.perf_counter()
        for _ in range(10):                       # warm-up
            cluster.step(plan, batch)
        walls, inside = [], []
        for _ in range(steps):
            s = time.perf_counter()
            outs = cluster.step(plan, batch)
            walls.append(time.perf_counter() - s)
            inside.append(max(o["end"] for o in outs))
    finally:
        cluster.close()
    wall, step = statistics.median(walls), statistics.median(inside)
    return {"engines": t1 - t0, "workers": t2 - t1, "ship": t3 - t2, "wall": wall, "step": step,
            "overhead": wall - step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2, help="devices (engines / worker processes)")
    ap.add_argument("--steps", type=int, default=200, help="timed steps per cluster")
    args = ap.parse_args()
    torch.set_num_threads(1)
    plan, batch = make_plan(args.n)
    rows = [("LocalCluster", measure(lambda: LocalCluster(args.n), plan, batch, args.steps)),
            ("IPyParallelCluster", measure(lambda: IPyParallelCluster(args.n), plan, batch, args.steps))]
    print(f"\n{args.n} devices, MLP {2 * args.n}x16 in {args.n} stages, 1F1B x 4 microbatches, "
          f"median of {args.steps} steps\n")
    print("| cluster | engines up (s) | workers up (s) | ship plan (ms) | step wall (ms) "
          "| step on workers (ms) | dispatch overhead (ms) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['engines']:.2f} | {r['workers']:.2f} | {r['ship'] * 1e3:.1f} "
              f"| {r['wall'] * 1e3:.2f} | {r['step'] * 1e3:.2f} | {r['overhead'] * 1e3:.2f} |")


if __name__ == "__main__":
    main()
