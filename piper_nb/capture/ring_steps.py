"""Ring attention one block at a time: the point-to-point ring (`pn.context_parallel(...,
rotate="p2p")`, Megatron's `cp_comm_type="p2p"`), whose steps are separate parts of a
region with the exchange of keys and values between them as plan instructions.

Step `j` of a device of rank `r` attends its queries to the keys and values of member
`(r - j) mod n`, which the ring delivered `j` hops away (step 0: its own), and carries the
online softmax on in one tensor, the *state* `[batch, heads, local, dim + 2]`: the
numerator, the denominator and the running maximum, exactly as `ring_attention` keeps them
(the same operations in the same order: the forward equals it to the bit). `ring_out`
divides the numerator by the denominator.

The backward of a block needs the whole attention's output, log-sum-exp and output
gradient (flash attention's backward), which the forward of step `j` cannot know: they
are handed down the state's gradient. `ring_out`'s backward returns, in the state's
shape, the output's gradient, each row's sum of it times the output, and the log-sum-exp;
each step computes its block's gradients from them and hands the same tensor on as its
input state's gradient. So a step keeps only its queries, keys and values (a device keeps
every member's keys and values once, as the all-gather rotation does), and the state
passes from part to part without being kept. The state's "gradient" is this carrier, not
the derivative of the loss by the state: nothing but the steps reads it.

`ring_shift` marks where the ring delivers a block: the identity on one process (shapes,
probes), and on the workers no op at all, since the value it makes comes from the plan's
receive (`cp.ring`).
"""

from __future__ import annotations

import math

import torch

from piper_nb.capture.ring_attention import RING_KERNELS, _grouped, _rank, _scores, positions

__all__ = ["ring_step", "ring_out", "ring_shift", "STATE_EXTRA"]

STATE_EXTRA = 2   # the state's columns past the head dimension: denominator, maximum


def ring_shift(x: torch.Tensor) -> torch.Tensor:
    """The block the ring delivers next (see the module docstring): `x` on one process."""
    return x


def ring_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor | None,
              step: int, degree: int, rank, balance: str, causal: bool,
              scale: float | None = None, gqa: bool = False) -> torch.Tensor:
    """The state after this device's queries `q` [batch, heads, local, dim] attend to the
    block `k`, `v` [batch, kv_heads, local, dim] of member `(rank - step) mod degree`;
    `state` None at step 0. Causal by global position."""
    if k.shape[1] != q.shape[1] and not (gqa and q.shape[1] % k.shape[1] == 0):
        raise ValueError(f"ring_step: {q.shape[1]} query heads over {k.shape[1]} key heads "
                         "need gqa=True and a multiple")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    args = (step, degree, _rank(rank), balance, causal, scale)
    if RING_KERNELS:   # priced as the flash kernel of a block (`sim.op_counts`)
        return RING_KERNELS[-1](lambda q, k, v: _Step.apply(q, k, v, state, *args),
                                q, k, v, causal)
    return _Step.apply(q, k, v, state, *args)


def ring_out(state: torch.Tensor) -> torch.Tensor:
    """Attention's output [batch, heads, local, dim] from the last step's state."""
    return _Out.apply(state)


def _mask(q, degree: int, me: int, member: int, balance: str, causal: bool):
    if not causal:
        return None
    local = q.shape[-2]
    return (positions(local, degree, me, balance, q.device)[:, None]
            < positions(local, degree, member, balance, q.device)[None, :])


def _repeat(k, v, rep: int):
    return (k, v) if rep == 1 else (k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))


class _Step(torch.autograd.Function):
    """One block of the online softmax (forward) and its gradients from the carrier the
    next step hands back (backward; the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, state, step, degree, me, balance, causal, scale):
        member = (me - step) % degree
        rep = q.shape[1] // k.shape[1]
        kk, vv = _repeat(k, v, rep)
        s = _scores(q, kk, scale, _mask(q, degree, me, member, balance, causal))
        if state is None:
            m = s.amax(-1, keepdim=True)
            p = torch.exp(s - m)
            den, num = p.sum(-1, keepdim=True), torch.matmul(p, vv)
        else:
            d = q.shape[-1]
            num, den, top = state[..., :d], state[..., d:d + 1], state[..., d + 1:]
            m = torch.maximum(top, s.amax(-1, keepdim=True))
            p = torch.exp(s - m)
            alpha = torch.exp(top - m)
            den = den * alpha + p.sum(-1, keepdim=True)
            num = num * alpha + torch.matmul(p, vv)
        ctx.save_for_backward(q, k, v)
        ctx.args = (degree, me, member, balance, causal, scale, rep, state is not None)
        return torch.cat([num, den, m], -1)

    @staticmethod
    def backward(ctx, carrier):
        q, k, v = ctx.saved_tensors
        degree, me, member, balance, causal, scale, rep, chained = ctx.args
        d = q.shape[-1]
        dout, row, lse = carrier[..., :d], carrier[..., d:d + 1], carrier[..., d + 1:]
        kk, vv = _repeat(k, v, rep)
        p = torch.exp(_scores(q, kk, scale, _mask(q, degree, me, member, balance, causal))
                      - lse)
        ds = p * (torch.matmul(dout, vv.transpose(-2, -1)) - row)
        dq = torch.matmul(ds, kk) * scale
        dk = _grouped(torch.matmul(ds.transpose(-2, -1), q) * scale, rep)
        dv = _grouped(torch.matmul(p.transpose(-2, -1), dout), rep)
        return (dq, dk, dv, carrier if chained else None, *([None] * 6))


class _Out(torch.autograd.Function):
    """The output from the state; its backward makes the carrier (the module docstring)."""

    @staticmethod
    def forward(ctx, state):
        d = state.shape[-1] - STATE_EXTRA
        num, den, top = state[..., :d], state[..., d:d + 1], state[..., d + 1:]
        out = num / den
        lse = top + torch.log(den)
        ctx.save_for_backward(out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        out, lse = ctx.saved_tensors
        row = (dout * out).sum(-1, keepdim=True)
        return torch.cat([dout, row, lse], -1)
