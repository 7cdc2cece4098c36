"""The GPU check: everything piper_nb can only show on a GPU, in one run, one table.

    .venv/bin/python benchmarks/gpu_check.py            # on a machine with CUDA
    .venv/bin/python benchmarks/gpu_check.py --dry-run  # anywhere: what it would run

Cases (each against the CPU reference where it trains):
- nccl-1rank: one rank on NCCL, a TinyGPT trained 3 steps, losses and weights compared;
- bf16: one rank on NCCL in bf16 (fp32 masters), against the CPU bf16 reference at bf16
  tolerance;
- overlap: a traced PP2 x DP step whose communication spans (timed on their own streams)
  overlap compute: two ranks on one GPU share it through gloo, NCCL where there are GPUs;
- memory: `torch.cuda.max_memory_allocated` per device beside the memory model's peak,
  plain and with `MemorySettings.for_cuda()`'s allowances;
- step time: the measured step beside the predictions of `CostModel.analytic(plan,
  "H200")` and of a profiled cost model (profiled on CPU: it times the CPU workers);
- nccl-pp2 / nccl-dualpipev (2 GPUs), nccl-pp2-dp2-zero3 and nccl-pp2-dp2-ep2 (4 GPUs):
  NCCL point-to-point and collectives, every multi-rank case the GPU count allows; the
  rest are listed as skipped, with why.
Every plan is compiled first, so the static checks (NCCL's included) run in the dry run
too. Under 5 minutes on one GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import piper_nb as pn
from piper_nb.cluster.local import LocalCluster

ROWS: list[tuple[str, str, str]] = []
TOL = {"rtol": 1e-4, "atol": 1e-4}


def row(case: str, status: str, detail: str) -> None:
    ROWS.append((case, status, detail))
    print(f"  {case}: {status} {detail}", flush=True)


def gpt(layers: int = 4):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=layers, heads=2, seq=16,
                              tie_embeddings=False)
    return model, model.example_batch(batch_size=8, seed=0)


def moe():
    model = pn.models.TinyMoE(vocab=64, dim=32, layers=2, experts=2, top_k=1, heads=2, seq=16)
    return model, model.example_batch(batch_size=8, seed=0)


def plans() -> dict[str, tuple]:
    """case -> (GPUs needed, model, batch, plan): compiled (and checked) up front."""
    from piper_nb.strategies import moe_annotation
    S, out = pn.schedules, {}

    def add(name, gpus, made, annotation, program):
        model, batch = made
        spec = pn.annotate(model, annotation(model) if callable(annotation) else annotation)
        out[name] = (gpus, model, batch, pn.compile(spec, program, batch))

    add("nccl-1rank", 1, gpt(), lambda m: pn.cut_stages(m, 2),
        [pn.place({}, [0]), pn.split({}, "MB", 4)])
    add("overlap", 1, gpt(), lambda m: pn.cut_stages(m, 2),
        [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]), *S.one_f_one_b(2, 4)])
    add("nccl-pp2", 2, gpt(), lambda m: pn.cut_stages(m, 2), S.one_f_one_b(2, 4, place=True))
    add("nccl-dualpipev", 2, gpt(), lambda m: pn.cut_stages(m, 4), S.dualpipev(2, 4, place=True))
    add("nccl-pp2-dp2-zero3", 4, gpt(), lambda m: pn.cut_stages(m, 2),
        [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
         pn.replicate({"PP": 0}, [0, 2], zero=3), pn.replicate({"PP": 1}, [1, 3], zero=3),
         *S.one_f_one_b(2, 4)])
    add("nccl-pp2-dp2-ep2", 4, moe(), moe_annotation(2, 2, 2),
        [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
         pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
         pn.shard({"PP": 0, "EP": "*"}, [0, 2]), pn.shard({"PP": 1, "EP": "*"}, [1, 3]),
         *S.one_f_one_b(2, 4)])
    return out


def bf16_case(dry: bool, gpus: int) -> None:
    """One rank, bf16 weights and activations, fp32 masters, on NCCL."""
    model, batch = gpt()
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      [pn.place({}, [0]), pn.split({}, "MB", 4)], batch, precision="bf16")
    if dry or not gpus:
        row("bf16", "would run", "1 rank on 1 GPU, bf16 with fp32 masters; compiled and "
            "checked")
        return
    opt = pn.optim.SGD(0.05, momentum=0.9)
    with LocalCluster(1, device="cuda") as cluster:
        result = pn.train(plan, batch, 3, opt, cluster=cluster, clip_grad_norm=1.0)
    ref = pn.reference_train(model, batch, 3, 4, opt, precision="bf16", clip_grad_norm=1.0)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1.6e-2, atol=0)
    got = result.state_dict()
    worst = max(float((got[k].float() - v.float()).abs().max()) for k, v in ref.state_dict().items())
    row("bf16", "passed", f"losses at bf16 tolerance, weights within {worst:.1e} of the CPU "
        "bf16 reference")


def train_and_compare(model, batch, plan, cluster, opt):
    result = pn.train(plan, batch, 3, opt, cluster=cluster)
    ref = pn.reference_train(model, batch, 3, plan.microbatches, opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses), **TOL)
    got = result.state_dict()
    worst = max(float((got[k].float() - v.float()).abs().max()) for k, v in ref.state_dict().items())
    assert worst < 1e-3, f"weights differ by {worst:.2e}"
    return result, worst


def overlap(trace) -> float:
    """Share of communication time (on each device) that overlaps its compute."""
    total = shared = 0.0
    for d in {e.device for e in trace.events}:
        comp = [(e.start, e.end) for e in trace.events if e.device == d and e.stream == "compute"]
        for e in trace.events:
            if e.device == d and e.stream != "compute" and e.end > e.start:
                total += e.end - e.start
                shared += sum(max(0.0, min(e.end, b) - max(e.start, a)) for a, b in comp)
    return shared / total if total else 0.0


def run(dry: bool) -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs: {gpus}{' (dry run: nothing is trained)' if dry else ''}")
    made = plans()
    opt = pn.optim.AdamW(1e-3)
    bf16_case(dry, gpus)
    for name, (need, model, batch, plan) in made.items():
        label = f"{plan.world} rank{'s' if plan.world > 1 else ''} on {need} GPU" + \
            ("s" if need > 1 else "")
        checked = "compiled and checked (NCCL check included)"
        if gpus and gpus < need:
            row(name, "skipped", f"{label}: NCCL needs a GPU per rank and this machine has "
                f"{gpus}; {checked}")
            continue
        if dry:
            row(name, "would run", f"{label}; {checked}")
            if name == "nccl-1rank":
                row("memory", "would run", "torch.cuda.max_memory_allocated per device beside the "
                    "memory model's peak, plain and with MemorySettings.for_cuda()")
                row("step time", "would run", "the measured step beside CostModel.analytic(plan, "
                    "'H200') and a profiled cost model")
            continue
        t0 = time.perf_counter()
        with LocalCluster(plan.world, device="cuda") as cluster:
            backend = ",".join(sorted({i["backend"] for i in cluster.info}))
            result, worst = train_and_compare(model, batch, plan, cluster, opt)
        extra = f"{label}, {backend}, weights within {worst:.1e} of the CPU reference"
        if name == "overlap":
            extra += f", {100 * overlap(result.trace):.0f}% of communication overlaps compute"
        if name == "nccl-1rank":
            memory(plan, result)
            step_time(plan, result)
        row(name, "ok", f"{extra} ({time.perf_counter() - t0:.0f} s)")


def memory(plan, result) -> None:
    measured = result.trace.meta.get("cuda_max_allocated", {})
    for settings, label in ((pn.MemorySettings(optimizer=pn.optim.AdamW(1e-3)), "model"),
                            (pn.MemorySettings.for_cuda(optimizer=pn.optim.AdamW(1e-3)),
                             "model + allowances")):
        peak = pn.simulate(plan, pn.CostModel.uniform(), memory=settings).peak_memory
        for d, got in sorted(measured.items()):
            row(f"memory dev{d}", "ok", f"max_memory_allocated {got / 2**20:.2f} MiB, {label} "
                f"{peak[d] / 2**20:.2f} MiB (ratio {got / max(peak[d], 1):.2f})")


def step_time(plan, result) -> None:
    measured = result.step_times[-1]
    for name, model in (("analytic H200", lambda: pn.CostModel.analytic(plan, "H200")),
                        ("profiled (CPU)", lambda: pn.CostModel.profile(plan, comm=False))):
        predicted = pn.simulate(plan, model()).step_time
        row(f"step time {name}", "ok", f"measured {measured * 1e3:.2f} ms, predicted "
            f"{predicted * 1e3:.2f} ms (measured / predicted {measured / predicted:.2f})")


def main() -> int:
    ap = argparse.ArgumentParser(description="piper_nb's GPU check (see the module docstring)")
    ap.add_argument("--dry-run", action="store_true", help="compile and list, train nothing")
    args = ap.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    t0 = time.perf_counter()
    run(dry)
    print("\n| case | status | detail |\n|---|---|---|")
    for case, status, detail in ROWS:
        print(f"| {case} | {status} | {detail} |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
