"""`pn.search`: how fast it explores, how far its estimate is from the simulator, whether
its ranking matches measured step times, and whether it finds at least the published
configurations' throughput (issue 55).

Cases (`--case`):

- `scale`: a Llama 3 70B-shaped model (meta device) on 128 H100s (16 nodes of 8) and a
  405B-shaped on 512, global batch 256 sequences of 8192: candidates explored, seconds
  probing (one compile per TP class at two microbatch sizes), exploring, and verifying the
  top 2 (compile, checks, simulation with the memory model); candidates per second; each
  in one process (`jobs=1`) and then spread over every core (`planner.spread`).
- `accuracy`: a 1 B-class Llama on 16 H100s, 40 candidates drawn at random (seeded): the
  explore tier's step and peak over the simulator's on the compiled plan.
- `accuracy-moe`: the same for a Mixtral-shaped MoE (8 experts, top 2) on 16 H100s, 12
  candidates with expert parallelism (EP = DP).
- `accuracy-cp`: the 1 B-class Llama at 32,768 tokens a sequence on 16 H100s, 12
  candidates with context parallelism (CP 2-16).
- `ranking`: TinyGPT on 4 CPU workers with profiled costs: the 8 fastest candidates, each
  trained (median step of 6 after 2 warm-up steps) against its prediction; Spearman's rho;
  and whether each trained equal to `pn.reference_train` (fp32, rtol 1e-5).
- `published`: Megatron's five runs of `published.py` (SC'21 Table 1, GPT 1.7B on 32 A100s
  to 39.1B on 512) searched with no pins, and the published configuration priced under
  the same model (every knob pinned): best over published, and which knobs differ.
- `published-cp`: torchtitan's context-parallel runs (Table 2: Llama 3.1 8B on 8 H100,
  FSDP x CP at 32k to 256k tokens), searched with no pins against the published
  configuration (FSDP = ZeRO-3 over DP x CP, every layer recomputed) priced alike.
- `verify`: the time to verify one candidate at scale: notebook 10's best plan of the 70B
  on 128 H100s (PP 4 x TP 4 + SP x DP 8, ZeRO-3, DualPipeV, 32 microbatches of one 4096
  sequence), every knob pinned: probe, explore and verify seconds, its step and peak.

Run: .venv/bin/python benchmarks/bench_search.py
[--case all|scale|accuracy|accuracy-moe|accuracy-cp|ranking|published|published-cp|
 verify]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import piper_nb as pn  # noqa: E402
from piper_nb.planner import engine, explore  # noqa: E402
from piper_nb.planner.estimate import Context, estimate, layout  # noqa: E402
from piper_nb.planner.knobs import Knobs, Schedule, space  # noqa: E402
from piper_nb.planner.probe import probe  # noqa: E402

LLAMA3 = {"70b": dict(dim=8192, heads=64, kv_heads=8, hidden=28672, layers=80),
          "405b": dict(dim=16384, heads=128, kv_heads=8, hidden=53248, layers=126)}


def llama(shape: dict, batch: int, seq: int = 8192, vocab: int = 128256):
    with torch.device("meta"):
        model = pn.models.Llama(vocab=vocab, seq=seq, attention="flash", **shape)
        ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def scale() -> list[dict]:
    rows = []
    # each shape in one process, then spread over every core (`planner.spread`)
    for name, devices, jobs in (("70b", 128, 1), ("70b", 128, None), ("405b", 512, 1),
                                ("405b", 512, None)):
        model, batch = llama(LLAMA3[name], 256)
        t0 = time.perf_counter()
        r = pn.search(model, batch, devices, "H100", top=2, budget=60, progress=False,
                      jobs=jobs)
        s = r.seconds
        rows.append({"case": f"Llama 3 {name} shape, {devices} H100",
                     "jobs": jobs or "one per core", "candidates": r.explored,
                     "probe s": round(s["probe"], 1), "explore s": round(s["explore"], 1),
                     "explore + probe s": round(s["probe"] + s["explore"], 1),
                     "candidates/s (explore + probe)": round(
                         r.explored / (s["probe"] + s["explore"]), 1),
                     "verify s": round(s["verify"], 1), "total s": round(
                         time.perf_counter() - t0, 1), "refused": r.reasons(),
                     "best": [c.knobs.label() for c in r.ranked],
                     "best tokens/s/GPU": [round(c.tokens_per_s) for c in r.ranked]})
        print(json.dumps(rows[-1], indent=1), flush=True)
    return rows


def accuracy(n: int = 40, seed: int = 0) -> dict:
    model, batch = llama(dict(dim=1024, heads=16, kv_heads=4, hidden=2816, layers=8), 32,
                         seq=2048, vocab=32000)
    return _accuracy("1 B-class Llama, 16 H100, estimate / simulated", model, batch, n, seed)


def accuracy_moe(n: int = 12, seed: int = 0) -> dict:
    """A Mixtral-shaped MoE (8 experts, top 2, 4 layers) on 16 H100: EP candidates only."""
    import transformers
    cfg = transformers.MixtralConfig(
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, hidden_size=1024,
        intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=4, max_position_embeddings=4096)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(cfg)
        ids = torch.zeros(32, 2048, dtype=torch.long)
    return _accuracy("Mixtral-shaped MoE, 16 H100, EP candidates, estimate / simulated",
                     model, (ids, ids), n, seed, keep=lambda k: k.ep > 1)


def accuracy_cp(n: int = 12, seed: int = 0) -> dict:
    """The 1 B-class Llama at 32k tokens a sequence on 16 H100: CP candidates only."""
    model, batch = llama(dict(dim=1024, heads=16, kv_heads=4, hidden=2816, layers=8), 16,
                         seq=32768, vocab=32000)
    return _accuracy("1 B-class Llama at 32k, 16 H100, CP candidates, estimate / simulated",
                     model, batch, n, seed, keep=lambda k: k.cp > 1)


def _accuracy(case: str, model, batch, n: int, seed: int, keep=lambda k: True) -> dict:
    """The explore tier's step and peak over the simulator's for `n` candidates drawn at
    random (seeded) from the search's own space on 16 H100 (`keep`: which of them)."""
    from piper_nb.capture.batch import Batch
    from piper_nb.planner.experts import find_experts
    samples = batch[0].shape[0]
    units = engine.unit_names(model, Batch.of(batch, "bench"))
    experts = find_experts(model)
    settings = pn.MemorySettings(optimizer="adamw")
    setup = engine._Setup(model, batch, batch[0].numel(), units, pn.sim.gpus.spec_of("H100"),
                          pn.Topology.of("H100"), "bf16", settings, "analytic", None, "auto",
                          experts, engine._holding(units, experts))
    cands = [k for k in space(16, samples, len(units), gpus_per_node=8, experts=experts,
                              sequence=batch[0].shape[1]) if keep(k)]
    sizes = explore.probe_sizes(cands, samples)
    spec = setup.unit_spec()
    random.Random(seed).shuffle(cands)
    probes, steps, peaks = {}, [], []
    for k in cands:
        if len(steps) == n:
            break
        key = explore._key(k)
        p = probes.get(key) or probes.setdefault(key, probe(
            spec, units, batch, sizes[k.tp, k.cp], k.tp, k.sp, setup.price, precision="bf16",
            cp=k.cp))
        if p.error:
            continue
        ctx = Context(batch=samples, links=p.links, param_bytes=None, grad_bytes=None,
                      optim_bytes=12, reduce_bytes=4)
        e = estimate(k, layout(k, p, ctx), ctx)
        cut = list(p.cut(k.stages))
        plan = pn.compile(pn.annotate(model, setup.annotation(k, cut)), setup.program(k, cut),
                          batch, precision="bf16")
        trace = pn.simulate(plan, setup.price(plan), memory=settings)
        steps.append(e.step / trace.step_time)
        peaks.append(e.peak / max(trace.peak_memory.values()))
    out = {"case": case, "candidates": len(steps)}
    for key, xs in (("step", steps), ("peak", peaks)):
        out[key] = {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
                    "max": round(max(xs), 3),
                    "within 15%": sum(abs(x - 1) <= 0.15 for x in xs)}
    print(json.dumps(out, indent=1), flush=True)
    return out


