"""`tensor_parallel`: shard the matched regions' linear layers over a group of devices
(Megatron's tensor parallelism), on the model as the user has it.

The value `TensorParallel` (JSON `{"op": "tensor_parallel", "filter": {...}, "devices":
[0, 1], "plan": {...}}`), its constructor `pn.tensor_parallel`, its capture pass
(`shard_regions`) and its two DAG passes. Where a
region runs is said as without it (`place`, `replicate`): each of those devices must be the
first of one of the directive's groups, and the group then runs everything that device
runs, each member its share of the sharded layers and the rest whole. With one group and
nothing placed, the matched regions go to its first device.

The capture cuts each sharded region into parts between its collectives
(`tp.rewrite`); `insert_tp_collectives` puts the collectives between the
parts' passes: after a sharded part's forward, the all-reduce of its partial sums; after
its backward, the all-reduce of its inputs' gradient shares (under sequence parallelism,
all-gathers of slices and reduce-scatters to slices, `_sum_kind`). The lowering copies each
group's first device's instructions to the other members (`tp.widen`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.capture.untouched import untouched
from piper_nb.directives.base import (
    CaptureContext,
    Context,
    Directive,
    Directives,
    call_code,
    check_groups,
    groups_code,
    groups_of,
)
from piper_nb.directives.spec import register
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter
from piper_nb.ir.kinds import PASSES, EdgeKind, Op, Purpose
from piper_nb.ir.node import Edge, Node, node_id
from piper_nb.tp.match import check_patterns
from piper_nb.tp.rewrite import TPRequest, shard_capture
from piper_nb.tp.styles import check_plan, model_tp_plan

__all__ = ["TensorParallel", "tensor_parallel", "tp_groups", "shard_regions",
           "place_tensor_parallel", "insert_tp_collectives"]


@dataclass(frozen=True)
class TensorParallel(Directive):
    """Shard the linear layers of the matched regions over each device group."""

    filter: Mapping[str, Any]
    devices: tuple
    plan: Mapping[str, str] | None = None
    sequence_parallel: bool = False
    op = "tensor_parallel"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="tensor_parallel filter"))
        object.__setattr__(self, "devices", check_groups(self.devices, "tensor_parallel"))
        plan = check_plan(self.plan)
        object.__setattr__(self, "plan", plan or None)
        if not isinstance(self.sequence_parallel, bool):
            raise PlanError("tensor_parallel: sequence_parallel is true or false")

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return groups_of(self.devices)

    @property
    def degree(self) -> int:
        return len(self.groups[0])

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "tensor_parallel", "filter": {"PP": 0}, "devices": [0, 1]}

    def code(self) -> str:
        return call_code("pn.tensor_parallel", tensor_parallel,
                         {**vars(self), "devices": groups_code(self.devices)})


register(TensorParallel)


def tensor_parallel(filter: Mapping[str, Any], devices, plan: Mapping[str, str] | None = None,
                    sequence_parallel: bool = False) -> TensorParallel:
    """Shard the linear layers of the regions `filter` matches over `devices` (one group,
    `[0, 1]`, or one per replica, `[[0, 1], [4, 5]]`): `plan` maps module patterns to
    `colwise`, `rowwise`, `vocab` (an embedding, or an LM head whose logits only the loss
    reads: a vocabulary-parallel cross-entropy), `colwise_gather_output` (an LM head) or
    `replicate` (`tp.styles`); without one, the model's own
    (Hugging Face's `base_model_tp_plan`, `pn.models`' `tp_plan`). Attention heads, grouped
    KV heads and the MLP width are divided; what cannot be is a PlanError.
    `sequence_parallel=True` (Megatron's sequence parallelism, `tp.sequence`) runs the
    norms, dropout and residual sums between the sharded layers on each device's slice
    of the sequence, which the degree must divide."""
    return TensorParallel(filter, devices, plan, sequence_parallel)


def tp_groups(directives) -> dict[int, tuple[int, ...]]:
    """First device of every tensor-parallel group -> the group."""
    out: dict[int, tuple[int, ...]] = {}
    for _, d in directives:
        if isinstance(d, TensorParallel):
            for g in d.groups:
                if out.get(g[0], g) != g:
                    raise PlanError(f"tensor_parallel: device {g[0]} leads two groups, "
                                    f"{list(out[g[0]])} and {list(g)}")
                out[g[0]] = g
    return out


def shard_regions(capture, directives: Directives, ctx: CaptureContext):
    """The capture pass: the matched regions cut into parts and their layers sharded
    (`tp.rewrite`); a capture already sharded (a rebatch) stays as it is."""
    if not directives or capture.tp is not None:
        return capture
    requests = []
    for i, d in directives:
        plan = d.plan or model_tp_plan(capture.model)
        if not plan:
            raise PlanError(f"tensor_parallel: {type(capture.model).__name__} has no "
                            "tensor-parallel plan of its own; give one, as plan={'layers.*."
                            "mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}",
                            directive=i, op=d.op)
        if d.plan:   # the user's: every pattern must match (a model's own may list more)
            check_patterns(capture.model, plan, i)
        requests.append(TPRequest(d.filter, d.degree, plan, i, d.sequence_parallel))
    with untouched(capture.model):
        return shard_capture(capture, requests, ctx.batch)


def place_tensor_parallel(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    """Passes of the matched regions not placed yet go to the first device of the group
    (one group only: with several, `replicate` says which replica runs where)."""
    if not directives:
        return dag
    nodes = []
    for n in dag.nodes:
        if not n.devices and n.op in PASSES:
            for _, d in directives:
                if n.selected_by(d.filter) and len(d.groups) == 1:
                    n = dataclasses.replace(n, devices=(d.groups[0][0],))
                    break
        nodes.append(n)
    return dag.replace(nodes=nodes, step=f"{len(directives)} directives")


def insert_tp_collectives(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    """The collectives between the parts of sharded regions, per microbatch; checks each
    sharded pass runs on the first devices of groups of its degree."""
    layout = ctx.capture.tp
    if not directives or layout is None:
        return dag
    groups = tp_groups(directives)
    members = {m: g for g in groups.values() for m in g[1:]}
    for n in dag.nodes:
        if n.op not in PASSES:
            continue
        for dev in n.devices:
            if dev in members:
                raise PlanError(f"{n.id} is placed on device {dev}, a member of the "
                                f"tensor-parallel group {list(members[dev])}; place it on the "
                                f"group's first device, {members[dev][0]}, which the group "
                                "follows", op="tensor_parallel")
        orig = layout.parts.get(n.region, (None,))[0]
        want = layout.degree.get(orig, 1) if orig is not None else 1
        for dev in n.devices:
            have = len(groups.get(dev, (dev,)))
            if want > 1 and have != want:
                idx = next(i for i, d in directives if d.degree == want)
                raise PlanError(f"{n.id} is sharded {want} ways but runs on device {dev}, which "
                                f"leads no tensor-parallel group of {want}; add device {dev} "
                                f"to the directive's devices", directive=idx, op="tensor_parallel")
    nodes, edges = list(dag.nodes), []
    made: dict[tuple[str, bool, Op], Node] = {}
    ar_ids: set[str] = set()
    for e in dag.edges:
        a, b = dag[e.src], dag[e.dst]
        summed = _summed(layout, a, b, e)
        if e.kind != EdgeKind.DATA or not summed:
            edges.append(e)
            continue
        grad = a.op != Op.F
        by_kind: dict[Op, list[str]] = {}
        for v in summed:
            by_kind.setdefault(_sum_kind(layout, v, grad), []).append(v)
        for kind, values in by_kind.items():
            key = (a.id, grad, kind)
            if key not in made:
                tags = {k: v for k, v in a.tags if k != "PASS"}
                ar = Node(node_id(kind, tags, "#tpB" if grad else "#tpF"), kind, a.tags,
                          a.region, a.devices, "tp",
                          (("grad", grad), ("purpose", str(Purpose.TP)), ("values", ())))
                made[key] = ar
                ar_ids.add(ar.id)
                nodes.append(ar)
                edges.append(Edge(a.id, ar.id, EdgeKind.DATA, ()))
            edges.append(Edge(made[key].id, b.id, EdgeKind.DATA, tuple(values)))
        rest = tuple(v for v in e.values if v not in summed)
        if rest:
            edges.append(Edge(e.src, e.dst, e.kind, rest, e.origin))
    out_values: dict[str, list[str]] = {}
    for e in edges:
        if e.src in ar_ids:
            out_values.setdefault(e.src, []).extend(e.values)
    final = [n.with_attrs(values=tuple(dict.fromkeys(out_values.get(n.id, ()))))
             if n.id in ar_ids else n for n in nodes]
    edges = [dataclasses.replace(e, values=tuple(dict.fromkeys(out_values[e.dst])))
             if e.dst in ar_ids and not e.values else e for e in edges]
    return dag.replace(nodes=final, edges=edges,
                       meta={"tp_groups": tuple(sorted(groups.items()))},
                       step=f"{len(made)} collectives")


_DUAL = {Op.ALL_GATHER: Op.REDUCE_SCATTER, Op.REDUCE_SCATTER: Op.ALL_GATHER}


def _sum_kind(layout, v: str, grad: bool) -> Op:
    """How the group sums `v` (`grad`: its gradient shares): an all-reduce, or under
    sequence parallelism an all-gather of a padded slice or a reduce-scatter of a partial
    cut to slices; the backward runs the forward's dual."""
    kind = layout.sums.get(v, Op.ALL_REDUCE)
    return _DUAL.get(kind, kind) if grad else kind


def _summed(layout, a: Node, b: Node, e: Edge) -> list[str]:
    """The values on edge a -> b that an all-reduce sums: a sharded part's partial outputs
    (forward), or its inputs' gradient shares (backward)."""
    if a.region not in layout.parts or b.region not in layout.parts:
        return []
    if a.op == Op.F and b.op == Op.F:
        return [v for v in e.values if v in layout.partial]
    if a.op in (Op.B, Op.BI) and b.op in (Op.B, Op.BI, Op.BW):
        return [v for v in e.values if v in layout.grad_sum]
    return []
