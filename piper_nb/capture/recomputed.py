"""A piece of a region run without keeping what its backward needs: `Recomputed` runs a
GraphModule (an attention core, `capture.attention_core`) under `torch.no_grad()`, keeps
only its inputs, and in the backward runs it again with autograd from the random state its
forward started from (Megatron's selective recompute; `torch.utils.checkpoint`'s idea).

It is a custom autograd Function rather than `torch.utils.checkpoint`: the kept inputs go
through `save_for_backward`, so the saved-tensor hooks that count a region's saved bytes
(`plan.sizes.SavedBytes`) see them, and its backward computes only its inputs' gradients
(`torch.autograd.grad`), so a split backward (BI, then BW with `inputs=`) may run it twice
without summing any gradient twice. The piece must hold no parameters
(`attention_core` makes sure).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Recomputed"]


class Recomputed(nn.Module):
    """Runs `core` keeping only its inputs; its backward runs `core` again first. `random`:
    the core draws random numbers (dropout), so the generators' states are kept too."""

    def __init__(self, core: nn.Module, random: bool):
        super().__init__()
        self.core, self.random = core, random

    def forward(self, *args):
        return _Again.apply(self.core, self.random, *args)


def _rng_state(args) -> tuple:
    devices = sorted({a.device for a in args if isinstance(a, torch.Tensor)
                      and a.device.type == "cuda"}, key=str)
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


class _Again(torch.autograd.Function):
    @staticmethod
    def forward(ctx, core, random, *args):
        ctx.core = core
        ctx.state = _rng_state(args) if random else None
        ctx.tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensors))
        with torch.no_grad():
            return core(*args)

    @staticmethod
    def backward(ctx, *grads):
        args = list(ctx.others)
        for i, t in zip(ctx.tensors, ctx.saved_tensors, strict=True):
            args[i] = t.detach().requires_grad_(t.requires_grad)
        devices = [d for d, _ in ctx.state[1]] if ctx.state else []
        with torch.random.fork_rng(devices=devices, enabled=ctx.state is not None):
            if ctx.state is not None:
                torch.set_rng_state(ctx.state[0])
                for d, s in ctx.state[1]:
                    torch.cuda.set_rng_state(s, d)
            with torch.enable_grad():
                outs = ctx.core(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads, strict=True)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        wanted = [i for i in ctx.tensors if args[i].requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted],
                                  [g for _, g in pairs], allow_unused=True) if pairs else ()
        out = [None] * (2 + len(args))
        for i, g in zip(wanted, got, strict=False):
            out[2 + i] = g
        return tuple(out)
