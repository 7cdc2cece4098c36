"""How many communicators a plan needs, and how many world-wide calls make them.

Under NCCL with `device_id` (eager init), every `dist.new_group` is a split of the world in
which every rank takes part, members or not: one call per communicator. The runtime makes
them per *family* of disjoint communicators instead (`plan.streams.families`: one
`dist.split_group` each, `runtime.comm`). This prints, for the 16,384-device plan of
`bench_scale.py` (a 64-layer GPT on the meta device, PP 64 x DP 256, 1F1B, ZeRO-1) and for
smaller ones, the communicators (collective groups and directions of pairs), the families,
and the world-wide calls each way.

    .venv/bin/python benchmarks/bench_groups.py              # PP 64 x DP 256 and smaller
    .venv/bin/python benchmarks/bench_groups.py --pp 8 --dp 32
"""

from __future__ import annotations

import argparse
import time

import piper_nb as pn
from piper_nb.plan.streams import communicators, families

try:   # run as a script from the repository root or from benchmarks/
    from bench_scale import build
except ImportError:   # pragma: no cover
    from benchmarks.bench_scale import build


def count(pp: int, dp: int, micro: int) -> dict:
    spec, program, batch = build(pp, dp, micro)
    t0 = time.perf_counter()
    plan = pn.compile(spec, program, batch, check=False, precision="bf16")
    t1 = time.perf_counter()
    comms = communicators(plan)
    fams = families(comms)
    t2 = time.perf_counter()
    groups = sum(1 for c in comms if c.startswith("group:"))
    return {"pp": pp, "dp": dp, "devices": plan.world, "communicators": len(comms),
            "groups": groups, "directions": len(comms) - groups, "families": len(fams),
            "compile_s": t1 - t0, "count_s": t2 - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int)
    ap.add_argument("--dp", type=int)
    ap.add_argument("--micro", type=int, default=None)
    args = ap.parse_args()
    sizes = [(args.pp, args.dp)] if args.pp else [(8, 32), (16, 64), (64, 256)]
    print("| PP x DP = devices | communicators (groups + pair directions) | families | "
          "world-wide calls: one per communicator | one per family | compile s | count s |")
    print("|---|---|---|---|---|---|---|")
    for pp, dp in sizes:
        r = count(pp, dp, args.micro or 2 * pp)
        print(f"| {pp} x {dp} = {r['devices']} | {r['communicators']} ({r['groups']} + "
              f"{r['directions']}) | {r['families']} | {r['communicators']} | {r['families']} | "
              f"{r['compile_s']:.1f} | {r['count_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
