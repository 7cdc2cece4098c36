"""Activation bytes per transformer layer: the memory model against Korthikanti et al. 2022.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(MLSys 2023, arXiv:2205.05198), Table 2, count the bytes one GPT layer keeps for its
backward (16-bit activations, 1-byte dropout masks), in units of sbh (s sequence, b
microbatch, h hidden, a heads, t TP degree):

  attention   QKV input 2, Q and K 4, softmax output 2as/h, its dropout mask as/h, the
              dropout output 2as/h and V 2, the output projection's input 2, its dropout
              mask 1                                                    = 11 + 5as/h
  MLP         first linear's input 2, GeLU's input 8, second linear's input 8, mask 1 = 19
  LayerNorms  two inputs                                                = 4
  total       34 + 5as/h; under TP everything but the LayerNorms' inputs, the QKV and first
              linear's inputs and the two dropout masks (10) divides by t.

`pn.models.MegatronLayer` is that layer (pre-LayerNorm, fused QKV, softmax attention with dropout, 4h
GeLU MLP, dropout after the attention and the MLP), so the constants are the paper's but
for the masks: its dropout is `F.dropout`, the one dropout piper_nb shards under TP, which
on CPU and on the meta device multiplies by a noise tensor of the input's dtype and saves
that (2 bytes in bf16, where CUDA's fused kernel saves a 1-byte mask). With m-byte masks
the constants are 32 + 2m + (4 + m)as/h (`closed_form(mask=m)`), and the table gives the
ratio to both. `keep_mask=True` swaps in a dropout that saves a bool mask (1 byte), which
TP refuses in a sharded part (a random op it cannot draw as one process), so only the
cases without TP use it. Causal masking is left out: Megatron's fused masked softmax
saves only its output.

Each case compiles the model on the meta device (nothing allocated) with 2 and 3 layers,
`precision="bf16"`, one microbatch on device 0 (or TP group 0..t-1), simulates it, and takes
the difference of device 0's peak activation bytes: what one more layer costs, as the
memory model predicts it. Ratio = predicted / closed form.

Run: .venv/bin/python benchmarks/bench_layer_memory.py [--breakdown]
"""

from __future__ import annotations

import argparse
import math

import torch

import piper_nb as pn
from piper_nb.models import MegatronGPT

__all__ = ["PUBLISHED", "layer_bytes", "closed_form", "CASES"]

# GPT-3 175B's layer as Korthikanti et al. evaluate it (their Table 3): s 2048, h 12288, a 96
PUBLISHED = dict(s=2048, b=1, h=12288, a=96)


def compile_layers(shape: dict, layers: int, t: int = 1, sp: bool = False,
                   recompute: str | None = None, keep_mask: bool = False):
    """The model with `layers` layers on the meta device, compiled in bf16 on device 0 (TP:
    devices 0..t-1, sequence-parallel when `sp`), one microbatch; every layer recomputed
    in `recompute` mode ("full", "selective") when given."""
    with torch.device("meta"):
        model = MegatronGPT(vocab=64, dim=shape["h"], layers=layers, heads=shape["a"],
                            seq=shape["s"], keep_mask=keep_mask)
    ids = torch.zeros(shape["b"], shape["s"], dtype=torch.long, device="meta")
    ann = {"embed": {"PP": 0}, "head": {"PP": 0},
           **{f"blocks.{i}": {"PP": 0, "AC": 1, "L": i} for i in range(layers)}}
    program = [pn.place({"PP": 0}, [0])]
    if t > 1:
        program.append(pn.tensor_parallel({"PP": 0}, list(range(t)), sequence_parallel=sp))
    if recompute:
        program.append(pn.recompute({"AC": 1}, mode=recompute))
    return pn.compile(pn.annotate(model, ann), program, (ids, ids), loss_fn=model.loss_fn,
                      precision="bf16")


def peak_activations(plan) -> int:
    """Device 0's peak activation bytes over a simulated step."""
    trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"))
    return max(m.activations for m in trace.memory if m.device == 0)


def layer_bytes(shape: dict, t: int = 1, sp: bool = False, recompute: str | None = None,
                keep_mask: bool = False) -> int:
    """Activation bytes one more layer costs on device 0, as the memory model predicts."""
    two, three = (peak_activations(compile_layers(shape, n, t, sp, recompute, keep_mask))
                  for n in (2, 3))
    return three - two