def _equal(got, ref, rtol=1e-5, atol=4e-5) -> bool:
    """Losses and every parameter equal to one process's (fp32; the tests' tolerances)."""
    close = lambda a, b: torch.allclose(torch.as_tensor(a), torch.as_tensor(b),  # noqa: E731
                                        rtol=rtol, atol=atol)
    want = ref.state_dict()
    return close(got.losses, ref.losses) and all(close(t, want[k])
                                                 for k, t in got.state_dict().items())


def spearman(xs, ys) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = pos
        return r
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    return 1 - 6 * sum((a - b) ** 2 for a, b in zip(rx, ry, strict=True)) / (n * (n * n - 1))


def ranking(count: int = 8) -> dict:
    torch.manual_seed(0)
    model = pn.models.TinyGPT(vocab=64, dim=64, layers=4, heads=4, seq=32)
    batch = model.example_batch(batch_size=16, seed=0)
    r = pn.search(model, batch, 4, cost="profile", top=count, progress=False)
    rows = []
    opt = pn.optim.SGD(lr=0.01)
    with pn.LocalCluster(4) as cluster:
        for c in r.ranked:
            spec = pn.annotate(model, c.annotation)
            plan = pn.compile(spec, c.program, batch)
            got = pn.train(plan, batch, 8, opt, cluster=cluster)
            ref = pn.reference_train(spec, batch, 8, plan.reference_microbatches, opt)
            rows.append({"knobs": c.knobs.label(), "predicted ms": round(c.step * 1e3, 2),
                         "measured ms": round(statistics.median(got.step_times[2:]) * 1e3, 2),
                         "equals reference_train": _equal(got, ref)})
    rho = spearman([x["predicted ms"] for x in rows], [x["measured ms"] for x in rows])
    out = {"case": "TinyGPT dim 64, 4 CPU workers, profiled", "candidates": len(rows),
           "spearman rho": round(rho, 3),
           "equal to one process": sum(x["equals reference_train"] for x in rows),
           "rows": rows, "search s": round(r.seconds["total"], 1)}
    print(json.dumps(out, indent=1), flush=True)
    return out


