"""Benchmark: `pn.LocalCluster` with workers pinned to cores against the same cluster unpinned.

For each 2-rank strategy of the runtime's matrix (`piper_nb.strategies`, size `bench`), one
`LocalCluster(2, pin=True)` and one `LocalCluster(2, pin=False)` stay up side by side and
step the same plan in interleaved rounds (pinned first, then unpinned first, ...), as
`pn.train` steps it (SGD, memory not traced). Reports the median and the 90th percentile
of the step time (start to the last device's end) for each, and their ratios
(pinned / unpinned: below 1 is faster pinned).

    .venv/bin/python benchmarks/bench_pinning.py [--steps 40] [--only 1f1b gpipe ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import piper_nb as pn
from piper_nb import strategies

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_runtime import table  # noqa: E402  (next to this script)

__all__ = ["run"]

DEFAULT = ("zero0", "zero3", "gpipe", "1f1b", "interleaved", "zb1p", "dualpipev")


def _p90(times: list[float]) -> float:
    return sorted(times)[int(0.9 * (len(times) - 1))]


def run(name: str, clusters: dict[bool, pn.LocalCluster], steps: int, warmup: int) -> dict:
    plan, batch = strategies.compile_strategy(name, "bench")
    times: dict[bool, list[float]] = {True: [], False: []}
    for c in clusters.values():
        c.reset(plan, pn.optim.SGD(0.01))
    for k in range(warmup + steps):
        for pin in ((True, False) if k % 2 == 0 else (False, True)):
            outs = clusters[pin].step(plan, batch, trace=False)
            if k >= warmup:
                times[pin].append(max(o["end"] for o in outs))
    med = {p: statistics.median(t) * 1e3 for p, t in times.items()}
    p90 = {p: _p90(t) * 1e3 for p, t in times.items()}
    return {"strategy": name, "pinned ms": med[True], "unpinned ms": med[False],
            "median ratio": med[True] / med[False], "pinned p90 ms": p90[True],
            "unpinned p90 ms": p90[False], "p90 ratio": p90[True] / p90[False]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="measured steps per cluster")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=None, help="names in piper_nb.strategies")
    args = ap.parse_args(argv)
    names = args.only or [n for n in DEFAULT if n in strategies.MATRIX]
    t0 = time.perf_counter()
    rows = []
    with pn.LocalCluster(2, pin=True) as pinned, pn.LocalCluster(2, pin=False) as free:
        for name in names:
            rows.append(run(name, {True: pinned, False: free}, args.steps, args.warmup))
            r = rows[-1]
            print(f"  {name}: {r['pinned ms']:.1f} vs {r['unpinned ms']:.1f} ms", flush=True)
    print(f"2 ranks, size bench, SGD; median and 90th percentile of {args.steps} steps after "
          f"{args.warmup} warm-up, interleaved; {time.perf_counter() - t0:.0f} s in all\n")
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
