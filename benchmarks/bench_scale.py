"""Plans at scale: compile, check and simulate a 16,384-device plan on this machine.

The headline case is a GPT-like model of 64 layers built on the meta device (no weights
allocated), one stage per layer: PP 64 x DP 256 with ZeRO-1, 1F1B over 128 microbatches,
in bf16 (`precision="bf16"`), simulated with `pn.CostModel.analytic(plan, "H100")`.
`--cost uniform` simulates it with the Designer's default costs instead
(`pn.CostModel.uniform()`: passes of 1 and 2 units, messages that take no time), and
`--model mlp` plans `pn.models.MLP(dim=2048, depth=64)` (one linear per stage) instead,
and `--model mlp-uneven` the same at dim 2000, whose 4,002,000 parameters a stage leave
the last of 256 ZeRO shards short: replicas whose optimizer state differs, simulated once
per class with each one's own state (`sim.replicas`: uneven ZeRO shards).
Prints seconds per phase (compile without checks, the static checks, the analytic cost
model, the simulation) and the process's peak RSS (`resource.getrusage`). Each size runs
in its own process, so each row's peak is its own.

    .venv/bin/python benchmarks/bench_scale.py                  # PP 64 x DP 256, 128 mb
    .venv/bin/python benchmarks/bench_scale.py --pp 8 --dp 32 --micro 32
    .venv/bin/python benchmarks/bench_scale.py --sweep           # 8x32, 16x64, 32x128, 64x256
    .venv/bin/python benchmarks/bench_scale.py --pp 8 --dp 32 --profile out.prof
    .venv/bin/python benchmarks/bench_scale.py --model mlp --cost uniform
    .venv/bin/python benchmarks/bench_scale.py --model mlp-uneven --cost uniform
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import time

import torch

import piper_nb as pn
from piper_nb.compiler.checks import check_plan
from piper_nb.compiler.compile import _gc_paused
from piper_nb.sim.replicas import CompactTrace

__all__ = ["build", "run"]


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def build(pp: int, dp: int, micro: int, zero: int = 1, layers: int = 64, model: str = "gpt"):
    """(spec, program, batch) of the GPT-like (or MLP) meta model cut into `pp` stages."""
    if layers % pp:
        raise SystemExit(f"--pp {pp} must divide the {layers} layers")
    per = layers // pp
    if model in ("mlp", "mlp-uneven"):
        dim = 2000 if model == "mlp-uneven" else 2048
        with torch.device("meta"):
            net = pn.models.MLP(dim=dim, depth=layers)
        spec = pn.annotate(net, {f"layers.{i}": {"PP": i // per} for i in range(layers)})
        x = torch.zeros(micro * dp, dim, device="meta")
        batch = (x, x)
    else:
        with torch.device("meta"):
            net = pn.models.TinyGPT(vocab=32000, dim=2048, layers=layers, heads=16, seq=1024,
                                    tie_embeddings=False)
        tags = {"embed": {"PP": 0}, "head": {"PP": pp - 1}}
        tags |= {f"blocks.{i}": {"PP": i // per} for i in range(layers)}
        spec = pn.annotate(net, tags)
        ids = torch.zeros(micro * dp, 1024, dtype=torch.long, device="meta")
        batch = (ids, ids)
    program = [*pn.schedules.one_f_one_b(ranks=pp, microbatches=micro, place=False)]
    for s in range(pp):
        devices = [s + pp * k for k in range(dp)]
        program += [pn.place({"PP": s}, devices=devices),
                    pn.replicate({"PP": s}, devices=devices, zero=zero)]
    return spec, program, batch


def run(pp: int, dp: int, micro: int, zero: int = 1, cost: str = "analytic",
        model: str = "gpt") -> dict:
    spec, program, batch = build(pp, dp, micro, zero, model=model)
    gc.collect()
    base = _rss_mb()
    cpu0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    t0 = time.perf_counter()
    plan = pn.compile(spec, program, batch, check=False, precision="bf16")
    t1 = time.perf_counter()
    with _gc_paused():   # as pn.compile runs its checks
        check_plan(plan)
    t2 = time.perf_counter()
    costs = pn.CostModel.uniform() if cost == "uniform" else pn.CostModel.analytic(plan, "H100")
    t3 = time.perf_counter()
    trace = pn.simulate(plan, costs)
    t4 = time.perf_counter()
    peaks = trace.peak_memory
    step, peak = trace.step_time, max(peaks.values())
    t5 = time.perf_counter()
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    return {"devices": plan.world, "pp": pp, "dp": dp, "micro": micro, "zero": zero,
            "cost": cost, "model": model, "compact": isinstance(trace, CompactTrace),
            "cpu_s": cpu.ru_utime + cpu.ru_stime - cpu0,
            "compile_s": t1 - t0, "check_s": t2 - t1, "cost_s": t3 - t2,
            "simulate_s": t4 - t3, "answers_s": t5 - t4, "total_s": t5 - t0,
            "rss_before_mb": base, "peak_rss_mb": _rss_mb(),
            "step_s": step, "peak_gb": peak / 2**30,
            "peaks_differ": any(peaks[d] != peaks[t] for d, t in plan.stamps().items())}


def _row(r: dict) -> str:
    return (f"| {r['pp']} x {r['dp']} = {r['devices']} | {r['micro']} | {r['compile_s']:.1f} | "
            f"{r['check_s']:.1f} | {r['cost_s']:.1f} | {r['simulate_s']:.1f} | "
            f"{r['answers_s']:.1f} | {r['total_s']:.1f} | {r['cpu_s']:.1f} | "
            f"{r['peak_rss_mb'] / 1024:.2f} | "
            f"{r['step_s']:.3f} | {r['peak_gb']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pp", type=int, default=64)
    ap.add_argument("--dp", type=int, default=256)
    ap.add_argument("--micro", type=int, default=128)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--cost", choices=("analytic", "uniform"), default="analytic",
                    help="analytic H100 costs, or the uniform model (messages take no time)")
    ap.add_argument("--model", choices=("gpt", "mlp", "mlp-uneven"), default="gpt",
                    help="the GPT-like model of 64 blocks, or an MLP of 64 linears (dim "
                         "2048, or 2000: uneven ZeRO shards)")
    ap.add_argument("--sweep", action="store_true", help="8x32, 16x64, 32x128, 64x256")
    ap.add_argument("--profile", metavar="FILE", help="write cProfile stats of one run")
    ap.add_argument("--json", action="store_true", help="print one JSON row (used by --sweep)")
    a = ap.parse_args()
    print("| PP x DP = devices | microbatches | compile s | checks s | cost model s | "
          "simulate s | step time + peaks s | total s | CPU s | peak RSS GB | step s | peak GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    sizes = [(8, 32, 32), (16, 64, 64), (32, 128, 128), (64, 256, 128)] if a.sweep \
        else [(a.pp, a.dp, a.micro)]
    for pp, dp, micro in sizes:
        if a.sweep:   # one process per row: its own peak RSS
            out = subprocess.run([sys.executable, __file__, "--pp", str(pp), "--dp", str(dp),
                                  "--micro", str(micro), "--zero", str(a.zero), "--json",
                                  "--cost", a.cost, "--model", a.model],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
        elif a.profile:
            import cProfile
            prof = cProfile.Profile(time.process_time)   # CPU time: others share the cores
            r = prof.runcall(run, pp, dp, micro, a.zero, a.cost, a.model)
            prof.dump_stats(a.profile)
        else:
            r = run(pp, dp, micro, a.zero, a.cost, a.model)
        if a.json:
            print(json.dumps(r))
        else:
            print(_row(r), flush=True)
            how = "one replica per class" if r["compact"] else "every device"
            peaks = ("some replicas peak apart from their template" if r["peaks_differ"]
                     else "every replica peaks as its template")
            print(f"  ({how} simulated; {peaks})", flush=True)


if __name__ == "__main__":
    main()
