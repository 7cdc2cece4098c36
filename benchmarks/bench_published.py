"""The analytic cost model against published, measured training throughputs.

Each case builds the published model on the meta device (exact shapes), compiles a
piper_nb program close to the published parallel setup, simulates it with
`pn.CostModel.analytic` on the published GPU, and compares the predicted throughput with
the published one (ratio = predicted / measured). The model's constants are the shipped
ones of that GPU (`pn.sim.HARDWARE`: A100 for Megatron's DGX A100, H100-96GB for
torchtitan's Grand Teton H100s), nothing tuned per case or passed from here
(`tests/sim/test_gpus.py` checks).

Plans are compiled with `precision="bf16"` (the published runs trained in 16-bit mixed
precision): bf16 parameters and activations, gradients reduced in the published run's
dtype (`reduce_dtype`), and matmuls priced at the bf16 peak. A second message variant
("fp32 messages") doubles every collective's bytes, to show what the precision is worth.
Corrections applied, all explicit below and in docs/analytic_model.md:
- `--layers N` models N/2 and N decoder layers (same per-layer shapes) instead of all of
  them and extrapolates the step time linearly in layers: see `scaled_step` (default:
  all layers, about 3-4 min on CPU).

Cases 3-5 plan torchtitan's tensor-parallel runs (70B FSDP 32 x TP 8 on 256 GPUs, 405B
FSDP 8 x TP 8 x PP 8 on 512 under 1F1B and interleaved) without and with sequence
parallelism, and report throughput and memory ratios, with the seconds each plan takes to
compile and simulate (`--case tp`). The 8B runs' peaks (FSDP on 8 and 128 GPUs) print
with no layer, one in four and every layer recomputed (`--case memory`).

Megatron's rows 2 and 3 (3.6 B at TP 2, 7.5 B at TP 4, `--case megatron` with row 1) use
Megatron's own layer (`pn.models.MegatronGPT`) with tensor parallelism.

Run: .venv/bin/python benchmarks/bench_published.py [--case megatron|torchtitan|tp|all]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
import transformers

import piper_nb as pn
from piper_nb.sim.cost import HARDWARE
from piper_nb.sim.flops import region_flops


def ring_links(hw, group: int, scale: dict, inter: bool) -> dict:
    """`CostModel.links` that reproduce the analytic ring formula for one group size,
    with the bytes of each collective kind scaled by scale[kind] (2.0: 4-byte elements
    where the plan has 2-byte ones). Links are latency + full bytes / bandwidth, so the
    ring's step count and (n-1)/n factor are folded into them."""
    lat = hw.ib_latency if inter else hw.nvlink_latency
    bw = hw.ib_bandwidth if inter else hw.nvlink_bandwidth
    n = group
    out = {}
    for kind, s in scale.items():
        steps, factor = ((2 * (n - 1), 2 * (n - 1) / n) if kind == "ALL_REDUCE"
                         else (n - 1, (n - 1) / n))
        out[(kind, n)] = (steps * lat, bw / (factor * s))
    return out


def build_and_plan(case: dict, layers: int):
    cfg = case["config"](layers)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = case["model"](cfg)
    ids = torch.zeros(case["local_batch"] * case["dp"], case["seq"], dtype=torch.long,
                      device="meta")
    devices = list(range(case["dp"]))
    program = [pn.place({"PP": 0}, devices),
               pn.replicate({}, devices, zero=case["zero"]),
               pn.split({}, "MB", case["microbatches"])]
    every = case["recompute"]   # True: every layer; k: every k-th layer; False: none
    if every is True:
        program.append(pn.recompute({"AC": 1}))
    elif every:
        program += [pn.recompute({"AC": 1, "L": i}) for i in range(0, layers, every)]
    plan = pn.compile(pn.annotate(model, case["annotations"](layers)), program, (ids, ids),
                      precision="bf16", reduce_dtype=case["reduce_dtype"])
    return plan, time.perf_counter() - t0


COLLECTIVES = ("ALL_REDUCE", "ALL_GATHER", "REDUCE_SCATTER")
# Megatron-LM runs fused kernels (scale-mask-softmax, bias-GeLU, bias-dropout-add): its
# cases are priced eager and, as what its runs did, with the element-wise work fused
FUSED = "fused kernels (compiled=True)"


