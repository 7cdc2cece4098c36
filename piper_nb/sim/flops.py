"""FLOPs per region, counted by running each region once on one microbatch slice under
`FlopCounterMode` (the analytic cost model; `capture.annotate.flop_counter` also counts the
`_grouped_mm` of Hugging Face's stacked experts). Pure: no process, and the user's model
keeps its buffers and random state (`capture.untouched`).
"""

from __future__ import annotations

import torch

from piper_nb.plan.sizes import random_value

__all__ = ["region_flops", "region_inputs"]


def region_inputs(plan, r: int, seed: int = 0, device=None) -> list[torch.Tensor]:
    """Random (float) or zero (integer) tensors shaped like region r's inputs; on the meta
    `device`, empty ones (no values to draw: FLOPs depend on shapes only)."""
    gen = torch.Generator().manual_seed(seed)
    args = []
    for v in plan.regions[r].inputs:
        info = plan.values[v]
        if device is not None and torch.device(device).type == "meta":
            t = torch.empty(info.shape, dtype=getattr(torch, info.dtype), device="meta")
        else:
            t = random_value(info, generator=gen)
        if t.is_floating_point():
            t.requires_grad_(info.requires_grad)
        args.append(t)
    return args


def region_flops(plan) -> dict[int, float]:
    """Region -> forward FLOPs on one microbatch slice (FlopCounterMode)."""
    from piper_nb.capture.annotate import flop_counter
    from piper_nb.capture.untouched import untouched
    out = {}
    home = next((p.device for p in plan.capture.model.parameters()), torch.device("cpu"))
    with untouched(plan.capture.model), torch.no_grad():
        for r in range(len(plan.regions)):
            module = plan.capture.modules[r]
            # a region without parameters of its own (a residual add between tensor-parallel
            # parts) runs where the model lives: on the meta device, shapes only
            device = next((p.device for p in module.parameters()), None) or home
            args = [a.to(device) for a in region_inputs(plan, r, device=device)]  # meta: meta
            with flop_counter() as counter:
                module(*args)
            out[r] = float(counter.get_total_flops())
    return out
