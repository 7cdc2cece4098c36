"""The per-operator cost model (`CostModel.analytic`): a pass costs the sum over its kernels
(`sim.op_counts`) of `max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth, host
launch)`, with one table of constants per GPU (`sim.gpus.HARDWARE`), each with its
source.

- A **matmul** runs at `peak(dtype) x matmul_efficiency`: bf16 and fp16 on tensor cores,
  fp32 (PyTorch's default, no TF32) on the CUDA cores. A small one is bounded by the bytes
  of its operands instead: the roofline makes its efficiency depend on its shape.
- **Attention** kernels (flash, memory-efficient, cuDNN) run at `peak x
  attention_efficiency`; the math path is matmuls and memory-bound work, priced as such.
- **Memory-bound** kernels (element-wise, norms, softmax, casts, copies, reductions,
  cross-entropy's) move their input and output bytes at `hbm_bandwidth x hbm_efficiency`.
- Each kernel costs at least the **host's launch** of one eager operator
  (`launch_overhead`): a GPU fed faster than that waits for the host.
- The **optimizer step** reads and writes `OPTIMIZER_BYTES` per parameter element.

A plan runs eager unless the model is told it is compiled (`compiled=True`): then each run
of memory-bound kernels between two matmuls or attention kernels is one fused kernel, as
`torch.compile`'s Inductor makes it, moving only what it reads from outside the run and
what is read after it, with one launch (`OpCounter.fused`).
"""

from __future__ import annotations

import math

from piper_nb.ir.kinds import Op
from piper_nb.sim.gpus import HardwareSpec
from piper_nb.sim.op_counts import Kind, OpTally

__all__ = ["OPTIMIZER_BYTES", "kernel_time", "pass_time", "update_time", "passes_of"]

# AdamW over fp32 state: reads the parameter, its gradient and two moments and writes the
# parameter and the moments, 7 x 4 bytes an element: what one pass over the state moves (a
# fused AdamW's; torch.optim's foreach kernels make several, which this under-counts)
OPTIMIZER_BYTES = 28


def kernel_time(t: OpTally, gpu: HardwareSpec) -> float:
    """One kernel of tally `t`: its roofline time, at least one launch."""
    moved = t.nbytes / (gpu.hbm_bandwidth * gpu.hbm_efficiency)
    if t.kind == Kind.MEMORY:
        work = 0.0
    else:
        eff = gpu.attention_efficiency if t.kind == Kind.ATTENTION else gpu.matmul_efficiency
        work = t.flops / (gpu.peak(t.dtype) * eff)
    return max(work, moved, gpu.launch_overhead)


def pass_time(tallies: tuple[OpTally, ...], gpu: HardwareSpec) -> float:
    """A pass's time: its kernels', one after another on one stream."""
    return sum(t.count * kernel_time(t, gpu) for t in tallies)


def update_time(plan, region: int, gpu: HardwareSpec) -> float:
    """The optimizer step of a region's parameters (`OPTIMIZER_BYTES` per element)."""
    numel = sum(math.prod(plan.params[p][0]) for p in plan.regions[region].params
                if p in plan.params)
    return numel * OPTIMIZER_BYTES / (gpu.hbm_bandwidth * gpu.hbm_efficiency)


def passes_of(plan, gpu: HardwareSpec, compiled: bool = False) -> dict:
    """(region, pass) -> duration for every region of `plan` (`sim.op_counts.region_ops`),
    its kernels eager or as `torch.compile` fuses them."""
    from piper_nb.sim.op_counts import region_ops
    out = {}
    for r, ops in region_ops(plan, compiled).items():
        for kind in (Op.F, Op.B, Op.BI, Op.BW):
            out[(r, kind)] = pass_time(ops[kind], gpu)
        out[(r, Op.U)] = update_time(plan, r, gpu)
    return out

