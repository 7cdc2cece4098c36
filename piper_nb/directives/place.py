"""`place`: run the matched compute on a device group (Piper's place).

The value `Place` (JSON `{"op": "place", "filter", "devices", "stream"}`), its constructor
`pn.place`, and the rewrite: later placements override earlier ones node by node; the
optimizer update U of a region defaults to every device that runs any of the region's
passes (see `compiler.placement.check_placement`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from piper_nb.directives.base import (
    Context,
    Directive,
    Directives,
    call_code,
    check_devices,
    check_stream,
)
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter
from piper_nb.ir.kinds import Op

__all__ = ["Place", "place", "apply_places"]


@dataclass(frozen=True)
class Place(Directive):
    """Run the matched compute on `devices` (a group: SPMD replicas when replicated)."""

    filter: Mapping[str, Any]
    devices: tuple[int, ...]
    stream: str | None = None
    op = "place"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="place filter"))
        object.__setattr__(self, "devices", check_devices(self.devices, "place"))
        object.__setattr__(self, "stream", check_stream(self.stream, "place"))

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "place", "filter": {"PP": 0}, "devices": [0]}

    def code(self) -> str:
        return call_code("pn.place", place, vars(self))


def place(filter: Mapping[str, Any], devices: Sequence[int] | int, stream: str | None = None) -> Place:
    """Run the compute `filter` matches on `devices` (a group of SPMD replicas when it is
    also replicated); `stream` names the stream its passes run on."""
    return Place(filter, devices, stream)


def apply_places(dag: TrainingDAG, places: Directives, ctx: Context) -> TrainingDAG:
    """All place directives in one rewrite; later ones override earlier ones per node."""
    if not places:
        return dag
    where: dict[str, object] = {}
    for index, d in places:
        chosen = dag.select(d.filter, (Op.F, Op.B, Op.BI, Op.BW, Op.U))
        if not chosen:
            raise PlanError(f"place filter {dict(d.filter)} matches no compute node; "
                            f"the regions are {_region_names(dag)}", directive=index, op="place")
        for n in chosen:
            where[n.id] = d
    nodes = []
    for n in dag.nodes:
        d = where.get(n.id)
        if d is not None:
            n = dataclasses.replace(n, devices=d.devices)
            if d.stream:
                n = n.with_attrs(comm_stream=d.stream)
        nodes.append(n)
    return dag.replace(nodes=nodes, step=f"{len(places)} directives")


def _region_names(dag: TrainingDAG) -> str:
    return ", ".join("{" + r.name + "}" for r in dag.regions())
