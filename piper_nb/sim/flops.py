"""FLOPs per region, counted by running each region once on one microbatch slice under
`FlopCounterMode` (`capture.annotate.flop_counter` also counts the `_grouped_mm` of
Hugging Face's stacked experts). `each_region` runs every region so for any counter (the
per-operator one of `sim.op_counts` too); an expert region of a sharded plan runs on its
group's routed rows (`sim.tokens.expert_scale`), as its owner does. Pure: no process,
and the user's model keeps its buffers and random state (`capture.untouched`).
"""

from __future__ import annotations

import dataclasses

import torch

from piper_nb.capture.meta_routing import on_meta
from piper_nb.plan.sizes import random_value

__all__ = ["region_flops", "region_inputs", "each_region", "signature"]


def region_inputs(plan, r: int, seed: int = 0, device=None,
                  rows: dict | None = None) -> list[torch.Tensor]:
    """Random (float) or zero (integer) tensors shaped like region r's inputs (`rows`:
    value -> its first dimension instead); on the meta `device`, empty ones (no values to
    draw: FLOPs depend on shapes only)."""
    gen = torch.Generator().manual_seed(seed)
    args = []
    for v in plan.regions[r].inputs:
        info = plan.values[v]
        if rows and v in rows:
            info = dataclasses.replace(info, shape=(rows[v], *info.shape[1:]))
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

    def count(module, args) -> float:
        with flop_counter() as counter:
            module(*args)
        return float(counter.get_total_flops())
    return each_region(plan, count)


def each_region(plan, count, grad: bool = False) -> dict:
    """Region -> `count(module, args)` for every region of `plan`, run on one microbatch
    slice of its inputs where its parameters live (a region without any of its own, such as
    a residual add between tensor-parallel parts, where the model does), the user's model
    keeping its buffers and random state; with autograd where `grad` (the inputs that need
    a gradient require one). On the meta device, where only shapes matter, a model's
    repeated layers (one `signature`) are counted once; with values, routing to experts can
    differ layer by layer."""
    from piper_nb.capture.untouched import untouched
    from piper_nb.sim.tokens import expert_scale
    out, seen = {}, {}
    scale = expert_scale(plan)
    home = next((p.device for p in plan.capture.model.parameters()), torch.device("cpu"))
    with untouched(plan.capture.model), torch.enable_grad() if grad else torch.no_grad():
        for r in range(len(plan.regions)):
            module = plan.capture.modules[r]
            device = next((p.device for p in module.parameters()), None) or home
            # detached: FlopCounterMode's module tracker trips over an output aliasing an
            # input that needs a gradient (a part that only sums)
            # an expert runs on what its whole group routed to it
            rows = {v: round(plan.values[v].shape[0] * scale[r]) for v in plan.regions[r].inputs
                    if v in plan.rows} if r in scale else None
            args = [a.to(device).detach() for a in region_inputs(plan, r, device=device,
                                                                 rows=rows)]
            for a, v in zip(args, plan.regions[r].inputs, strict=True):
                if grad and a.is_floating_point() and plan.values[v].requires_grad:
                    a.requires_grad_(True)
            meta = torch.device(device).type == "meta"
            key = signature(module, args) if meta else None
            if key is not None and key in seen:
                out[r] = seen[key]
                continue
            out[r] = on_meta(meta, count, module, args)
            if key is not None:
                seen[key] = out[r]
    return out


def signature(module, args) -> tuple | None:
    """What a region's FLOPs depend on: its graph's ops with their constant arguments, the
    classes, settings and parameter shapes of the modules it calls, and its inputs' shapes
    and dtypes. Two regions with one signature (a model's repeated layers) count alike;
    None (never equal) for a module that is no graph."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return None
    index = {n: i for i, n in enumerate(graph.nodes)}

    def const(a):
        if isinstance(a, torch.fx.Node):
            return ("node", index[a])
        if isinstance(a, (list, tuple)):
            return tuple(const(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, const(v)) for k, v in a.items())
        if isinstance(a, torch.Tensor):
            return ("tensor", tuple(a.shape), str(a.dtype))
        return repr(a)

    ops = []
    for n in graph.nodes:
        if n.op == "get_attr":
            t = _attr(module, str(n.target))
            what = (tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t)
        elif n.op == "call_module":
            sub = module.get_submodule(str(n.target))
            what = tuple((type(m).__qualname__, repr(m), _settings(m),
                          tuple((k, tuple(p.shape), str(p.dtype))
                                for k, p in m.named_parameters(recurse=False)))
                         for _, m in sub.named_modules())
        elif n.op in ("call_function", "call_method"):
            what = n.target   # the op itself: a closure made per layer never matches another
        else:
            what = None
        ops.append((n.op, what, const(n.args), const(n.kwargs)))
    return (tuple(ops), tuple((tuple(a.shape), str(a.dtype)) for a in args))


def _attr(module, target: str):
    for part in target.split("."):
        module = getattr(module, part)
    return module


def _settings(m) -> tuple:
    return tuple(sorted((k, v) for k, v in vars(m).items()
                        if not k.startswith("_") and isinstance(v, (int, float, bool, str))))