def closed_form(shape: dict, t: int = 1, sp: bool = False, recompute: str = "none",
                mask: int = 1) -> float:
    """Korthikanti et al.'s Table 2, bytes per layer, with `mask` bytes per dropout-mask
    element (the paper: 1). The masks are 2 of the 34 (1 each) and as/h of the 5as/h, so
    with m-byte masks: 32 + 2m + (4 + m)as/h, and under TP 8 + 2m + 24/t + (4 + m)as/(ht)."""
    s, b, h, a = shape["s"], shape["b"], shape["h"], shape["a"]
    sbh, att = s * b * h, (4 + mask) * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    if recompute == "selective":
        return (32 + 2 * mask) * sbh / t if sp else sbh * (8 + 2 * mask + 24 / t)
    if sp:
        return sbh * (32 + 2 * mask + att) / t
    return sbh * (8 + 2 * mask + 24 / t + att / t)


# (case, what to compile, closed-form arguments).
SEL, FULL = dict(recompute="selective"), dict(recompute="full")
CASES = [
    ("no parallelism", dict(), dict()),
    *[(f"TP {t}", dict(t=t), dict(t=t)) for t in (2, 4, 8)],
    *[(f"TP {t} + SP", dict(t=t, sp=True), dict(t=t, sp=True)) for t in (2, 4, 8)],
    ("selective recompute", SEL, SEL),
    *[(f"TP {t} + selective recompute", dict(t=t, **SEL), dict(t=t, **SEL)) for t in (2, 8)],
    *[(f"TP {t} + SP + selective recompute", dict(t=t, sp=True, **SEL),
       dict(t=t, sp=True, **SEL)) for t in (2, 8)],
    ("full recompute", FULL, FULL),
    *[(f"TP {t} + full recompute", dict(t=t, **FULL), dict(t=t, **FULL)) for t in (2, 4, 8)],
    *[(f"TP {t} + SP + full recompute", dict(t=t, sp=True, **FULL),
       dict(t=t, sp=True, **FULL)) for t in (2, 8)],
    ("no parallelism, 1-byte keep mask", dict(keep_mask=True), dict()),
    ("full recompute, 1-byte keep mask", dict(keep_mask=True, **FULL), FULL),
]


def table(shape: dict) -> list[tuple[str, float, float, float]]:
    """(case, predicted bytes, closed form with 1-byte masks, closed form with the masks the
    layer saves: 1 byte for the keep mask, 2 for F.dropout in bf16) per case."""
    rows = []
    for name, run, closed in CASES:
        want = closed_form(shape, **closed)
        own = want if run.get("keep_mask") else closed_form(shape, **closed, mask=2)
        rows.append((name, layer_bytes(shape, **run), want, own))
    return rows


def breakdown(shape: dict, t: int, sp: bool = False) -> list[str]:
    """One layer's regions (TP parts): bytes autograd saves and values each reads, in sbh."""
    plan = compile_layers(shape, 1, t, sp)
    sbh = shape["s"] * shape["b"] * shape["h"]
    out = []
    for r in plan.regions:
        if dict(r.tags).get("L") != 0:
            continue
        ins = ", ".join(f"{v} {math.prod(plan.values[v].shape) * 2 / sbh:g}" for v in r.inputs
                        if v in plan.values and plan.values[v].dtype == "bfloat16")
        out.append(f"| {r.name} | {plan.saved.get(r.index, 0) / sbh:.3f} | {ins} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--breakdown", action="store_true", help="also list one layer's TP parts")
    args = ap.parse_args()
    shape = PUBLISHED
    sbh = shape["s"] * shape["b"] * shape["h"]
    print(f"GPT layer s={shape['s']} b={shape['b']} h={shape['h']} a={shape['a']}, bf16, "
          f"1-byte masks; bytes per layer in sbh = {sbh:,} B\n")
    print("| case | predicted (sbh) | Korthikanti, 1-byte masks (sbh) | ratio "
          "| same, the layer's masks (sbh) | ratio |")
    print("|---|---|---|---|---|---|")
    for name, got, want, own in table(shape):
        print(f"| {name} | {got / sbh:.2f} | {want / sbh:.2f} | {got / want:.3f} "
              f"| {own / sbh:.2f} | {got / own:.3f} |")
    if args.breakdown:
        print("\nTP 2: one layer's parts, in sbh (under full recompute only the inputs "
              "are held until the backward)\n")
        print("| region | saved by autograd | bf16 inputs held |\n|---|---|---|")
        print("\n".join(breakdown(shape, 2)))
        print("\nTP 2 + SP: the same\n")
        print("| region | saved by autograd | bf16 inputs held |\n|---|---|---|")
        print("\n".join(breakdown(shape, 2, sp=True)))


if __name__ == "__main__":
    main()