def simulate(case: dict, layers: int) -> dict:
    """Step time (s) per message bytes (as the plan has them, or fp32) for one compiled
    plan, with the shipped constants of the case's GPU (`pn.sim.HARDWARE`), nothing else."""
    plan, compile_s = build_and_plan(case, layers)
    out = {"compile_s": compile_s, "regions": len(plan.regions),
           # forward FLOPs one device runs per step (FlopCounterMode, modelled layers)
           "fwd_flops_per_device": sum(region_flops(plan).values()) * case["microbatches"]}
    t0 = time.perf_counter()
    hw = HARDWARE[case["gpu"]]
    base = pn.CostModel.analytic(plan, hw)
    for as_published in (True, False):
        scale = {k: 1.0 if as_published else 2.0 for k in COLLECTIVES}
        cost = dataclasses.replace(base, links=ring_links(hw, case["dp"], scale,
                                                          inter=case["dp"] > hw.node_size))
        sim = pn.simulate(plan, cost)
        out[("bf16 plan" if as_published else "fp32",)] = sim.step_time
    if case.get("fused"):
        fused = pn.CostModel.analytic(plan, hw, compiled=True)
        out[(FUSED,)] = pn.simulate(plan, dataclasses.replace(fused, links=ring_links(
            hw, case["dp"], dict.fromkeys(COLLECTIVES, 1.0), inter=case["dp"] > hw.node_size))
        ).step_time
    out["sim_s"] = time.perf_counter() - t0
    return out


