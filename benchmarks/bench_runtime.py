"""Benchmark: piper_nb's runtime against PyTorch's own distributed training, as step-time ratios.

The same model (an MLP of 8 Linear+tanh layers, dim 256), the same batch, the same
microbatches, the same SGD (lr 0.01), the same stage cut, on gloo over 127.0.0.1 with one
intra-op thread per process, every process of both systems pinned the same way (one core
each where there are enough, as `pn.LocalCluster` does; `--no-pin` pins none):

0. one device, no parallelism vs a plain eager loop (the runtime's own overhead, no comm)
1. piper_nb 1F1B            vs `torch.distributed.pipelining.Schedule1F1B`, 2 and 4 ranks
2. piper_nb DualPipeV       vs `ScheduleDualPipeV` (2 ranks, 4 stages placed V-style)
3. replicate zero=0         vs `DistributedDataParallel` (`no_sync` on all but the last mb)
4. replicate zero=3         vs FSDP2 `fully_shard`, one unit on the root (piper_nb's plan has
   one bucket too; `--fsdp-wrap layers` shards each layer as well), twice: with its defaults
   (reduce-scatter every microbatch, reshard after backward: the ZeRO-3 state piper_nb's
   plan keeps) and with FSDP2's accumulation recipe (`set_requires_gradient_sync` and
   `set_reshard_after_backward` off until the last microbatch: full gradients between
   microbatches and one reduce-scatter per step)

piper_nb runs on one `pn.LocalCluster` per world size, reused across cases: `reset` once, then
`cluster.step` per step, the loop inside `pn.train`; its step time is `pn.train`'s (barrier,
then the last worker's end). The peers (`_peers.py`) run in their own spawned gloo groups in
this same script and are timed the same way (barrier, wall time per rank, max over ranks).
All systems of a case stay up side by side and run in interleaved rounds (A B, then B A, ...)
so machine noise hits them alike; after warm-up steps the median step is reported (and, as a
check on noise, the ratio of the fastest steps). The first-step losses of every system must
agree (same work). A second table splits piper_nb's step on its busiest device into compute
(F/B/BI/BW/U events of the measured trace) and the rest (waiting on peers, the pipeline
bubble, runtime overhead), and gives each system's CPU time per step (from /proc, all ranks).

With `--compiled`, both systems run under torch.compile (inductor): piper_nb's regions
through `pn.compile_regions({})`, each peer with every layer compiled as torchtitan's
`apply_compile` does (a compiled eager loop, Schedule1F1B, FSDP2); the warm-up steps
take the compiles.

    .venv/bin/python benchmarks/bench_runtime.py [--quick] [--steps N] [--only NAME]
                                                 [--compiled]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import piper_nb as pn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _peers import PeerGroup  # noqa: E402  (next to this script; spawned ranks import it too)

__all__ = ["Case", "cases", "run_case"]

_COMPUTE = ("F", "B", "BI", "BW", "U")


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by processes `pids` (all their threads); NaN
    where /proc is not there."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    except OSError:
        return float("nan")
    return total / os.sysconf("SC_CLK_TCK")


def _timed(system, pids: list[int], steps: int, cpu: list[float]) -> list[float]:
    """`system.run(steps)`'s step times; the CPU seconds it used are appended to `cpu`."""
    before = _cpu_seconds(pids)
    times = system.run(steps)[0]
    cpu.append(_cpu_seconds(pids) - before)
    return times


@dataclass
class Case:
    name: str                   # e.g. "1F1B"
    world: int
    annotation: dict
    program: list
    peers: dict[str, str]       # peer kind -> its label in the table
    stages: list[list[int]] | None = None   # layer indices per stage (pipelines)
    rows: list[dict] = field(default_factory=list)


def _stage_layers(annotation: dict) -> list[list[int]]:
    """`cut_stages`' {"layers.i": {"PP": s}} as the layer indices of each stage."""
    stages: dict[int, list[int]] = {}
    for path, tags in annotation.items():
        stages.setdefault(tags["PP"], []).append(int(path.rsplit(".", 1)[1]))
    return [sorted(stages[s]) for s in sorted(stages)]


