"""The published training runs the analytic model is checked against, each as the paper
configured it and as a piper_nb plan (`bench_published.py` prices and prints them).

Megatron-LM (Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", arXiv:2104.04473), Table 1: GPT on DGX A100 nodes (8 A100 80
GB on NVLink, 8 HDR InfiniBand adapters), sequence 2048, vocabulary 51,200, fp16 mixed
precision, every layer recomputed, throughput by the paper's FLOP count (its eq. 3).
Planned as `pn.models.MegatronGPT` (Megatron's layer and its TP plan), devices numbered TP
innermost, then PP, then DP (Megatron's order: a TP group is one node), the gradients
all-reduced in 2 bytes, microbatches of 4 sequences (the paper does not give them).

torchtitan (Liang et al. 2024, arXiv:2410.06511; benchmarks/llama3_h100_202412_torchtitan.md
in pytorch/torchtitan): Llama 3.1 on Grand Teton H100 nodes (8 H100 96 GB HBM2e on
NVLink, a 400 Gb/s adapter per GPU), sequence 8192, FSDP2 (bf16 gathers, fp32
reductions). Table 1: 8B FSDP on 8 GPUs, local batch 2, selective op AC, 5,762
tokens/s/GPU, 82.4 GiB; Table 3: the same on 128 GPUs, 5,605, 67.0 GiB; Table 4: 70B FSDP
32 x TP 8, torch.compile + Float8, local batch 16, full AC, 829, 71.9 GiB; Table 5: 405B
FSDP 8 x TP 8 x PP 8, compile + Float8 + AsyncTP, local batch 32, full AC, 1F1B 100 /
82.5 GiB, interleaved 128 / 72.7 GiB. Planned as `pn.models.Llama` with flash attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import piper_nb as pn

SEQ_MEGATRON, VOCAB_MEGATRON = 2048, 51200
SEQ_LLAMA, VOCAB_LLAMA = 8192, 128256
# FSDP2's mixed precision as torchtitan runs it: bf16 parameters and gradients for compute,
# 12 bytes a parameter of fp32 master weights and Adam moments, all sharded
LLAMA_MEMORY = pn.MemorySettings(param_bytes=2, grad_bytes=2, optim_bytes=12)


@dataclass(frozen=True)
class Run:
    """One published run: what it measured and how piper_nb plans it."""

    key: str
    name: str
    gpu: str                   # a name in pn.sim.HARDWARE
    unit: str                  # "TFLOP/s/GPU" (the paper's count) or "tokens/s/GPU"
    measured: float
    gib: float | None          # published peak memory, GiB (None: not published)
    compiled: bool             # the run's element-wise work fused by torch.compile
    fp8: bool                  # Float8 linears (torchao)
    dims: dict                 # the model's shape
    parallel: dict             # dp, tp, pp, local (sequences per replica), micro, schedule,
                               # recompute (True: every layer; k: every k-th; "selective"),
                               # and optionally cp (context-parallel degree), seq (tokens),
                               # rotate (the context's keys and values: "all_gather", "p2p")
    note: str = ""


# Megatron's runs are eager PyTorch with a few hand-fused kernels (scale-mask-softmax,
# bias-GeLU, bias-dropout-add, apex's LayerNorm), each two eager kernels made one, not every
# run of element-wise work between matmuls fused as torch.compile does: priced eager
MEGATRON = {k: Run(k, name, "A100", "TFLOP/s/GPU", tflops, None, False, False,
                   dict(dim=dim, heads=heads, layers=layers),
                   dict(dp=gpus // (tp * pp), tp=tp, pp=pp, local=batch * tp * pp // gpus,
                        micro=batch * tp * pp // gpus // 4,
                        schedule="1f1b" if pp > 1 else None, recompute=True))
            for k, name, dim, heads, layers, tp, pp, gpus, batch, tflops in (
                ("megatron-1.7b", "GPT 1.7B, 32x A100, DP 32", 2304, 24, 24, 1, 1, 32, 512, 137.0),
                ("megatron-3.6b", "GPT 3.6B, 64x A100, DP 32 x TP 2", 3072, 32, 30, 2, 1, 64, 512,
                 138.0),
                ("megatron-7.5b", "GPT 7.5B, 128x A100, DP 32 x TP 4", 4096, 32, 36, 4, 1, 128,
                 512, 142.0),
                ("megatron-18.4b", "GPT 18.4B, 256x A100, DP 32 x TP 8", 6144, 48, 40, 8, 1, 256,
                 1024, 135.0),
                ("megatron-39.1b", "GPT 39.1B, 512x A100, DP 32 x TP 8 x PP 2 (1F1B)", 8192, 64,
                 48, 8, 2, 512, 1536, 138.0))}

_8B = dict(dim=4096, heads=32, kv_heads=8, hidden=14336, layers=32)
_70B = dict(dim=8192, heads=64, kv_heads=8, hidden=28672, layers=80)
_405B = dict(dim=16384, heads=128, kv_heads=8, hidden=53248, layers=126)
_SAC = ("torchtitan's selective op AC saves every op's output but every second matmul's; "
        "planned as one layer in four recomputed whole (25% of the forward again, against "
        "its 28%)")
# torchtitan at the benchmark's commit (9dec370) splits a pipelined batch into as many
# microbatches as pipeline ranks unless told otherwise (`build_pipeline_schedule`:
# `pipeline_parallel_microbatches or pipeline_parallel_degree`), and the table gives no
# count: 8 microbatches of 4 sequences, under 1F1B and interleaved alike
_PP_MICRO = "microbatches: torchtitan's default, one per PP rank; AsyncTP not modelled"
TORCHTITAN = {
    "8b-fsdp8": Run("8b-fsdp8", "Llama 3.1 8B, 8x H100, FSDP 8, local batch 2", "H100-96GB",
                    "tokens/s/GPU", 5762.0, 82.4, False, False, _8B,
                    dict(dp=8, tp=1, pp=1, local=2, micro=1, schedule=None, recompute=4), _SAC),
    "8b-fsdp128": Run("8b-fsdp128", "Llama 3.1 8B, 128x H100, FSDP 128, local batch 2",
                      "H100-96GB", "tokens/s/GPU", 5605.0, 67.0, False, False, _8B,
                      dict(dp=128, tp=1, pp=1, local=2, micro=1, schedule=None, recompute=4),
                      _SAC),
    "70b-fsdp32-tp8": Run("70b-fsdp32-tp8", "Llama 3.1 70B, 256x H100, FSDP 32 x TP 8 + SP",
                          "H100-96GB", "tokens/s/GPU", 829.0, 71.9, True, True, _70B,
                          dict(dp=32, tp=8, pp=1, local=16, micro=1, schedule=None,
                               recompute=True)),
    "405b-1f1b": Run("405b-1f1b", "Llama 3.1 405B, 512x H100, FSDP 8 x TP 8 x PP 8 + SP, 1F1B",
                     "H100-96GB", "tokens/s/GPU", 100.0, 82.5, True, True, _405B,
                     dict(dp=8, tp=8, pp=8, local=32, micro=8, schedule="1f1b",
                          recompute=True), _PP_MICRO),
    "405b-interleaved": Run("405b-interleaved", "Llama 3.1 405B, 512x H100, FSDP 8 x TP 8 x "
                            "PP 8 + SP, interleaved 1F1B (2 stages a rank)", "H100-96GB",
                            "tokens/s/GPU", 128.0, 72.7, True, True, _405B,
                            dict(dp=8, tp=8, pp=8, local=32, micro=8, schedule="interleaved",
                                 recompute=True), _PP_MICRO),
}
# torchtitan's Table 2: FSDP x CP on 8 H100, torch.compile + Float8, local batch 1 (a
# sequence per data-parallel replica, cut over its CP group), full AC; FSDP shards over all
# 8 (its dp_shard_cp mesh). Ring attention with the all-gather rotation (torchtitan's
# default), priced as flash kernels over a device's queries and the whole sequence's keys
# (half the blocks' work under the causal mask), each layer recomputed as one unit
_CP_NOTE = ("ring attention priced as one flash kernel per layer; the keys' and values' "
            "all-gather waited for, not overlapped block by block")
CONTEXT = {f"8b-fsdp{8 // cp}-cp{cp}": Run(
    f"8b-fsdp{8 // cp}-cp{cp}", f"Llama 3.1 8B, 8x H100, FSDP {8 // cp} x CP {cp}, "
    f"{seq // 1024}k tokens", "H100-96GB", "tokens/s/GPU", tps, gib, True, True, _8B,
    dict(dp=8 // cp, tp=1, pp=1, cp=cp, seq=seq, local=1, micro=1, schedule=None,
         recompute=True), _CP_NOTE)
    for cp, seq, tps, gib in ((1, 32768, 3890.0, 83.9), (2, 65536, 2540.0, 84.2),
                              (4, 131072, 1071.0, 84.0), (8, 262144, 548.0, 84.5))}
# torchtitan's Table 6: 4D on 512 H100 (TP 8 + SP, PP 8 under 1F1B, FSDP x CP over the
# other 8), torch.compile + Float8 + AsyncTP, local batch 8 (8 microbatches of one sequence,
# torchtitan's default of one per PP rank), full AC. The context runs over the TP groups'
# first devices of a stage, FSDP over DP x CP
_4D_NOTE = _CP_NOTE + "; " + _PP_MICRO
CONTEXT.update({f"405b-fsdp{8 // cp}-cp{cp}": Run(
    f"405b-fsdp{8 // cp}-cp{cp}", f"Llama 3.1 405B, 512x H100, FSDP {8 // cp} x CP {cp} x "
    f"TP 8 + SP x PP 8 (1F1B), {seq // 1024}k tokens", "H100-96GB", "tokens/s/GPU", tps, gib,
    True, True, _405B, dict(dp=8 // cp, tp=8, pp=8, cp=cp, seq=seq, local=8, micro=8,
                            schedule="1f1b", recompute=True), _4D_NOTE)
    for cp, seq, tps, gib in ((1, 32768, 76.0, 75.3), (2, 65536, 47.0, 75.9),
                              (4, 131072, 31.0, 77.1), (8, 262144, 16.0, 84.9))})
RUNS = {**MEGATRON, **TORCHTITAN, **CONTEXT}


def megatron_flops(B, s, L, h, V):
    """The paper's FLOPs per iteration (its eq. 3; counts the recompute forward)."""
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def throughput(run: Run, step: float) -> float:
    """The run's throughput for a step of `step` seconds, in its unit."""
    p = run.parallel
    gpus = p["dp"] * p["tp"] * p["pp"] * p.get("cp", 1)
    batch = p["dp"] * p["local"]
    if run.unit == "TFLOP/s/GPU":
        d = run.dims
        return megatron_flops(batch, SEQ_MEGATRON, d["layers"], d["dim"], VOCAB_MEGATRON) / (
            step * gpus) / 1e12
    return batch * p.get("seq", SEQ_LLAMA) / step / gpus


