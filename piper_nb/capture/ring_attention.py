"""Context parallelism's arithmetic: which tokens of the sequence each device holds, and
attention over the whole sequence computed one device's block at a time with an online
softmax (ring attention; Liu et al. 2023, "Ring Attention with Blockwise Transformers").

A sequence of `seq` tokens is cut over `degree` devices. Under the causal mask the last
tokens attend to the most keys, so an even cut gives the last device the most work;
`zigzag` balances it (Megatron's context parallelism, torchtitan's `_HeadTailLoadBalancer`):
the sequence is cut into `2 * degree` chunks and device `r` holds chunks `r` and
`2 * degree - 1 - r`. `contiguous` gives device `r` chunk `r` of `degree`. `positions`
says which tokens a device holds, in the order it holds them; a region cut along the
context computes its rotary angles and position embeddings from them.

`ring_attention` takes a device's queries and every device's keys and values (each
device's block of keys at its place in member order) and visits the blocks one by one,
its own first (whose diagonal every causal row sees), then the ring's order backwards:
each block's scores are masked by the global positions of the queries and keys, and the
running maximum, denominator and numerator are rescaled as the flash-attention recurrence
does. Like flash attention it keeps its inputs, its output and each row's log-sum-exp
only, and its backward computes each block's probabilities again from them (the memory
of a device's attention is its share's, never a block of scores per member). Grouped
key/value heads are repeated block by block, never kept. In fp32 the result and the
gradients equal one process's attention to a few units in the last place: the sums are
taken block by block rather than row by row.
"""

from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["BALANCES", "check_length", "chunk_bounds", "positions", "take_share",
           "context_arange", "ring_attention", "RING_KERNELS"]

BALANCES = ("zigzag", "contiguous")
# while the simulator counts a region's kernels (`sim.op_counts`), how it prices ring
# attention: as the fused kernels a GPU runs for its blocks, not the ops it is written in
RING_KERNELS: list = []


def _chunks(balance: str, degree: int) -> int:
    if balance not in BALANCES:
        raise ValueError(f"load_balance={balance!r}: use one of {', '.join(BALANCES)}")
    return 2 * degree if balance == "zigzag" else degree


def check_length(seq: int, degree: int, balance: str) -> int | None:
    """The multiple `seq` must be of to be cut (None when it is): 2 x degree for zigzag,
    degree for contiguous."""
    k = _chunks(balance, degree)
    return k if seq % k else None


def chunk_bounds(seq: int, degree: int, rank: int, balance: str) -> tuple[tuple[int, int], ...]:
    """The [start, end) ranges of the tokens device `rank` holds, in the order it holds
    them."""
    k = _chunks(balance, degree)
    c = seq // k
    if balance == "zigzag":
        return ((rank * c, (rank + 1) * c), ((k - 1 - rank) * c, (k - rank) * c))
    return ((rank * c, (rank + 1) * c),)


def _rank(rank) -> int:
    """A rank given as an int or as a rank buffer; planning on meta or fake tensors, which
    have no rank, takes device 0's (every device's share has the same shape)."""
    if isinstance(rank, torch.Tensor):
        return 0 if rank.is_meta or isinstance(rank, FakeTensor) else int(rank)
    return int(rank)


def positions(local: int, degree: int, rank, balance: str,
              device: torch.device | str = "cpu") -> torch.Tensor:
    """The global positions (int64) of the `local` tokens device `rank` of `degree` holds."""
    bounds = chunk_bounds(local * degree, degree, _rank(rank), balance)
    return torch.cat([torch.arange(a, b, device=device) for a, b in bounds])


def take_share(x: torch.Tensor, degree: int, rank, balance: str, dim: int = 1) -> torch.Tensor:
    """Device `rank`'s share of `x`'s sequence (dimension `dim`): its chunks, in order (a
    copy)."""
    seq = x.shape[dim]
    bounds = chunk_bounds(seq, degree, _rank(rank), balance)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in bounds], dim)


def context_arange(degree: int, rank, balance: str, *args, **kwargs) -> torch.Tensor:
    """`torch.arange(*args, **kwargs)` over a sequence of which this device holds a share:
    the same start, step and dtype, at device `rank`'s global positions (the arange a region
    runs on its share counts that share's length)."""
    local = torch.arange(*args, **kwargs)
    start = kwargs.get("start", args[0] if len(args) > 1 else 0)
    step = kwargs.get("step", args[2] if len(args) > 2 else 1)
    at = positions(local.numel(), degree, rank, balance, local.device)
    return (start + at * step).to(local.dtype)


