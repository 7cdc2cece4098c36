"""How a worker's forward takes its inputs and hands its outputs to the backward, holding
no buffer autograd does not need.

A detached input made an autograd leaf would be held by its graph (the leaf's gradient
accumulator keeps it) until the backward, whether or not an op saved it: a dropout after
an all-reduce keeps only its mask, yet the leaf would keep the whole sum. So each input
that needs a gradient enters through `Entries.enter`, a custom autograd Function that
returns a view of it and whose backward puts the gradient in `Entries.grads`; the graph
holds a zero-size anchor instead, and the input's buffer lives only as long as an op's
saved view of it, or the value store, keeps it. Likewise the stash keeps its outputs as
gradient edges (`roots`), not as tensors, so an output no op saved goes with its last
reader.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

__all__ = ["Entries", "roots"]


class _Entry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, anchor, t, grads, name):
        ctx.grads, ctx.name = grads, name
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        old = ctx.grads.get(ctx.name)
        ctx.grads[ctx.name] = g if old is None else old + g
        return None, None, None, None


class Entries:
    """The inputs of one forward that need gradients, and their gradients once a backward
    (B, or BI) ran: `grads[name]`."""

    def __init__(self, device: torch.device):
        self.anchor = torch.zeros(0, device=device, requires_grad=True)
        self.grads: dict[str, torch.Tensor] = {}

    def enter(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` (detached) as the forward reads it: a view whose gradient lands in `grads`."""
        return _Entry.apply(self.anchor, t, self.grads, name)


def roots(outputs: dict) -> dict:
    """name -> (gradient edge, shape, dtype, device) of each output that carries a gradient:
    where a backward starts, without holding the output itself."""
    return {name: (get_gradient_edge(out), out.shape, out.dtype, out.device)
            for name, out in outputs.items()
            if isinstance(out, torch.Tensor) and out.requires_grad}