def model_of(run: Run, sequence_parallel: bool = True):
    """(model on meta, its batch, annotation, program) of a run (see the module docstring):
    a region per decoder layer (torchtitan's FSDP and AC unit), stages of equal layers."""
    p, d = run.parallel, run.dims
    with torch.device("meta"):
        if run.unit == "TFLOP/s/GPU":
            model = pn.models.MegatronGPT(vocab=VOCAB_MEGATRON, dim=d["dim"], layers=d["layers"],
                                          heads=d["heads"], seq=SEQ_MEGATRON)
            seq = SEQ_MEGATRON
        else:
            seq = p.get("seq", SEQ_LLAMA)
            model = pn.models.Llama(vocab=VOCAB_LLAMA, seq=seq, attention="flash", **d)
        ids = torch.zeros(p["dp"] * p["local"], seq, dtype=torch.long)
    ann, program = _program(run, sequence_parallel)
    return model, (ids, ids), ann, program


def _program(run: Run, sp: bool) -> tuple[dict, list]:
    p, layers = run.parallel, run.dims["layers"]
    dp, tp, pp, cp = p["dp"], p["tp"], p["pp"], p.get("cp", 1)
    if cp > 1:   # replicas of context groups: FSDP over DP x CP
        dp *= cp
    lead = lambda r, k: (k * pp + r) * tp   # noqa: E731 - first device of rank r, replica k
    stages = 2 * pp if p["schedule"] == "interleaved" else pp
    per = -(-layers // stages)
    ann = {"embed": {"PP": 0}, "head": {"PP": stages - 1}} | {
        f"blocks.{i}": {"PP": min(i // per, stages - 1), "L": i, "AC": 1} for i in range(layers)}
    zero = 3 if run.unit == "tokens/s/GPU" else 0     # FSDP, or Megatron's DDP
    program = []
    for s in range(stages):
        devs = [lead(s % pp, k) for k in range(dp)]
        # torchtitan under PP gathers a stage's weights once a step (no resharding)
        program += [pn.place({"PP": s}, devs),
                    pn.replicate({"PP": s}, devs, zero=zero, reshard=pp == 1 or zero < 3)]
    if cp > 1:   # a stage's consecutive replicas (their TP groups' first devices)
        program.append(pn.context_parallel({}, [[lead(r, k + j) for j in range(cp)]
                                                for r in range(pp) for k in range(0, dp, cp)],
                                           rotate=p.get("rotate", "all_gather")))
    if tp > 1:
        model_plan = pn.models.Llama.tp_plan if run.unit == "tokens/s/GPU" \
            else pn.models.MegatronGPT.tp_plan
        program.append(pn.tensor_parallel({"PP": "*"}, [[lead(r, k) + t for t in range(tp)]
                                                        for k in range(dp) for r in range(pp)],
                                          plan=model_plan, sequence_parallel=sp))
    if p["schedule"] is None:
        program.append(pn.split({}, "MB", p["micro"]))
    elif p["schedule"] == "1f1b":
        program += pn.schedules.one_f_one_b(pp, p["micro"])
    else:
        program += pn.schedules.interleaved_1f1b(pp, p["micro"], chunks=2)
    if run.fp8:   # torchtitan converts the decoder layers' linears, not the output head
        program.append(pn.float8({"AC": 1}))
    every = p["recompute"]
    if every is True:
        program.append(pn.recompute({"AC": 1}))
    elif every == "selective":
        program.append(pn.recompute({"AC": 1}, mode="selective"))
    elif every:
        program += [pn.recompute({"AC": 1, "L": i}) for i in range(0, layers, every)]
    return ann, program


def plan_of(run: Run, sequence_parallel: bool = True):
    """The run's compiled plan: bf16 (the runs' 16-bit mixed precision), gradients reduced
    in fp32 (FSDP2) or 2 bytes (Megatron's fp16 DDP)."""
    model, batch, ann, program = model_of(run, sequence_parallel)
    reduce = "fp32" if run.unit == "tokens/s/GPU" else "bf16"
    return pn.compile(pn.annotate(model, ann), program, batch, precision="bf16",
                      reduce_dtype=reduce)
