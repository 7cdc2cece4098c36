"""What the per-operator model counts (`sim.op_counts`): kernels by kind with their FLOPs and
bytes, on the meta device; `scaled_dot_product_attention` as one attention kernel; and the
kernels `torch.compile` would run, element-wise runs fused between matmuls."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from piper_nb.ir.kinds import Op
from piper_nb.sim.op_counts import Kind, OpCounter, _count

MB4 = 1024 * 1024 * 4   # one [1024, 1024] fp32 tensor


def meta(*shape, dtype=torch.float32, grad=False):
    return torch.empty(*shape, dtype=dtype, device="meta", requires_grad=grad)


def test_element_wise_ops_are_one_kernel_each_eager_and_one_run_fused():
    x = meta(1024, 1024)
    with OpCounter() as c:
        ((x * 2 + 1).relu()).view(-1)         # three kernels; the view is free
    eager = c.tallies()
    assert [(t.kind, t.count, t.nbytes) for t in eager] == [(Kind.MEMORY, 3, 2 * MB4)]
    # fused: reads x, writes the result (read by nothing after: an output)
    assert [(t.kind, t.count, t.nbytes) for t in c.fused()] == [(Kind.MEMORY, 1, 2 * MB4)]
    assert sum(t.count for t in c.fused()) < sum(t.count for t in eager)


def test_a_matmul_ends_a_run_and_what_crosses_it_is_written():
    x, w = meta(1024, 1024), meta(1024, 1024)
    with OpCounter() as c:
        h = torch.tanh(x * 2)                # run 1: reads x, writes h (the matmul reads it)
        y = h @ w                            # a matmul of 2 x 1024^3 FLOPs
        (y + h).sum()                        # run 2: reads y and h, writes the sum
    kinds = [(t.kind, t.count) for t in c.fused()]
    assert (Kind.MATMUL, 1) in kinds and sum(n for k, n in kinds if k == Kind.MEMORY) == 2
    mm = next(t for t in c.fused() if t.kind == Kind.MATMUL)
    assert mm.flops == 2 * 1024**3 and mm.nbytes == 3 * MB4
    runs = sorted(t.nbytes for t in c.fused() if t.kind == Kind.MEMORY)
    assert runs == [2 * MB4, 2 * MB4 + 4]   # x in, h out; y and h in, a scalar out


def test_a_reduction_to_a_scalar_ends_its_run():
    """Float8's scaling: the amax of x, then x times a scale made from it. The kernels after
    the reduction need its result (Inductor makes it a kernel of its own), so they read x
    again: two fused kernels, x read twice."""
    x = meta(1024, 1024)
    with OpCounter() as c:
        amax = x.abs().max()                  # run 1: reads x, writes a scalar
        (x * (448.0 / amax)).to(torch.bfloat16)   # run 2: reads x and the scalar again
    runs = sorted(t.nbytes for t in c.fused() if t.kind == Kind.MEMORY)
    assert runs == [MB4 + 4, MB4 + 4 + MB4 // 2]   # x in, amax out; x and amax in, bf16 out
    # a row-wise reduction (a softmax's, a norm's) stays inside its run
    with OpCounter() as rows:
        torch.softmax(x * 2, dim=-1)
    assert [t.count for t in rows.fused()] == [1]


def test_what_autograd_saves_is_written_by_the_fused_run():
    x = meta(1024, 1024, grad=True)

    class Block(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x * 2) * 3     # tanh saves its output for the backward

    eager, fused = _count(Block(), [x]), _count(Block(), [x], compiled=True)
    # reads x, writes tanh's output (saved) and the result: three tensors, not two
    assert [(t.kind, t.count, t.nbytes) for t in fused[Op.F]] == [(Kind.MEMORY, 1, 3 * MB4)]
    assert sum(t.count for t in eager[Op.F]) == 3       # eager: mul, tanh, mul
    assert eager[Op.BW] == () and fused[Op.BW] == ()    # no parameters
    assert eager[Op.B] and eager[Op.BI] == eager[Op.B]


def test_scaled_dot_product_attention_is_the_one_kernel_a_gpu_runs():
    b, h, s, d = 2, 4, 256, 64
    q, k, v = (meta(b, h, s, d, dtype=torch.bfloat16, grad=True) for _ in range(3))
    with OpCounter() as c:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    [t] = c.tallies()
    causal = 4 * b * h * s * s * d / 2
    assert (t.kind, t.dtype, t.count, t.flops) == (Kind.ATTENTION, "bfloat16", 1, causal)
    assert t.nbytes == 4 * b * h * s * d * 2          # q, k, v and the output
    with OpCounter() as c:
        torch.autograd.grad(out, [q, k, v], torch.ones_like(out))
    attention = [t for t in c.tallies() if t.kind == Kind.ATTENTION]
    assert [(t.count, t.flops) for t in attention] == [(1, 2.5 * causal)]
    assert all(t.kind != Kind.MATMUL for t in c.tallies())   # not the math path's products


def test_ring_attention_is_priced_as_fused_attention_kernels():
    """Context parallelism's ring attention (`capture.ring_attention`, written as block
    matmuls and an online softmax) counted as the flash kernels a GPU runs for its blocks:
    a device's queries over the whole sequence's keys, half the work under the causal
    mask, and 2.5 times that backward."""
    from piper_nb.capture.ring_attention import ring_attention
    q = meta(1, 4, 256, 64, grad=True)
    k, v = meta(1, 2, 1024, 64, grad=True), meta(1, 2, 1024, 64, grad=True)
    with OpCounter() as c:
        out = ring_attention(q, k, v, 4, torch.tensor(1, device="meta"), "zigzag", True,
                             gqa=True)
    kernels = c.tallies()
    assert [(t.kind, t.count) for t in kernels] == [(Kind.ATTENTION, 1)]
    assert kernels[0].flops == 4 * 4 * 256 * 1024 * 64 * 0.5
    with OpCounter() as back:
        out.backward(torch.ones_like(out))
    attention = [t for t in back.tallies() if t.kind == Kind.ATTENTION]   # (the rest: the
    assert [(t.count, t.flops) for t in attention] == [(1, 2.5 * kernels[0].flops)]  # leaves)
