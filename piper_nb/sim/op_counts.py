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
import functools
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from piper_nb.capture.ring_attention import RING_KERNELS
from piper_nb.ir.kinds import Op
from piper_nb.plan.sizes import storage_key

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
    """Counts the kernels the operators under it run (see the module docstring); with `fuse`
    it also keeps their order and buffers, for `fused`."""

    active: list[OpCounter] = []   # the counters entered, innermost last

    def __init__(self, fuse: bool = True):
        super().__init__()
        self.fuse = fuse
        from piper_nb.capture.annotate import flop_counter
        self.formulas = flop_counter().flop_registry
        self.seen: Counter = Counter()   # (kind, dtype, flops, bytes) -> kernels
        self.trace: list[_Kernel] = []   # in order, with the buffers each reads and writes
        self.alive: list = []            # what it wrote: no buffer is reused while counting
        self.saved: set = set()          # buffers autograd saved for the backward
        self.paused = False
        self._attention = _FusedAttention()

    def __enter__(self):
        OpCounter.active.append(self)
        self._attention.__enter__()
        RING_KERNELS.append(_ring_kernel)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            RING_KERNELS.pop()
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

    def add(self, kind: Kind, dtype: torch.dtype, flops: float, nbytes: float,
            reads: tuple = (), writes: tuple = ()) -> None:
        key = (kind, str(dtype).removeprefix("torch."), float(flops), float(nbytes))
        self.seen[key] += 1
        if self.fuse:
            self.trace.append(_Kernel(key, _buffers(reads), _buffers(writes)))
            self.alive += writes

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
        writes = tuple(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        ids = {id(t) for t in writes}
        reads = tuple(t for t in tensors.values() if id(t) not in ids)
        self.add(kind, first.dtype if first is not None else torch.float32, flops, nbytes,
                 reads, writes)
        return out

    def tallies(self) -> tuple[OpTally, ...]:
        """The kernels as eager PyTorch runs them, one per operator."""
        return tuple(OpTally(k, d, f, b, n) for (k, d, f, b), n in sorted(self.seen.items()))

    def saving(self):
        """Note what autograd saves under it (the fused kernels write it)."""
        def pack(t):
            with contextlib.suppress(RuntimeError, NotImplementedError):
                self.saved.add(storage_key(t))
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def fused(self) -> tuple[OpTally, ...]:
        """The kernels as `torch.compile` runs them: each run of memory-bound kernels between
        two matmuls or attention kernels is one, reading what it takes from outside the run
        and writing what is read after it, saved for the backward (`saving`), or read by
        nothing later in the pass (an output); matmuls and attention as they are. A
        reduction of a whole tensor to a scalar (an amax, a loss's sum) ends its run: the
        kernels after it need its result, which takes the whole grid to finish (Inductor
        makes it a kernel of its own), so they read their inputs again."""
        readers: dict = {}
        for i, k in enumerate(self.trace):
            for b, _ in k.reads:
                readers.setdefault(b, []).append(i)
        seen: Counter = Counter()
        run: list[int] = []
        for i, k in enumerate([*self.trace, None]):
            if k is not None and k.key[0] == Kind.MEMORY:
                run.append(i)
                if _full_reduction(k):   # what follows needs its result: a new kernel
                    seen[self._fused_key(run, readers)] += 1
                    run = []
                continue
            if run:
                seen[self._fused_key(run, readers)] += 1
                run = []
            if k is not None:
                seen[k.key] += 1
        return tuple(OpTally(k, d, f, b, n) for (k, d, f, b), n in sorted(seen.items()))

    def _fused_key(self, run: list[int], readers: dict) -> tuple:
        made, moved, last = {}, {}, run[-1]
        for i in run:
            k = self.trace[i]
            for b, n in k.reads:
                if b not in made:
                    moved[("r", b)] = n
            for b, n in k.writes:
                made[b] = n
        for b, n in made.items():
            later = readers.get(b, ())
            if not later or later[-1] > last or b in self.saved:
                moved[("w", b)] = n
        return (Kind.MEMORY, self.trace[run[0]].key[1], 0.0, float(sum(moved.values())))


def _full_reduction(k: _Kernel) -> bool:
    """Whether kernel k reduces tensors to scalars: it writes only single elements from
    more than one."""
    return bool(k.writes) and all(n <= 8 for _, n in k.writes) and \
        sum(n for _, n in k.reads) > 8


@dataclass(frozen=True)
class _Kernel:
    key: tuple                  # (kind, dtype, flops, bytes)
    reads: tuple                # ((buffer, bytes), ...)
    writes: tuple


def _buffers(tensors) -> tuple:
    """(buffer, bytes) of each tensor: its storage (what a view of it shares; the tensor
    itself where it has none to ask), its bytes."""
    out = []
    for t in tensors:
        try:
            key = storage_key(t)
        except (RuntimeError, NotImplementedError):
            key = id(t)
        out.append((key, t.numel() * t.element_size()))
    return tuple(out)


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
        counter.add(Kind.ATTENTION, q.dtype, flops, ctx.nbytes, (q, k, v), (out,))
        return out

    @staticmethod
    def backward(ctx, grad):
        counter = OpCounter.active[-1] if OpCounter.active else None
        with counter.pause() if counter else contextlib.nullcontext():
            grads = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes]
        if counter is not None:   # reads q, k, v, out, its gradient; writes dq, dk, dv
            counter.add(Kind.ATTENTION, grad.dtype, 2.5 * ctx.flops,
                        ctx.nbytes + _nbytes(grad, *grads), (grad,), tuple(grads))
        return (None, None, *grads, *([None] * ctx.extra))


def _ring_kernel(run, q, k, v, causal: bool):
    """Ring attention (`capture.ring_attention`) as the kernels a GPU runs for it: one
    flash attention per block, priced together as one of a device's queries over the whole
    sequence's keys (causal: half its blocks' work, the zigzag cut evening it out)."""
    return _Attention.apply(lambda q, k, v, **_: run(q, k, v), {"is_causal": causal}, q, k, v)


def region_ops(plan, compiled: bool = False) -> dict[int, dict[Op, tuple[OpTally, ...]]]:
    """Region -> {F, B, BI, BW: its kernels} on one microbatch slice (the module
    docstring), eager or as `torch.compile` fuses them (`OpCounter.fused`); regions of one
    signature counted once."""
    from piper_nb.sim.flops import each_region
    return each_region(plan, functools.partial(_count, compiled=compiled), grad=True)


def _count(module, args: list, compiled: bool = False) -> dict[Op, tuple[OpTally, ...]]:
    """A region's kernels, forward and backwards, eager or fused (`compiled`)."""
    with OpCounter(fuse=compiled) as fwd, fwd.saving():
        outs = module(*args)
    roots = [o for o in tree_leaves(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [a for a in args if a.requires_grad]
    params = [p for p in module.parameters() if p.requires_grad]
    grads = [torch.ones_like(o) for o in roots]
    got = {Op.F: fwd.fused() if compiled else fwd.tallies()}
    for op, wrt in ((Op.BI, inputs), (Op.BW, params), (Op.B, inputs + params)):
        with OpCounter(fuse=compiled) as bwd:
            if roots and wrt:
                torch.autograd.grad(roots, wrt, grads, retain_graph=True, allow_unused=True)
        got[op] = bwd.fused() if compiled else bwd.tallies()
    return got