def scaled_step(case: dict, layers: int) -> dict:
    """Step times of the full model. With layers < full: simulate layers/2 and layers
    (same per-layer shapes), fit t(L) = a + b L per variant, and extrapolate to full."""
    full = case["layers"]
    if layers >= full:
        r = simulate(case, full)
        r["modelled_layers"] = full
        return r
    lo, hi = max(1, layers // 2), layers
    a, b = simulate(case, lo), simulate(case, hi)
    r = dict(b)
    for k in b:
        if isinstance(k, tuple):
            r[k] = b[k] + (b[k] - a[k]) / (hi - lo) * (full - hi)
    r["modelled_layers"] = f"{lo},{hi} -> {full} (linear in layers)"
    return r


# ---- case 1: Megatron-LM (Narayanan et al. 2021), Table 1, first row -----------------
def _gpt_config(layers):
    return transformers.GPT2Config(n_embd=2304, n_layer=layers, n_head=24, n_positions=2048,
                                   vocab_size=51200, attn_implementation="eager")


def _gpt_ann(layers):
    return {"transformer.wte": {"PP": 0}, "transformer.wpe": {"PP": 0},
            **{f"transformer.h.{i}": {"PP": 0, "AC": 1, "L": i} for i in range(layers)},
            "transformer.ln_f": {"PP": 0}, "lm_head": {"PP": 0}}


def megatron_flops(B, s, L, h, V):
    """The paper's FLOPs per iteration (its eq. 3; counts the recompute forward)."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


MEGATRON = {
    "name": "GPT 1.7B, 32x A100 (DGX A100, HDR IB), DP=32, TP=1, PP=1",
    "source": "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU "
              "Clusters Using Megatron-LM' (SC21, arXiv:2104.04473), Table 1 row 1: 1.7B, "
              "24 heads, hidden 2304, 24 layers, TP 1, PP 1, 32 GPUs, batch 512, "
              "137 TFLOP/s per GPU (44% of peak)",
    "gpu": "A100", "layers": 24, "seq": 2048, "dp": 32, "local_batch": 16, "microbatches": 4,
    "zero": 0, "recompute": True, "fused": True,
    "config": _gpt_config, "model": transformers.GPT2LMHeadModel, "annotations": _gpt_ann,
    # Megatron's fp16 mixed precision all-reduces fp16 gradients (2 bytes)
    "reduce_dtype": "bf16",
    "measured_tflops_per_gpu": 137.0,
}


# ---- case 2: torchtitan (Liang et al. 2024), Table 1, FSDP row ------------------------
def _llama_config(layers):
    return transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                    num_hidden_layers=layers, num_attention_heads=32,
                                    num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=8192, attn_implementation="sdpa")


def _llama_ann(layers):
    return {"model.embed_tokens": {"PP": 0},
            **{f"model.layers.{i}": {"PP": 0, "AC": 1, "L": i} for i in range(layers)},
            "model.norm": {"PP": 0}, "lm_head": {"PP": 0}}


TORCHTITAN = {
    "name": "Llama 3.1 8B, 8x H100 (one Grand Teton node), FSDP (ZeRO-3), local batch 2",
    "source": "Liang et al. 2024, 'TorchTitan: One-stop PyTorch native solution for "
              "production ready LLM pre-training' (arXiv:2410.06511, ICLR 2025), Table 1 "
              "(1D parallelism, Llama 3.1 8B, 8 GPUs, local batch 2, global 16, selective AC): "
              "FSDP 5,762 tokens/s/GPU (also docs/performance.md in pytorch/torchtitan)",
    "gpu": "H100-96GB", "layers": 32, "seq": 8192, "dp": 8, "local_batch": 2,
    "microbatches": 1,
    # torchtitan's selective op AC (its default for Llama 3 8B) saves every compute op's
    # output except every second matmul of a block: wk, wo and w3 are recomputed, 80 of a
    # layer's 285 M multiply-adds per token (28%, by piper_nb's count: attention non-causal);
    # modelled as one layer in four recomputed whole (pn.recompute): 25% of the forward
    "zero": 3, "recompute": 4,
    "config": _llama_config, "model": transformers.LlamaForCausalLM, "annotations": _llama_ann,
    # FSDP2 mixed precision in torchtitan: params all-gathered in bf16, grads reduced in fp32
    "reduce_dtype": "fp32",
    "measured_tokens_per_gpu_s": 5762.0,
}


# ---- cases 3-5: torchtitan's 2D and 3D runs, with tensor parallelism ------------------
# benchmarks/llama3_h100_202412_torchtitan.md in pytorch/torchtitan (H100 96 GB HBM2e, 8 per
# host on NVLink, 400 Gb/s RDMA per GPU, sequence 8192, full AC, torch.compile + Float8):
# Table 4, Llama 3.1 70B, FSDP 32 x TP 8 on 256 GPUs, local batch 16: 829 tokens/s/GPU,
# 71.9 GiB; Table 5, 405B, FSDP 8 x TP 8 x PP 8 on 512 GPUs, local batch 32: 1F1B 100
# tokens/s/GPU and 82.5 GiB, interleaved 128 and 72.7 GiB. piper_nb has no Float8 yet (and
# counts bytes in use, where the published figures are the allocator's reserve), so these
# ratios say how far the bf16 plan, without and with sequence parallelism, is from the
# published one, whatever they are. pn.models.Llama is
# Llama 3's architecture (tests/models/test_llama.py), captured by torch.fx in seconds.
TP_CASES = {
    "70b-fsdp32-tp8": dict(name="Llama 3.1 70B, 256x H100, FSDP 32 x TP 8, local batch 16",
                           layers=80, dims=dict(dim=8192, heads=64, kv_heads=8, hidden=28672),
                           dp=32, tp=8, pp=1, local=16, micro=1, schedule=None,
                           tokens_per_gpu_s=829.0, gib=71.9),
    "405b-1f1b": dict(name="Llama 3.1 405B, 512x H100, FSDP 8 x TP 8 x PP 8, 1F1B",
                      layers=126, dims=dict(dim=16384, heads=128, kv_heads=8, hidden=53248),
                      dp=8, tp=8, pp=8, local=32, micro=32, schedule="1f1b",
                      tokens_per_gpu_s=100.0, gib=82.5),
    "405b-interleaved": dict(name="Llama 3.1 405B, 512x H100, FSDP 8 x TP 8 x PP 8, "
                             "interleaved 1F1B (2 stages per rank)",
                             layers=126, dims=dict(dim=16384, heads=128, kv_heads=8, hidden=53248),
                             dp=8, tp=8, pp=8, local=32, micro=32, schedule="interleaved",
                             tokens_per_gpu_s=128.0, gib=72.7),
}


def tp_program(c: dict, layers: int, sp: bool = False) -> tuple[dict, list]:
    """(annotation, program): devices numbered TP innermost, then PP, then DP (torchtitan's
    and Megatron's order); each stage replicated over its DP replicas with ZeRO-3 (FSDP),
    each replica's device widened into its TP group; every layer a region of its own,
    recomputed in full (torchtitan's full AC wraps each transformer block)."""
    dp, tp, pp = c["dp"], c["tp"], c["pp"]
    lead = lambda r, k: (k * pp + r) * tp   # noqa: E731 - first device of rank r, replica k
    stages = pp if c["schedule"] in (None, "1f1b") else 2 * pp
    per = -(-layers // stages)
    ann = {"embed": {"PP": 0}, "head": {"PP": stages - 1}} | {   # a region per layer, as
        f"blocks.{i}": {"PP": min(i // per, stages - 1), "L": i, "AC": 1}   # torchtitan wraps
        for i in range(layers)}                                 # each block (FSDP, AC)
    program = []
    for s in range(stages):
        devs = [lead(s % pp, k) for k in range(dp)]
        # torchtitan's default: no resharding after the forward under PP (one gather of a
        # stage's weights a step), and gradients reduced once, after the last microbatch
        program += [pn.place({"PP": s}, devs),
                    pn.replicate({"PP": s}, devs, zero=3, reshard=pp == 1)]
    program.append(pn.tensor_parallel({"PP": "*"}, [[lead(r, k) + t for t in range(tp)]
                                                    for k in range(dp) for r in range(pp)],
                                      plan=pn.models.Llama.tp_plan, sequence_parallel=sp))
    if c["schedule"] is None:
        program.append(pn.split({}, "MB", c["micro"]))
    elif c["schedule"] == "1f1b":
        program += pn.schedules.one_f_one_b(pp, c["micro"])
    else:
        program += pn.schedules.interleaved_1f1b(pp, c["micro"], chunks=2)
    return ann, [*program, pn.recompute({"AC": 1})]


def run_tp_case(key: str, sp: bool = False) -> dict:
    c, seq = TP_CASES[key], 8192
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = pn.models.Llama(vocab=128256, layers=c["layers"], seq=seq, attention="flash",
                                **c["dims"])
    ids = torch.zeros(c["dp"] * c["local"], seq, dtype=torch.long, device="meta")
    ann, program = tp_program(c, c["layers"], sp)
    t1 = time.perf_counter()
    plan = pn.compile(pn.annotate(model, ann), program, (ids, ids), precision="bf16")
    t2 = time.perf_counter()
    trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100-96GB"),
                        memory=pn.MemorySettings(param_bytes=2, grad_bytes=2, optim_bytes=12))
    t3 = time.perf_counter()
    gpus = c["dp"] * c["tp"] * c["pp"]
    rate = c["dp"] * c["local"] * seq / trace.step_time / gpus
    gib = max(trace.peak_memory.values()) / 2**30
    return {"case": c["name"], "world": plan.world, "at the peak, GiB": peak_kinds(trace),
            "build_s": round(t1 - t0, 1),
            "compile_s": round(t2 - t1, 1), "simulate_s": round(t3 - t2, 1),
            "tokens/s/GPU": round(rate, 1), "measured tokens/s/GPU": c["tokens_per_gpu_s"],
            "predicted/measured": round(rate / c["tokens_per_gpu_s"], 3),
            "peak GiB": round(gib, 1), "measured GiB": c["gib"],
            "peak predicted/measured": round(gib / c["gib"], 2), "sequence_parallel": sp}


def peak_kinds(trace) -> dict:
    """The memory kinds held at the highest sample of the highest device, in GiB."""
    top = max(trace.memory, key=lambda m: m.params + m.grads + m.optim + m.activations
              + m.buffers)
    return {k: round(getattr(top, k) / 2**30, 1)
            for k in ("params", "grads", "optim", "activations", "buffers")}


# ---- the 8B runs' memory: torchtitan Table 1 (8 GPUs) and Table 3 (128 GPUs) -------------
# FSDP over every GPU, local batch 2, sequence 8192, selective op AC, 82.4 and 67.0 GiB.
# pn.models.Llama with flash attention (as torchtitan's sdpa runs); piper_nb has no op-level
# AC, so the plan recomputes no layer and every layer (bounds around torchtitan's, which
# saves all but every second matmul's output), one layer in four as the throughput case,
# and every layer's attention (Megatron's selective recompute, `mode="selective"`).
MEMORY_8B = {"8b-fsdp8": dict(gpus=8, gib=82.4), "8b-fsdp128": dict(gpus=128, gib=67.0)}
_8B = dict(dim=4096, heads=32, kv_heads=8, hidden=14336)


def run_8b_memory(key: str, every: int | str | None) -> dict:
    """Peak memory of the 8B FSDP run, recomputing every `every`-th layer (None: none;
    "selective": every layer's attention)."""
    c, seq, layers = MEMORY_8B[key], 8192, 32
    with torch.device("meta"):
        model = pn.models.Llama(vocab=128256, layers=layers, seq=seq, attention="flash", **_8B)
    ids = torch.zeros(c["gpus"] * 2, seq, dtype=torch.long, device="meta")
    devices = list(range(c["gpus"]))
    program = [pn.place({}, devices), pn.replicate({}, devices, zero=3)]
    if every == "selective":
        program.append(pn.recompute({"AC": 1}, mode="selective"))
    elif every:
        program += [pn.recompute({"AC": 1, "L": i}) for i in range(0, layers, every)]
    ann = {"embed": {"PP": 0}, "head": {"PP": 0}} | {
        f"blocks.{i}": {"PP": 0, "AC": 1, "L": i} for i in range(layers)}
    t0 = time.perf_counter()
    plan = pn.compile(pn.annotate(model, ann), program, (ids, ids), precision="bf16",
                      reduce_dtype="fp32")
    trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100-96GB"),
                        memory=pn.MemorySettings(param_bytes=2, grad_bytes=2, optim_bytes=12))
    gib = max(trace.peak_memory.values()) / 2**30
    ac = ("none" if not every else "full" if every == 1 else "selective (attention)"
          if every == "selective" else f"every {every}th layer")
    return {"case": f"Llama 3.1 8B, {c['gpus']}x H100, FSDP {c['gpus']}, local batch 2",
            "recompute": ac, "compile+simulate_s": round(time.perf_counter() - t0, 1),
            "peak GiB": round(gib, 1), "measured GiB": c["gib"],
            "peak predicted/measured": round(gib / c["gib"], 2)}


# ---- Megatron-LM SC'21 Table 1, rows 2 and 3: tensor parallelism inside a node ----------
# 3.6 B (hidden 3072, 32 heads, 30 layers) on 64 A100s as TP 2 x DP 32 at 138 TFLOP/s per
# GPU, 7.5 B (4096, 32, 36) on 128 as TP 4 x DP 32 at 142; batch 512, sequence 2048,
# activations recomputed, by the paper's FLOP count (eq. 3). Planned as pn.models.MegatronGPT
# (Megatron's layer, with its TP plan) with row 1's data parallelism: 16 sequences per
# replica in 4 microbatches, gradients all-reduced in 2 bytes, every layer recomputed. The
# DP all-reduce crosses nodes: priced by today's ring model over InfiniBand (the
# collectives issue replaces it).
MEGATRON_TP = {
    "megatron-3.6b": dict(name="GPT 3.6B, 64x A100, DP 32 x TP 2", dim=3072, heads=32,
                          layers=30, tp=2, tflops=138.0),
    "megatron-7.5b": dict(name="GPT 7.5B, 128x A100, DP 32 x TP 4", dim=4096, heads=32,
                          layers=36, tp=4, tflops=142.0),
}


def run_megatron_tp(key: str) -> dict:
    c, seq, dp, local, vocab = MEGATRON_TP[key], 2048, 32, 16, 51200
    tp, layers = c["tp"], c["layers"]
    with torch.device("meta"):
        model = pn.models.MegatronGPT(vocab=vocab, dim=c["dim"], layers=layers,
                                      heads=c["heads"], seq=seq)
    ids = torch.zeros(dp * local, seq, dtype=torch.long, device="meta")
    leads = [k * tp for k in range(dp)]
    ann = {"embed": {"PP": 0}, "head": {"PP": 0}} | {
        f"blocks.{i}": {"PP": 0, "AC": 1, "L": i} for i in range(layers)}
    program = [pn.place({}, leads), pn.replicate({}, leads, zero=0),
               pn.tensor_parallel({}, [[lead + t for t in range(tp)] for lead in leads]),
               pn.split({}, "MB", 4), pn.recompute({"AC": 1})]
    t0 = time.perf_counter()
    plan = pn.compile(pn.annotate(model, ann), program, (ids, ids), precision="bf16",
                      reduce_dtype="bf16")
    out = {"case": c["name"], "unit": "TFLOP/s/GPU (paper's FLOP count)",
           "measured": c["tflops"], "predicted": {}}
    for variant, compiled in (("bf16 plan messages", False), (FUSED, True)):
        trace = pn.simulate(plan, pn.CostModel.analytic(plan, "A100", compiled=compiled))
        rate = megatron_flops(dp * local, seq, layers, c["dim"], vocab) / (
            trace.step_time * dp * tp) / 1e12
        out["predicted"][variant] = {"step_s": round(trace.step_time, 4),
                                     "throughput": round(rate, 1),
                                     "predicted/measured": round(rate / c["tflops"], 3)}
    out["compile+simulate_s"] = round(time.perf_counter() - t0, 1)
    return out


def run_case(key: str, layers: int | None) -> dict | list[dict]:
    if key in TP_CASES:
        return [run_tp_case(key, sp) for sp in (False, True)]
    if key in MEGATRON_TP:
        return run_megatron_tp(key)
    if key in MEMORY_8B:
        return [run_8b_memory(key, every) for every in (None, 4, "selective", 1)]
    case = {"megatron": MEGATRON, "torchtitan": TORCHTITAN}[key]
    r = scaled_step(case, layers or case["layers"])
    out = {"case": case["name"], "source": case["source"], "gpu": case["gpu"],
           "modelled_layers": r["modelled_layers"], "compile_s": r["compile_s"],
           "sim_s": r["sim_s"], "regions": r["regions"],
           "fwd_flops_per_device": r["fwd_flops_per_device"]}
    if key == "megatron":
        F = megatron_flops(case["local_batch"] * case["dp"], case["seq"], case["layers"],
                           2304, 51200)
        measured = case["measured_tflops_per_gpu"]
        # the paper's F counts 4 forwards (F, recompute F, 2F of backward) on all devices
        out.update(paper_flops=F, unit="TFLOP/s/GPU (paper's FLOP count)",
                   counted_over_paper_fwd_flops=r["fwd_flops_per_device"] * case["dp"] * 4 / F,
                   measured_step_s=F / (measured * 1e12 * case["dp"]))
        rate = lambda t: F / (t * case["dp"]) / 1e12
    else:
        tokens = case["local_batch"] * case["seq"]
        measured = case["measured_tokens_per_gpu_s"]
        out.update(unit="tokens/s/GPU", measured_step_s=tokens / measured)
        rate = lambda t: tokens / t
    out["measured"] = measured
    out["predicted"] = {}
    for k, t in r.items():
        if isinstance(k, tuple):
            out["predicted"][k[0] if k[0] == FUSED else f"{k[0]} messages"] = {
                "step_s": round(t, 4), "throughput": round(rate(t), 1),
                "predicted/measured": round(rate(t) / measured, 3)}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="all",
                    choices=["all", "megatron", "torchtitan", "tp", "memory", *TP_CASES,
                             *MEMORY_8B, *MEGATRON_TP])
    ap.add_argument("--layers", type=int, default=None,
                    help="model this many layers (and half as many) and extrapolate linearly")
    args = ap.parse_args()
    keys = (["megatron", *MEGATRON_TP, "torchtitan", *TP_CASES, *MEMORY_8B]
            if args.case == "all" else
            ["megatron", *MEGATRON_TP] if args.case == "megatron" else
            list(TP_CASES) if args.case == "tp" else
            list(MEMORY_8B) if args.case == "memory" else [args.case])
    results, peaks = [], []
    for k in keys:
        out = run_case(k, args.layers)
        if isinstance(out, list):
            peaks += out
        else:
            results.append(out)
        print(json.dumps(out, indent=1, default=str), flush=True)
    if peaks:
        print("| case | plan | peak GiB | published GiB | predicted / published |")
        print("|---|---|---|---|---|")
        for o in peaks:
            plan = (f"recompute {o['recompute']}" if "recompute" in o else
                    "TP + SP, full AC" if o["sequence_parallel"] else "TP, full AC")
            print(f"| {o['case']} | {plan} | {o['peak GiB']} | {o['measured GiB']} | "
                  f"{o['peak predicted/measured']} |")
    print("| case | unit | measured | variant | predicted | predicted / measured |")
    print("|---|---|---|---|---|---|")
    for o in results:
        for v, p in o.get("predicted", {}).items():
            print(f"| {o['case']} | {o['unit']} | {o['measured']} | {v} | "
                  f"{p['throughput']} | {p['predicted/measured']} |")


if __name__ == "__main__":
    main()
