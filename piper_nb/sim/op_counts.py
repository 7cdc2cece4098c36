"""What a region's passes run, operator by operator: each aten operator's FLOPs and the
bytes it reads and writes, counted by dispatch for the per-operator cost model
(`sim.roofline`).

A region runs once on one microbatch slice of its inputs (on the meta device for a plan
compiled there: shapes only, no weights) under `OpCounter`, a dispatch mode that sees
every aten operator its forward runs, then three backwards from the outputs: to the inputs
and the parameters (B), to the inputs alone (BI) and to the parameters alone (BW), the
three a worker runs (`runtime.compute`). Views and metadata cost nothing. Every other
operator is one kernel: a matmul (FLOPs from `torch.utils.flop_counter`'s formulas, plus
grouped matmuls), an attention kernel (flash, memory-efficient, cuDNN; and
`scaled_dot_product_attention`, which the meta device and the CPU decompose, as the one
kernel a GPU runs), or memory-bound work (element-wise ops, norms, softmax, copies, reductions) whose cost is
the bytes of its distinct input and output tensors. Operators with the same kind, dtype,
FLOPs and bytes are tallied together (a model's layers repeat them), and regions with one
signature (`sim.flops.signature`) are counted once.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from piper_nb.ir.kinds import Op

__all__ = ["Kind", "OpTally", "OpCounter", "region_ops"]

_FREE = frozenset({"aten.detach", "aten.alias", "aten._unsafe_view", "aten.lift_fresh",
                   "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.sym_size",
                   "aten.sym_stride", "aten.sym_numel", "aten.sym_storage_offset",
                   "aten.size", "aten.stride", "aten.dim", "aten.is_same_size",
                   "aten._local_scalar_dense", "aten.set_", "aten.resize_"})
_MATMULS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm",
                      "aten._grouped_mm", "transformers.grouped_mm_fallback",
                      "aten.convolution", "aten._convolution", "aten.convolution_backward",
                      "aten.cudnn_convolution", "aten.convolution_overrideable"})


class Kind(StrEnum):
    """What bounds a kernel: tensor-core FLOPs (matmul, attention) or memory (the rest)."""

    MATMUL = "matmul"
    ATTENTION = "attention"
    MEMORY = "memory"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class OpTally:
    """`count` kernels of one kind and dtype, each of `flops` FLOPs moving `nbytes` bytes."""

    kind: Kind
    dtype: str
    flops: float
    nbytes: float
    count: int


class OpCounter(TorchDispatchMode):
    """Counts the kernels the operators under it run (see the module docstring)."""

    active: list[OpCounter] = []   # the counters entered, innermost last

    def __init__(self):
        super().__init__()
        from piper_nb.capture.annotate import flop_counter
        self.formulas = flop_counter().flop_registry
        self.seen: Counter = Counter()   # (kind, dtype, flops, bytes) -> kernels
        self.paused = False
        self._attention = _FusedAttention()

    def __enter__(self):
        OpCounter.active.append(self)
        self._attention.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._attention.__exit__(*exc)
            OpCounter.active.pop()

    @contextlib.contextmanager
    def pause(self):
        """Run what is inside uncounted (a kernel counted as a whole instead)."""
        self.paused, was = True, self.paused
        try:
            yield
        finally:
            self.paused = was

    def add(self, kind: Kind, dtype: torch.dtype, flops: float, nbytes: float) -> None:
        self.seen[(kind, str(dtype).removeprefix("torch."), float(flops), float(nbytes))] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.paused:
            return out
        packet = func._overloadpacket
        name = str(packet)
        if func.is_view or name in _FREE:
            return out
        tensors = {id(t): t for t in tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor)}
        nbytes = float(sum(t.numel() * t.element_size() for t in tensors.values()))
        flops = float(self.formulas[packet](*args, **kwargs, out_val=out)
                      if packet in self.formulas else 0)
        if not nbytes and not flops:   # moves nothing (an empty or host-side tensor)
            return out
        kind = (Kind.ATTENTION if "attention" in name else
                Kind.MATMUL if name in _MATMULS or flops else Kind.MEMORY)
        first = next(iter(tensors.values()), None)
        dtype = str(first.dtype).removeprefix("torch.") if first is not None else "float32"
        self.seen[(kind, dtype, flops, nbytes)] += 1
        return out

    def tallies(self) -> tuple[OpTally, ...]:
        return tuple(OpTally(k, d, f, b, n) for (k, d, f, b), n in sorted(self.seen.items()))


def _nbytes(*ts) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


_SDPA = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


class _FusedAttention(TorchFunctionMode):
    """`scaled_dot_product_attention` as the one kernel a GPU runs for it (flash, or
    memory-efficient attention for fp32), not as the math path the meta device and the CPU
    decompose it into: 4 b h s_q s_k d FLOPs forward (half under a causal mask, whose
    blocks the kernel skips), 2.5 times that backward (FlashAttention-2's five matmuls
    against two), its inputs and outputs as bytes."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _SDPA or not OpCounter.active:
            return func(*args, **kwargs)
        return _Attention.apply(func, kwargs, *args)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, func, kwargs, q, k, v, *rest):
        counter = OpCounter.active[-1]
        with counter.pause():
            out = func(q, k, v, *rest, **kwargs)
        causal = kwargs.get("is_causal", rest[2] if len(rest) > 2 else False)
        flops = 4 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1] * (0.5 if causal else 1)
        ctx.flops, ctx.nbytes = flops, _nbytes(q, k, v, out)
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in (q, k, v)]
        ctx.extra = len(rest)
        counter.add(Kind.ATTENTION, q.dtype, flops, ctx.nbytes)
        return out

    @staticmethod
    def backward(ctx, grad):
        counter = OpCounter.active[-1] if OpCounter.active else None
        with counter.pause() if counter else contextlib.nullcontext():
            grads = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes]
        if counter is not None:   # reads q, k, v, out, its gradient; writes dq, dk, dv
            counter.add(Kind.ATTENTION, grad.dtype, 2.5 * ctx.flops,
                        ctx.nbytes + _nbytes(grad, *grads))
        return (None, None, *grads, *([None] * ctx.extra))


def region_ops(plan) -> dict[int, dict[Op, tuple[OpTally, ...]]]:
    """Region -> {F, B, BI, BW: its kernels} on one microbatch slice (the module
    docstring); regions of one signature counted once."""
    from piper_nb.sim.flops import each_region
    return each_region(plan, _count, grad=True)


def _count(module, args: list) -> dict[Op, tuple[OpTally, ...]]:
    with OpCounter() as fwd:
        outs = module(*args)
    roots = [o for o in tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [a for a in args if a.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [torch.ones_like(o) for o in roots]
    got = {Op.F: fwd.tallies()}
    for op, wrt in ((Op.BI, inputs), (Op.BW, params), (Op.B, inputs + params)):
        with OpCounter() as bwd:
            if roots and wrt:
                torch.autograd.grad(roots, wrt, grads, retain_graph=True, allow_unused=True)
        got[op] = bwd.tallies()
    return got