def ring_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, degree: int,
                   rank, balance: str, causal: bool, scale: float | None = None,
                   gqa: bool = False) -> torch.Tensor:
    """Attention of this device's queries `q` [batch, heads, local, dim] over the whole
    sequence's keys and values `k_all`, `v_all` [batch, kv_heads, degree x local, dim], each
    device's block at its place in member order; causal by global position. Like flash
    attention it keeps only its inputs, its output and each row's log-sum-exp, and runs
    the blocks again in the backward (`_Ring`)."""
    local = q.shape[-2]
    if k_all.shape[-2] != local * degree:
        raise ValueError(f"ring_attention: keys hold {k_all.shape[-2]} tokens, not "
                         f"{degree} blocks of {local}")
    if k_all.shape[1] != q.shape[1] and not (gqa and q.shape[1] % k_all.shape[1] == 0):
        raise ValueError(f"ring_attention: {q.shape[1]} query heads over {k_all.shape[1]} "
                         "key heads need gqa=True and a multiple")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    me = _rank(rank)
    if RING_KERNELS:
        return RING_KERNELS[-1](lambda q, k, v: _Ring.apply(q, k, v, degree, me, balance,
                                                            causal, scale),
                                q, k_all, v_all, causal)
    return _Ring.apply(q, k_all, v_all, degree, me, balance, causal, scale)


class _Ring(torch.autograd.Function):
    """Ring attention's forward (the online softmax over the blocks, own block first) and
    its backward (each block's probabilities again from the saved log-sum-exp: flash
    attention's backward, block by block)."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, degree, me, balance, causal, scale):
        local, rep = q.shape[-2], q.shape[1] // k_all.shape[1]
        top = den = num = None
        for _, k, v, mask in _blocks(q, k_all, v_all, degree, me, balance, causal, rep):
            s = _scores(q, k, scale, mask)
            m = s.amax(-1, keepdim=True) if top is None else torch.maximum(
                top, s.amax(-1, keepdim=True))
            p = torch.exp(s - m)
            if top is None:
                den, num = p.sum(-1, keepdim=True), torch.matmul(p, v)
            else:
                alpha = torch.exp(top - m)
                den = den * alpha + p.sum(-1, keepdim=True)
                num = num * alpha + torch.matmul(p, v)
            top = m
        out = num / den
        lse = top + torch.log(den)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.args = (degree, me, balance, causal, scale, local, rep)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        degree, me, balance, causal, scale, local, rep = ctx.args
        row = (dout * out).sum(-1, keepdim=True)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k_all), torch.zeros_like(v_all)
        for j, k, v, mask in _blocks(q, k_all, v_all, degree, me, balance, causal, rep):
            p = torch.exp(_scores(q, k, scale, mask) - lse)
            ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - row)
            dq += torch.matmul(ds, k) * scale
            at = slice(j * local, (j + 1) * local)
            dk[..., at, :] += _grouped(torch.matmul(ds.transpose(-2, -1), q) * scale, rep)
            dv[..., at, :] += _grouped(torch.matmul(p.transpose(-2, -1), dout), rep)
        return dq, dk, dv, None, None, None, None, None


def _blocks(q, k_all, v_all, degree: int, me: int, balance: str, causal: bool, rep: int):
    """(member j, its keys, its values, the causal mask of this device's queries over
    them or None) for each member, this device first, then the ring's order backwards;
    keys and values repeated to the query heads."""
    local = q.shape[-2]
    q_pos = positions(local, degree, me, balance, q.device) if causal else None
    for step in range(degree):
        j = (me - step) % degree
        k = k_all.narrow(-2, j * local, local)
        v = v_all.narrow(-2, j * local, local)
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        mask = (q_pos[:, None] < positions(local, degree, j, balance, q.device)[None, :]
                if causal else None)
        yield j, k, v, mask


def _scores(q, k, scale: float, mask):
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    return s if mask is None else s.masked_fill(mask, float("-inf"))


def _grouped(x: torch.Tensor, rep: int) -> torch.Tensor:
    """A gradient over the query heads summed over each key head's group."""
    if rep == 1:
        return x
    b, h, n, d = x.shape
    return x.view(b, h // rep, rep, n, d).sum(2)
