"""Routed rows: how big an expert layer's buffers are on each device, given a routing.

`pn.compile` marks the values whose first dimension is a routed token count (`plan.rows`:
value -> symbol) and how each region's saved bytes grow per routed row
(`plan.saved_rows`), see `compiler.token_rows`. A routing says, per forward dispatch
(`"value@mb"`), how many rows each member of its group sends the expert; a measured step
records the one it made (`trace.meta["tokens"]`). Without one, every member routes as the
captured microbatch did.

Where a buffer lives decides which count sizes it: on the replica side (the router, the
combine) a member's own rows; inside the expert, on its owner, the group's total (the owner
concatenates what every member dispatched). So does the time of an expert's passes:
`expert_scale` is the group's rows over one member's (a region's inputs as captured). The
analytic model counts an expert's operators on the group's rows (`sim.flops`); a profile,
timed on one member's, scales its times by it (`scale_experts`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from piper_nb.ir.kinds import Op
from piper_nb.plan.sizes import element_size, value_bytes
from piper_nb.plan.token_rows import captured_rows, saved_at

__all__ = ["Routing", "expert_scale", "scale_experts"]


class Routing:
    """Rows of routed values and saved bytes of regions, per device and microbatch."""

    def __init__(self, plan, tokens: Mapping[str, Sequence[int]] | None = None):
        self.plan, self.tokens = plan, dict(tokens or {})
        self.hints = captured_rows(plan.rows, plan.values)
        self.source: dict[str, tuple[str, tuple[int, ...]]] = {}  # symbol -> (value, group)
        dispatched: set[str] = set()
        if plan.rows:
            for dp in plan.devices:
                for ins in dp.instrs:
                    if ins.is_counted_dispatch:
                        dispatched.update(ins.data.values)
                        for v in ins.data.values:
                            if v in plan.rows:
                                self.source[plan.rows[v]] = (v, tuple(ins.data.group))
        # regions that run inside an expert (on its owner): they take dispatched values
        self.experts = frozenset(r.index for r in plan.regions
                                 if any(v in dispatched for v in r.inputs))
        self.row_bytes = {v: math.prod(plan.values[v].shape[1:]) * element_size(plan.values[v].dtype)
                          for v in plan.rows}

    def counts(self, symbol: str, mb: int) -> tuple[int, ...]:
        """Rows each group member dispatches for `symbol` in microbatch `mb`."""
        value, group = self.source[symbol]
        got = self.tokens.get(f"{value}@{mb}")
        return tuple(got) if got is not None else (self.hints[symbol],) * len(group)

    def rows(self, symbol: str, mb: int, device: int, total: bool) -> int:
        """`device`'s own rows of `symbol`, or (`total`) the whole group's, as its owner."""
        if symbol not in self.source:
            return self.hints[symbol]
        counts = self.counts(symbol, mb)
        if total:
            return sum(counts)
        group = self.source[symbol][1]
        return counts[group.index(device)] if device in group else self.hints[symbol]

    def value_bytes(self, value: str, mb: int, device: int, total: bool = False) -> int:
        symbol = self.plan.rows.get(value)
        if symbol is None:
            info = self.plan.values.get(value)
            return value_bytes(info) if info is not None else 0
        return self.rows(symbol, mb, device, total) * self.row_bytes[value]

    def saved(self, region: int, mb: int, device: int) -> int:
        """Bytes autograd saves in `region`'s forward of microbatch `mb` on `device`."""
        base = self.plan.saved.get(region, 0)
        coef = self.plan.saved_rows.get(region)
        if not coef:
            return base
        total = region in self.experts
        at = {s: self.rows(s, mb, device, total) for s in coef}
        return saved_at(base, coef, at, self.hints)


def expert_scale(plan) -> dict[int, float]:
    """Region -> the factor on its pass times: an expert region (it reads a dispatched
    value) runs on the group's rows, where a cost model prices it on the captured member's;
    every member routes as the captured microbatch did."""
    if not plan.rows:
        return {}
    routing = Routing(plan)
    out = {}
    for r in routing.experts:
        for v in plan.regions[r].inputs:
            symbol = plan.rows.get(v)
            if symbol in routing.source and routing.hints[symbol]:
                group = routing.source[symbol][1]
                out[r] = routing.rows(symbol, 0, group[0], True) / routing.hints[symbol]
                break
    return out


def scale_experts(plan, passes: dict) -> dict:
    """`passes` ((region, pass) -> time, as timed on one member's rows) with the expert
    regions' compute scaled (`expert_scale`), what grows with the rows on a CPU; the
    update is the expert's own parameters', unscaled."""
    scale = expert_scale(plan)
    return {key: t * scale[key[0]] if key[0] in scale and key[1] != Op.U else t
            for key, t in passes.items()}
