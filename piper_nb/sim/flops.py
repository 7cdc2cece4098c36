"""FLOPs per region, counted by running each region once on one microbatch slice under
`FlopCounterMode` (the analytic cost model; `capture.annotate.flop_counter` also counts the
`_grouped_mm` of Hugging Face's stacked experts). Pure: no process, and the user's model
keeps its buffers and random state (`capture.untouched`).
"""

from __future__ import annotations

import contextlib

import torch

from piper_nb.capture.meta_routing import balanced_routing
from piper_nb.plan.sizes import random_value

__all__ = ["region_flops", "region_flop_parts", "region_inputs"]


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
    return {r: total for r, (total, _) in region_flop_parts(plan).items()}


def _recomputed(counter) -> float:
    """FLOPs counted inside selective recompute's attention cores (`capture.attention_core`),
    which the backward runs again."""
    from piper_nb.capture.attention_core import CORE_PREFIX
    return float(sum(sum(ops.values()) for name, ops in counter.get_flop_counts().items()
                     if name.rsplit(".", 1)[-1].startswith(CORE_PREFIX)))


def region_flop_parts(plan) -> dict[int, tuple[float, float]]:
    """Region -> (forward FLOPs, the share of them its backward runs again: selective
    recompute's attention cores) on one microbatch slice (FlopCounterMode)."""
    from piper_nb.capture.annotate import flop_counter
    from piper_nb.capture.untouched import untouched
    out = {}
    home = next((p.device for p in plan.capture.model.parameters()), torch.device("cpu"))
    seen: dict = {}
    with untouched(plan.capture.model), torch.no_grad():
        for r in range(len(plan.regions)):
            module = plan.capture.modules[r]
            # a region without parameters of its own (a residual add between tensor-parallel
            # parts) runs where the model lives: on the meta device, shapes only
            device = next((p.device for p in module.parameters()), None) or home
            # detached: FLOPs need no gradient, and FlopCounterMode's module tracker trips
            # over an output aliasing an input that needs one (a part that only sums)
            args = [a.to(device).detach() for a in region_inputs(plan, r, device=device)]
            # on the meta device FLOPs follow from shapes: a model's repeated layers are
            # counted once (with values, routing to experts can differ layer by layer)
            meta = torch.device(device).type == "meta"
            key = _signature(module, args) if meta else None
            if key is None or key not in seen:
                with (balanced_routing() if meta else contextlib.nullcontext(),
                      flop_counter() as counter):
                    module(*args)
                out[r] = (float(counter.get_total_flops()), _recomputed(counter))
                if key is not None:
                    seen[key] = out[r]
            else:
                out[r] = seen[key]
    return out


def _signature(module, args) -> tuple | None:
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