def published(keys=("megatron-1.7b", "megatron-3.6b", "megatron-7.5b", "megatron-18.4b",
                    "megatron-39.1b")) -> list[dict]:
    from published import RUNS, model_of
    rows = []
    for key in keys:
        run = RUNS[key]
        p = run.parallel
        model, batch, _, _ = model_of(run)
        cp = p.get("cp", 1)
        devices = p["dp"] * p["tp"] * p["pp"] * cp
        memory = pn.MIXED_PRECISION_ADAM
        sched = Schedule.ONE_F_ONE_B if p["pp"] > 1 else Schedule.NONE
        zero = 3 if run.unit == "tokens/s/GPU" else 0     # FSDP, or Megatron's DDP
        theirs = Knobs(p["pp"], p["tp"], p["dp"], zero, sched, p["micro"],
                       p["pp"] if p["recompute"] is True else 0, False, cp=cp)
        pin = {k: getattr(theirs, k) for k in ("pp", "tp", "dp", "zero", "microbatches",
                                                "recompute", "sp", "cp")}
        pin["schedule"] = str(theirs.schedule)
        pin["float8"] = False   # the runs multiplied in 16 bits (and A100s have no FP8)
        pin["every"] = 1        # and recomputed every layer
        kw = dict(hardware=run.gpu, memory=memory, progress=False)
        t0 = time.perf_counter()
        found = pn.search(model, batch, devices, top=2, budget=60, **kw)
        search_s = time.perf_counter() - t0
        ref = pn.search(model, batch, devices, top=1, pin=pin, **kw)
        best, pub = found.best, ref.best
        row = {"run": run.name, "search s": round(search_s, 1), "candidates": found.explored,
               "published knobs": theirs.label(),
               "published predicted tok/s/GPU": pub and round(pub.tokens_per_s),
               "best knobs": best and best.knobs.label(),
               "best predicted tok/s/GPU": best and round(best.tokens_per_s),
               "best / published": best and pub and round(best.tokens_per_s
                                                           / pub.tokens_per_s, 3),
               "knobs that differ": best and pub and {
                   k: [v, getattr(best.knobs, k)] for k, v in pub.knobs.as_dict().items()
                   if best.knobs.as_dict()[k] != v}}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    return rows


def published_cp() -> list[dict]:
    """torchtitan's Table 2 (Llama 3.1 8B on 8 H100, FSDP x CP at 32k-256k tokens): the
    search unpinned against the published configuration priced under the same model."""
    from published import CONTEXT
    return published(tuple(CONTEXT))


def verify() -> dict:
    model, batch = llama(LLAMA3["70b"], 256, seq=4096)
    pin = {"pp": 4, "tp": 4, "zero": 3, "schedule": "dualpipev", "microbatches": 32,
           "recompute": 0, "sp": True}
    memory = pn.MemorySettings(param_bytes=2, grad_bytes=2, optim_bytes=12)
    r = pn.search(model, batch, 128, "H100", pin=pin, top=1, memory=memory, progress=False)
    best = r.best
    row = {"case": "verify one 70B candidate on 128 H100", "candidate": best.knobs.label(),
           **{f"{k} s": round(v, 1) for k, v in r.seconds.items()},
           "step s": round(best.step, 3), "peak GiB": round(best.peak / 2**30, 2)}
    print(json.dumps(row, indent=1), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="all",
                    choices=["all", "scale", "accuracy", "accuracy-moe", "accuracy-cp", "ranking",
                             "published-cp",
                             "published", "verify"])
    args = ap.parse_args()
    for name, fn in (("accuracy", accuracy), ("accuracy-moe", accuracy_moe),
                     ("accuracy-cp", accuracy_cp),
                     ("ranking", ranking), ("published", published),
                     ("published-cp", published_cp),
                     ("scale", scale), ("verify", verify)):
        if args.case in ("all", name):
            fn()


if __name__ == "__main__":
    main()
