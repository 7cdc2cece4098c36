"""What global gradient-norm clipping asks of a plan at run time: whether it has the norm
step, and how much each device's parameters weigh in the world's squared norm (each
parameter counts once). The rewrite that adds the step is `compiler.clip`'s."""

from __future__ import annotations

from piper_nb.ir.kinds import Op
from piper_nb.plan.plan import Plan

__all__ = ["has_norm_step", "norm_weights"]


def has_norm_step(plan: Plan) -> bool:
    # a replica stamped from a template (`Plan.stamps`) issues what the template does
    return any(i.is_norm for dp in plan.devices if dp.stamp is None for i in dp.instrs)


def norm_weights(plan: Plan) -> dict[str, float]:
    """Parameter -> 1 / the number of places that update it (full copies, plus one per ZeRO
    bucket holding it), so the world's weighted sum counts each parameter once; a
    tensor-parallel one's places hold different shards, `degree` of them make it whole."""
    places: dict[str, int] = {}
    buckets: set[int] = set()
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == Op.U:
                for n in ins.data.params:
                    places[n] = places.get(n, 0) + 1
                buckets.update(ins.data.buckets)
    for b in buckets:
        for n in plan.buckets[b].params:
            places[n] = places.get(n, 0) + 1
    tp = plan.tp_params
    return {n: (tp[n][1] if n in tp else 1) / k for n, k in places.items()}
