"""Run the differential fuzzer: `make fuzz` (500 cases), or one case to replay a failure.

    .venv/bin/python tests/fuzz/run.py [--cases 500] [--start 0] [--comm nccl-emulated]
    .venv/bin/python tests/fuzz/run.py --seed 1234
    .venv/bin/python tests/fuzz/run.py --seeds 4,14,19

`--comm nccl-emulated` runs every case under NCCL's semantics on CPU and checks that each
device ran exactly its stream program (`make fuzz COMM=nccl-emulated`).

Cases are drawn from consecutive seeds (see `cases.py`); two local clusters (2 and 4
workers) run them all. Prints one line per case and a summary: how many, how long, how
they ended, and the mix of schedules, ZeRO levels and model features drawn.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from cases import check, draw  # noqa: E402

import piper_nb as pn  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, help="replay this one case")
    ap.add_argument("--seeds", help="replay these cases (comma-separated seeds)")
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--comm", default="native", choices=["native", "nccl-emulated"],
                    help="the clusters' communication (default: %(default)s)")
    args = ap.parse_args()
    seeds = ([args.seed] if args.seed is not None else
             [int(s) for s in args.seeds.split(",")] if args.seeds else
             range(args.start, args.start + args.cases))
    torch.set_num_threads(1)
    clusters: dict[int, pn.LocalCluster] = {}
    failed, mix, t0 = [], collections.Counter(), time.perf_counter()
    try:
        for seed in seeds:
            case = draw(seed)
            size = 2 if case.world <= 2 else 4
            if size not in clusters:
                clusters[size] = pn.LocalCluster(size, comm=args.comm).start()
            start = time.perf_counter()
            try:
                what = check(case, clusters[size], streams=args.comm == "nccl-emulated")
                status = "ok"
            except AssertionError as err:
                failed.append(case)
                what, status = str(err), "FAILED"
            mix.update([case.schedule, f"zero{case.zero}", f"dp{case.dp}"])
            mix.update(k for k, v in [("skips", case.spec.skips), ("ties", case.spec.ties),
                                      ("frozen", case.spec.frozen), ("batchnorm", case.spec.norms),
                                      ("shared", case.spec.shared), ("dropout", case.spec.dropout),
                                      ("recompute", case.recompute),
                                      ("functions", case.spec.functions),
                                      ("eval", case.spec.eval_stages or case.spec.eval_dropout),
                                      ("lengths", len(set(case.lengths)) > 1),
                                      ("global-loss", case.global_loss),
                                      ("tp2", case.tp == 2), ("tp4", case.tp == 4),
                                      ("sp", case.sp), ("attention", case.spec.attns),
                                      ("selective", case.selective),
                                      ("float8", case.float8),
                                      ("tp-recompute-units", case.units),
                                      ("sp-regather", case.regathers),
                                      ("vocab-parallel-loss", case.spec.classes),
                                      ("cp2", case.cp > 1), ("cp2-tp2", case.cp > 1
                                                               and case.tp > 1),
                                      ("cp2-p2p", case.cp > 1 and case.rotate == "p2p"),
                                      ("compiled", case.compiled),
                                      (f"grad-sync-{case.grad_sync}", case.grad_sync)]
                       if v)
            print(f"[{status} {time.perf_counter() - start:5.2f}s] {case.line()}"
                  + ("" if status == "ok" else f"\n{what}"), flush=True)
    finally:
        for c in clusters.values():
            c.close()
    total = time.perf_counter() - t0
    n = len(list(seeds))
    print(f"\n{n} cases, {n - len(failed)} equal, {len(failed)} failed, {total:.0f} s "
          f"({total / max(n, 1):.2f} s per case)")
    print("drawn: " + ", ".join(f"{k} {v}" for k, v in sorted(mix.items())))
    for case in failed:
        print(f"replay: {case.replay()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
