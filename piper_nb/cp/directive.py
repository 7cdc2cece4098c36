"""`context_parallel`: cut the sequence of the matched regions over a group of devices
(context parallelism: Megatron's `--context-parallel-size`, torchtitan's `context_parallel`).

The value `ContextParallel` (JSON `{"op": "context_parallel", "filter": {...}, "devices":
[0, 1], "load_balance": "zigzag"}`), its constructor `pn.context_parallel`, its capture
pass (`cut_context`: every region run on each device's tokens, its attention ring
attention, `cp.rewrite`) and its two DAG passes: `place_context` puts the regions' passes
on the group, every member running them on its share, and `insert_cp_collectives` puts
between a region's parts the all-gather of every member's keys and values, and after
their backward the reduce-scatter of those gradients' shares. The parameters are held
whole by every member, which sums their gradients as replicas do (`gradient sync`), and
the step's loss is the members' mean.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from piper_nb.capture.loss import model_loss
from piper_nb.capture.ring_attention import BALANCES
from piper_nb.capture.untouched import untouched
from piper_nb.cp.rewrite import cut_capture
from piper_nb.directives.base import (
    CaptureContext,
    Context,
    Directive,
    Directives,
    call_code,
    check_choice,
    check_groups,
    groups_code,
    groups_of,
)
from piper_nb.directives.spec import register
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter, matches
from piper_nb.ir.kinds import PASSES, EdgeKind, Op, Purpose
from piper_nb.ir.node import Edge, Node, node_id
from piper_nb.tp import tp_groups

__all__ = ["ContextParallel", "context_parallel", "context_degree", "cut_context",
           "place_context", "insert_cp_collectives", "ROTATES"]

ROTATES = ("all_gather", "p2p")


@dataclass(frozen=True)
class ContextParallel(Directive):
    """Cut the sequence of the matched regions over a device group, attention as ring
    attention over the group."""

    filter: Mapping[str, Any]
    devices: tuple
    load_balance: str = "zigzag"
    rotate: str = "all_gather"
    op = "context_parallel"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter,
                                                     where="context_parallel filter"))
        object.__setattr__(self, "devices", check_groups(self.devices, "context_parallel"))
        if self.degree < 2:
            raise PlanError(f"context_parallel: devices {list(self.groups[0])} is one device; "
                            "give the group of two or more devices that share the sequence")
        check_choice(self.op, "load_balance", self.load_balance, BALANCES)
        check_choice(self.op, "rotate", self.rotate, ROTATES)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        return groups_of(self.devices)

    @property
    def degree(self) -> int:
        return len(self.groups[0])

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "context_parallel", "filter": {}, "devices": [0, 1]}

    def code(self) -> str:
        return call_code("pn.context_parallel", context_parallel,
                         {**vars(self), "devices": groups_code(self.devices)})


register(ContextParallel)


def context_parallel(filter: Mapping[str, Any], devices, load_balance: str = "zigzag",
                     rotate: str = "all_gather") -> ContextParallel:
    """Cut the sequence of the regions `filter` matches over `devices` (context
    parallelism): each device runs them on its share of the tokens, and attention
    (`scaled_dot_product_attention`) becomes ring attention over every device's keys and
    values, causal by global position. `load_balance="zigzag"` gives device r chunks r and
    2n-1-r of 2n (the causal mask's work evened out, as Megatron and torchtitan do);
    `"contiguous"` gives it chunk r of n. Positions (rotary angles, position embeddings)
    are the tokens' global ones. The filter must match every region (the sequence is cut
    where the batch comes in). The sequence length must divide by 2n (zigzag) or n.
    `rotate` is how keys and values go round: `"all_gather"` gathers every member's
    before attention (torchtitan's default), `"p2p"` passes them from member to member,
    each step's exchange beside the previous block's attention (Megatron's default,
    `cp_comm_type="p2p"`; the plan's SEND and RECV instructions, `cp.ring`)."""
    return ContextParallel(filter, devices, load_balance, rotate)


def context_degree(directives) -> int:
    """How many devices share each sequence (1 without context parallelism)."""
    return max((d.degree for _, d in directives if isinstance(d, ContextParallel)), default=1)


def cut_context(capture, directives: Directives, ctx: CaptureContext):
    """The capture pass: every region cut over the context (`cp.rewrite`); a capture cut
    already (a rebatch) stays as it is."""
    if not directives or capture.cp is not None:
        return capture
    if len(directives) > 1:
        i, d = directives[1]
        raise PlanError("context_parallel: give one context_parallel directive (one group); "
                        "several groups are not supported yet", directive=i, op=d.op)
    i, d = directives[0]
    missed = [r.name for r in capture.regions if not matches(d.filter, dict(r.tags))]
    if missed:
        raise PlanError(f"context_parallel: filter {dict(d.filter)} leaves out regions "
                        f"{', '.join(missed)}; the sequence is cut where the batch comes in, "
                        "so every region must run on the context: use filter {}",
                        directive=i, op=d.op)
    if capture.loss_fn is model_loss and capture.loss_mean != "global":
        raise PlanError("context_parallel: the model's own loss (Hugging Face's) is each "
                        "device's mean over the labels it holds, and the devices hold "
                        "different numbers of them (a shifted sequence's last is -100), so "
                        "their mean is not the sequence's; compile with loss_mean='global' "
                        "(the sum over every device's labels over their count)",
                        directive=i, op=d.op)
    with untouched(capture.model):
        return cut_capture(capture, d.degree, d.load_balance, i, ctx.batch, d.rotate)


def place_context(dag: TrainingDAG, directives: Directives, ctx: Context) -> TrainingDAG:
    """Passes not placed yet go to the group (one group only: with several, `place` and
    `replicate` say which runs where); every pass must run on whole groups, each in its
    order (a replica group of groups: the device at place k is rank k mod n of its
    group, of data-parallel replica k div n)."""
    cps = [(i, d) for i, d in directives if isinstance(d, ContextParallel)]
    if not cps or ctx.capture.cp is None:
        return dag
    i, d = cps[0]
    _check_over_tp_leads(i, d, tp_groups(directives))
    lead = {g[0]: g for g in d.groups}
    nodes = []
    for n in dag.nodes:
        if n.op in PASSES:
            if not n.devices and len(d.groups) == 1:
                n = dataclasses.replace(n, devices=d.groups[0])
            runs = tuple(n.devices)
            cut = [runs[k:k + d.degree] for k in range(0, len(runs), d.degree)]
            if not runs or any(lead.get(c[0]) != c for c in cut):
                raise PlanError(f"{n.id} runs on devices {list(runs)}, which are not whole "
                                f"context groups of {[list(g) for g in d.groups]} in their "
                                "order; place and replicate the regions over the groups' "
                                "devices, group after group", directive=i, op=d.op)
        nodes.append(n)
    return dag.replace(nodes=nodes, step=f"{len(d.groups)} groups of {d.degree}")


def _check_over_tp_leads(i: int, d: ContextParallel, tp: dict) -> None:
    """With tensor parallelism the context runs over the groups' first devices (each TP
    group follows its first device, `tp.widen`): every context member must lead a group,
    all of one degree."""
    if not tp:
        return
    members = {m: g for g in tp.values() for m in g[1:]}
    n, t = d.degree, len(next(iter(tp.values())))
    for dev in (dev for g in d.groups for dev in g):
        if dev in members or dev not in tp:
            why = (f"is a member of the tensor-parallel group {list(members[dev])}"
                   if dev in members else "leads no tensor-parallel group")
            raise PlanError(f"context_parallel: device {dev} of context group "
                            f"{[list(g) for g in d.groups]} {why}; with tensor "
                            "parallelism the context runs over the groups' first devices, "
                            f"each group following its first: for CP {n} x TP {t}, "
                            f"context_parallel({{}}, {[k * t for k in range(n)]}) with "
                            f"tensor_parallel({{}}, "
                            f"{[list(range(k * t, k * t + t)) for k in range(n)]})",
                            directive=i, op=d.op)
    sizes = {len(tp[dev]) for g in d.groups for dev in g}
    if len(sizes) > 1:
        raise PlanError(f"context_parallel: its devices lead tensor-parallel groups of "
                        f"sizes {sorted(sizes)}; give the groups one degree",
                        directive=i, op=d.op)


def insert_cp_collectives(dag: TrainingDAG, directives: Directives, ctx: Context
                          ) -> TrainingDAG:
    """Between a region's parts, per microbatch: after a part's forward, the all-gather of
    the keys and values the next part reads; after that part's backward, the
    reduce-scatter of their gradients' shares."""
    layout = ctx.capture.cp
    if not directives or layout is None:
        return dag
    nodes, edges, made = list(dag.nodes), [], {}
    for e in dag.edges:
        a, b = dag[e.src], dag[e.dst]
        grad = a.op != Op.F
        moved = _moved(layout, a, b, e)
        if e.kind != EdgeKind.DATA or not moved:
            edges.append(e)
            continue
        if a.id not in made:   # one collective per context group the pass runs on
            tags = {k: v for k, v in a.tags if k != "PASS"}
            kind = Op.REDUCE_SCATTER if grad else Op.ALL_GATHER
            n = layout.degree
            made[a.id] = [Node(node_id(kind, tags, f"#cp{'B' if grad else 'F'}{k // n}"), kind,
                               a.tags, a.region, a.devices[k:k + n], "cp",
                               (("grad", grad), ("purpose", str(Purpose.CP)),
                                ("values", tuple(moved))))
                          for k in range(0, len(a.devices), n)]
            nodes.extend(made[a.id])
            # the values on the way in too: what the lowering frees reads them there
            edges.extend(Edge(a.id, c.id, EdgeKind.DATA, tuple(moved)) for c in made[a.id])
        edges.extend(Edge(c.id, b.id, EdgeKind.DATA, tuple(moved)) for c in made[a.id])
        rest = tuple(v for v in e.values if v not in moved)
        if rest:
            edges.append(Edge(e.src, e.dst, e.kind, rest, e.origin))
    return dag.replace(nodes=nodes, edges=edges,
                       step=f"{sum(map(len, made.values()))} collectives")


def _moved(layout, a: Node, b: Node, e: Edge) -> list[str]:
    """The values on edge a -> b the group gathers (forward) or whose gradients' shares it
    reduce-scatters (backward)."""
    if a.region not in layout.parts or b.region not in layout.parts:
        return []
    if a.op == Op.F and b.op == Op.F:
        return [v for v in e.values if v in layout.gathered]
    if a.op in (Op.B, Op.BI) and b.op in (Op.B, Op.BI, Op.BW):
        return [v for v in e.values if v in layout.grad_sum]
    return []
