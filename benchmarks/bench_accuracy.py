"""Benchmark: predicted vs measured step time, profiled cost model, every runtime strategy.

For each strategy of the runtime's matrix (DP, ZeRO-1/2/3 on 2 ranks; GPipe, 1F1B,
interleaved 1F1B, ZB1P, DualPipeV on 2 ranks; DualPipe on 4 ranks; PP 2 x DP 2 with ZeRO-3;
PP 2 x DP 2 x EP 2 on TinyMoE; TinyGPT with embeddings tied across stages) the plan is
profiled here
(`pn.CostModel.profile(plan, repeats=25, optimizer=...)`: passes timed by a worker built in this
process on one thread, the worker's bookkeeping per instruction, gloo fitted per message
kind between processes, gloo's links measured again for each strategy; host-synchronous,
`cores` shared among the devices computing at once and the other tasks the profile saw,
time-slicing's cost measured where devices outnumber cores)
and simulated, then trained on local CPU workers (one cluster per world size, AdamW).

Predicted: the simulated step, until the last device's host is done (`trace.meta
["host_end"]`, which is what a measured step time is), the mean of two profiles, one right
before the strategy is measured and one right after, so that the prediction sees the load
the measurement saw (the machine drifts by several percent over minutes) and the noise of
one profile's gloo fits halves. Measured: the median step time (`Result.step_times`: step
start to the last device's end) over `--steps` steps after `--warmup`. Prints a markdown
table; `--verbose` adds the worst instructions of `predicted.compare(measured)` for each.

    .venv/bin/python benchmarks/bench_accuracy.py [--steps 20] [--warmup 3] [--only zb1p ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import piper_nb as pn
from piper_nb import strategies
from piper_nb.profile.links import _LINK_CACHE

__all__ = ["STRATEGIES", "compile_strategy", "run"]

TOLERANCE = 0.15
REPEATS = 25   # profile rounds; with 9, 1F1B's prediction moved 9% between profiles, here 1%


# display name -> name in piper_nb.strategies.MATRIX
STRATEGIES = {"DP": "zero0", "ZeRO-1": "zero1", "ZeRO-2": "zero2", "ZeRO-3": "zero3",
              "GPipe": "gpipe", "1F1B": "1f1b", "interleaved 1F1B": "interleaved", "ZB1P": "zb1p",
              "DualPipeV": "dualpipev", "DualPipe": "dualpipe-4ranks",
              "PP2 x DP2 ZeRO-3": "pp2-dp2-zero3", "PP2 x DP2 x EP2 (TinyMoE)": "pp2-dp2-ep2",
              "tied embeddings": "tied-embeddings"}


def compile_strategy(name: str, size: str = "bench"):
    """-> (plan, batch) of one strategy of the matrix, by display name."""
    return strategies.compile_strategy(STRATEGIES[name], size)



def run(name: str, cluster, steps: int, warmup: int, optimizer, verbose: bool = False,
        size: str = "bench") -> dict:
    plan, batch = compile_strategy(name, size)
    t0 = time.perf_counter()
    before, cost, predicted = _predict(plan, optimizer)
    profile_s = time.perf_counter() - t0
    result = pn.train(plan, batch, steps=warmup + steps, optimizer=optimizer, cluster=cluster)
    t0 = time.perf_counter()
    after = _predict(plan, optimizer)[0]
    profile_s += time.perf_counter() - t0   # both profiles, not the training between them
    measured = statistics.median(result.step_times[warmup:])
    pred = (before + after) / 2
    row = {"strategy": name, "ranks": plan.world, "predicted ms": pred * 1e3,
           "before ms": before * 1e3, "after ms": after * 1e3,
           "measured ms": measured * 1e3, "ratio": measured / pred,
           "spread ms": (min(result.step_times[warmup:]) * 1e3,
                         max(result.step_times[warmup:]) * 1e3),
           "profile s": profile_s}
    if verbose:
        print(f"\n### {name}\n")
        print("overhead per instruction (us):",
              {d: round(v * 1e6, 1) for d, v in cost.host.overhead.items()})
        print("links (latency us, MB/s):",
              {f"{k}/{n}": (round(a * 1e6, 1), round(min(b, 1e15) / 1e6, 1))
               for (k, n), (a, b) in cost.links.items()})
        print("issue calls (latency us, MB/s):",
              {k: (round(a * 1e6, 1), round(min(b, 1e15) / 1e6, 1)) for k, (a, b) in
               cost.host.issue.items()},
              "background tasks:", round(cost.host.background, 2))
        print()
        print(pass_sums(predicted, result.trace))
        print()
        print(predicted.compare(result.trace).table(12))
    return row


def _predict(plan, optimizer) -> tuple[float, object, object]:
    """(predicted step s, cost model, simulated trace) from a fresh profile: gloo fitted
    again too, under the load of this moment."""
    _LINK_CACHE.clear()
    cost = pn.CostModel.profile(plan, repeats=REPEATS, optimizer=optimizer)
    predicted = pn.simulate(plan, cost)
    return predicted.meta["host_end"], cost, predicted


def pass_sums(predicted, measured) -> str:
    """Per device and pass kind: predicted and measured (the last, traced step) total ms."""
    def sums(trace):
        out: dict = {}
        for e in trace.events:
            if e.kind in ("F", "B", "BI", "BW", "U"):
                out[(e.device, e.kind)] = out.get((e.device, e.kind), 0.0) + e.end - e.start
        return out
    p, m = sums(predicted), sums(measured)
    lines = ["| device | pass | predicted ms | measured ms | measured / predicted |",
             "|---|---|---|---|---|"]
    for k in sorted(p):
        lines.append(f"| {k[0]} | {k[1]} | {p[k] * 1e3:.2f} | {m.get(k, 0.0) * 1e3:.2f} | "
                     f"{m.get(k, 0.0) / p[k] if p[k] else float('nan'):.2f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| strategy | ranks | predicted ms (before, after) | measured ms (median) "
             "| measured / predicted | within 15% | measured min-max ms |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if abs(r["ratio"] - 1) <= TOLERANCE else "no"
        lo, hi = r["spread ms"]
        lines.append(f"| {r['strategy']} | {r['ranks']} | {r['predicted ms']:.2f} "
                     f"({r['before ms']:.1f}, {r['after ms']:.1f}) | "
                     f"{r['measured ms']:.2f} | {r['ratio']:.2f} | {ok} | {lo:.1f}-{hi:.1f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="measured steps (median)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out first")
    ap.add_argument("--only", nargs="*", default=None, help="strategy names")
    ap.add_argument("--verbose", action="store_true", help="per-instruction comparisons")
    ap.add_argument("--size", choices=sorted(strategies.SIZES), default="bench",
                    help="the matrix's model size (test: steps of a few ms, all overhead)")
    args = ap.parse_args()
    names = args.only or list(STRATEGIES)
    optimizer = pn.optim.AdamW(1e-3)
    clusters: dict[int, pn.LocalCluster] = {}
    rows = []
    load0 = os.getloadavg()
    try:
        for name in names:
            plan_world = compile_strategy(name, args.size)[0].world
            if plan_world not in clusters:
                clusters[plan_world] = pn.LocalCluster(plan_world).start()
            rows.append(run(name, clusters[plan_world], args.steps, args.warmup, optimizer,
                            args.verbose, args.size))
            print(f"done {name}: {rows[-1]['ratio']:.2f}", flush=True)
    finally:
        for c in clusters.values():
            c.close()
    load1 = os.getloadavg()
    print(f"\n## predicted vs measured step time, profiled cost model, size {args.size} "
          f"({os.cpu_count()} cores; "
          f"load average {load0[0]:.1f} at the start, {load1[0]:.1f} at the end)\n")
    print(table(rows))
    inside = sum(abs(r["ratio"] - 1) <= TOLERANCE for r in rows)
    print(f"\n{inside} of {len(rows)} within {TOLERANCE:.0%}")


if __name__ == "__main__":
    main()