def cases(model, microbatches: int, compiled: bool = False) -> list[Case]:
    m, whole = microbatches, {"layers": {"PP": 0}}
    if compiled:
        return compiled_cases(model, m)
    out = [Case("one device", 1, whole, [pn.place({}, [0]), pn.split({}, "MB", m)],
                {"eager": "eager loop"})]
    for ranks in (2, 4):
        ann = pn.cut_stages(model, ranks)
        out.append(Case("1F1B", ranks, ann, pn.schedules.one_f_one_b(ranks, m, place=True),
                        {"1f1b": "Schedule1F1B"}, _stage_layers(ann)))
    ann = pn.cut_stages(model, 4)
    out.append(Case("DualPipeV (4 stages)", 2, ann, pn.schedules.dualpipev(2, m, place=True),
                    {"dualpipev": "ScheduleDualPipeV"}, _stage_layers(ann)))
    out.append(Case("replicate zero=0", 2, whole,
                    [pn.replicate({}, [0, 1], zero=0), pn.split({}, "MB", m)],
                    {"ddp": "DDP + no_sync"}))
    out.append(Case("replicate zero=3", 2, whole,
                    [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", m)],
                    {"fsdp2": "FSDP2, sync every mb"}))
    out.append(Case("replicate zero=3 reshard=False", 2, whole,
                    [pn.replicate({}, [0, 1], zero=3, reshard=False), pn.split({}, "MB", m)],
                    {"fsdp2_acc": "FSDP2, accumulate"}))
    return out


def compiled_cases(model, m: int) -> list[Case]:
    """Both systems under torch.compile (inductor): piper_nb's regions (`compile_regions`)
    against the peers with each layer compiled (torchtitan's `apply_compile`)."""
    whole, on = {"layers": {"PP": 0}}, pn.compile_regions({})
    ann = pn.cut_stages(model, 2)
    return [Case("one device, compiled", 1, whole, [pn.place({}, [0]), pn.split({}, "MB", m), on],
                 {"eager+compile": "compiled eager loop"}),
            Case("1F1B, compiled", 2, ann, [*pn.schedules.one_f_one_b(2, m, place=True), on],
                 {"1f1b+compile": "Schedule1F1B, compiled layers"}, _stage_layers(ann)),
            Case("replicate zero=3, compiled", 2, whole,
                 [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", m), on],
                 {"fsdp2+compile": "FSDP2, compiled layers"})]


class _Piper:
    """One compiled plan on a shared LocalCluster, stepped like `pn.train` steps it."""

    def __init__(self, plan, cluster, batch, optimizer):
        self.plan, self.cluster, self.batch = plan, cluster, batch
        cluster.reset(plan, optimizer)
        self.busy: list[float] = []     # per step: compute seconds on the busiest device

    def run(self, steps: int) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for _ in range(steps):
            outs = self.cluster.step(self.plan, self.batch, trace=False)  # as pn.train steps
            losses.append(sum(o["loss"] for o in outs))
            times.append(max(o["end"] for o in outs))
            compute = [sum(e.end - e.start for e in o["events"] if e.kind in _COMPUTE)
                       for o in outs]
            self.busy.append(max(compute))
        return times, losses


def run_case(case: Case, model, batch, clusters: dict, steps: int, warmup: int, chunk: int,
             lr: float, wrap: str = "root", pin: bool | None = None) -> None:
    spec = pn.annotate(model, case.annotation)
    plan = pn.compile(spec, case.program, batch)
    systems: dict[str, object] = {"piper": _Piper(plan, clusters[case.world], batch,
                                                  pn.optim.SGD(lr))}
    base = dict(model=type(model).__name__, config=model.config, batch=batch[0].shape[0],
                microbatches=plan.microbatches, lr=lr, stages=case.stages, wrap=wrap)
    try:
        for kind in case.peers:
            systems[kind] = PeerGroup(dict(base, kind=kind), case.world, pin=pin)
        first = {name: sys_.run(warmup)[1][0] for name, sys_ in systems.items()}
        pids = {name: [p.pid for p in sys_.procs] for name, sys_ in systems.items()
                if name != "piper"}
        pids["piper"] = [clusters[case.world].info[r]["pid"] for r in range(case.world)]
        times: dict[str, list[float]] = {name: [] for name in systems}
        cpu: dict[str, list[float]] = {name: [] for name in systems}
        names = list(systems)
        for r in range((steps + chunk - 1) // chunk):
            k = r % len(names)
            for name in names[k:] + names[:k]:   # rotate who goes first
                times[name] += _timed(systems[name], pids[name], chunk, cpu[name])
    finally:
        for name, sys_ in systems.items():
            if name != "piper":
                sys_.close()
    ref = first["piper"]
    for name, loss in first.items():
        if abs(loss - ref) > 1e-4 * max(abs(ref), 1.0):
            raise RuntimeError(f"{case.name}: {name}'s first loss {loss} differs from "
                               f"piper_nb's {ref}: the systems do not do the same work")
    piper = systems["piper"]
    p_ms = statistics.median(times["piper"]) * 1e3
    busy = statistics.median(piper.busy[warmup:]) * 1e3
    cpu_ms = {name: 1e3 * sum(v) / len(times[name]) for name, v in cpu.items()}
    for kind, label in case.peers.items():
        if kind.startswith("fsdp2"):
            label += ", 1 unit" if wrap == "root" else ", unit per layer"
        q_ms = statistics.median(times[kind]) * 1e3
        best = min(times["piper"]) / min(times[kind])
        case.rows.append({"case": case.name, "ranks": case.world, "peer": label,
                          "piper_nb ms": p_ms, "peer ms": q_ms, "ratio": p_ms / q_ms,
                          "best-step ratio": best,
                          "compute ms": busy, "steps": len(times["piper"]),
                          "piper_nb CPU ms": cpu_ms["piper"], "peer CPU ms": cpu_ms[kind]})


def _fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def table(rows: list[dict], keys: list[str], ratio_digits: int = 2) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{r[k]:.{ratio_digits}f}" if "ratio" in k else _fmt(r[k]) for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6 measured steps, 2 warm-up")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per system")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1, help="steps per system per round")
    ap.add_argument("--fsdp-wrap", choices=("root", "layers"), default="root",
                    help="FSDP2 units: the root only (one bucket, like piper_nb) or every layer")
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--only", default="", help="run only cases whose name contains this")
    ap.add_argument("--compiled", action="store_true",
                    help="both systems under torch.compile (inductor): piper_nb's "
                    "compile_regions against each peer with every layer compiled")
    ap.add_argument("--no-pin", dest="pin", action="store_const", const=False, default=None,
                    help="pin no process to a core (default: as LocalCluster, both systems)")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.warmup = 6, 2
    torch.set_num_threads(1)
    model = pn.models.MLP(dim=args.dim, depth=args.depth)
    batch = model.example_batch(batch_size=args.batch, seed=0)
    todo = [c for c in cases(model, args.microbatches, args.compiled)
            if args.only.lower() in c.name.lower()]
    t0 = time.perf_counter()
    clusters: dict[int, pn.LocalCluster] = {}
    try:
        for case in todo:
            if case.world not in clusters:
                clusters[case.world] = pn.LocalCluster(case.world, pin=args.pin).start()
            run_case(case, model, batch, clusters, args.steps, args.warmup, args.chunk, 0.01,
                     args.fsdp_wrap, args.pin)
            if all(c.world != case.world for c in todo[todo.index(case) + 1:]):
                clusters.pop(case.world).close()   # no later case needs this world size
            for r in case.rows:
                print(f"  {r['case']} x{r['ranks']} vs {r['peer']}: {r['piper_nb ms']:.1f} ms vs "
                      f"{r['peer ms']:.1f} ms (ratio {r['ratio']:.2f})", file=sys.stderr, flush=True)
    finally:
        for c in clusters.values():
            c.close()
    rows = [r for c in todo for r in c.rows]
    for r in rows:
        r["case"] = f"{r['case']} vs {r['peer']}"
        r["rest ms"] = r["piper_nb ms"] - r["compute ms"]
        r["compute %"] = 100.0 * r["compute ms"] / r["piper_nb ms"]
    pinned = "not pinned" if args.pin is False else "pinned one per core where there are enough"
    print(f"MLP {args.depth} x {args.dim}, batch {args.batch}, {args.microbatches} microbatches, "
          f"SGD lr 0.01, gloo on CPU, 1 thread per rank, processes {pinned}; "
          f"median of {args.steps} steps after "
          f"{args.warmup} warm-up, interleaved in rounds of {args.chunk}; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print(table(rows, ["case", "ranks", "piper_nb ms", "peer ms", "ratio", "best-step ratio"]))
    print("\nWhere the time goes. compute: piper_nb's F/B/BI/BW/U events on its busiest device "
          "(median step); rest: the step minus that (waiting on transfers and peers, the bubble, "
          "runtime overhead). CPU: user + system CPU time of all ranks' processes per step "
          "(piper_nb's includes its workers' per-step bookkeeping after the timed step)\n")
    print(table(rows, ["case", "ranks", "piper_nb ms", "compute ms", "rest ms", "compute %",
                       "piper_nb CPU ms", "peer CPU ms"]))


if __name__ == "__main__":
    main()
