"""`order`: temporal edges from each slot to the next (Piper's order).

The value `Order` (Python `groups`; Piper's JSON `filters`), its constructor `pn.order`,
and the rewrite. An order is a list of groups, one per slot; a group is a list of filters,
and all nodes it selects share the slot and may overlap (how DualPipe's F&B pairs are
said): they get one `overlap` id. Temporal edges order the work of one device; an edge
between passes on different devices is an error.

A filter names a stage's pass. When the stage's tags come back later in the model, after
another stage (a module called again: region {PP: 0, SEG: 1} after {PP: 1}), the passes
of that later segment are left out of a slot whose filter does not name SEG, marked
`floating`: the lowering puts them in where their inputs have arrived (one global list
schedule, `compiler.floating`). A schedule written for the stages then runs such a model,
where holding them in the slot would make the stage wait for itself (1F1B's `0F1` after
`0F0` would wait for the second call of microbatch 0, which waits on stage 1). Segments
that stay within their stage (a mixture of experts' combine after its experts) are kept.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from piper_nb.directives.base import Context, Directive, Directives, py_literal
from piper_nb.errors import PlanError
from piper_nb.ir.action import Action
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import SEG, as_filter
from piper_nb.ir.kinds import COMPUTE, EdgeKind
from piper_nb.ir.node import Edge, Node

__all__ = ["Order", "order", "apply_orders"]


@dataclass(frozen=True)
class Order(Directive):
    """Temporal edges from each slot to the next; a group of several filters shares one
    slot and may overlap."""

    groups: tuple[tuple[Mapping[str, Any], ...], ...]
    # the schedule that wrote this order, for messages (`"the 1F1B schedule
    # (pn.schedules.one_f_one_b)"`); "" for an order the user wrote. Not part of the JSON.
    schedule: str = field(default="", compare=False)
    op = "order"
    json_names = {"groups": "filters"}
    json_skip = frozenset({"schedule"})

    def __post_init__(self):
        groups = self.groups
        if not isinstance(groups, (list, tuple)) or not groups:
            raise PlanError("order: groups (JSON filters) must be a non-empty list, one group "
                            "of filters per slot")
        out = []
        for i, group in enumerate(groups):
            if isinstance(group, Mapping):
                group = [group]
            if not isinstance(group, (list, tuple)) or not group:
                raise PlanError(f"order: group {i} must be a non-empty list of filters, got {group!r}")
            out.append(tuple(as_filter(f, where=f"order group {i}") for f in group))
        object.__setattr__(self, "groups", tuple(out))

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "order", "filters": [[{"PP": 0, "MB": 0, "PASS": "F"}],
                                           [{"PP": 0, "MB": 1, "PASS": "F"}]]}

    def code(self) -> str:
        return f"pn.order({py_literal(self.groups)})"


def order(groups: Sequence[Any]) -> Order:
    """Run the passes `groups` select one slot after another on their devices; a group of
    several filters shares a slot (the passes may overlap)."""
    return Order(groups)


def apply_orders(dag: TrainingDAG, orders: Directives, ctx: Context) -> TrainingDAG:
    """All order directives at once (one rewrite: selections see the same DAG)."""
    if not orders:
        return dag
    edges: list[Edge] = []
    patched: dict = {}
    dropped: dict[str, int] = {}
    ordered: set[str] = set()
    overlap = 0
    for index, directive in orders:
        new_edges, new_nodes, overlap, left, slots = _order_edges(dag, directive, index, overlap)
        edges += new_edges
        patched.update(new_nodes)
        dropped.update(dict.fromkeys(left, index))
        ordered.update(nid for ids in slots for nid in ids)
    # a pass some order names (with its SEG tag) is ordered, not floating
    dropped = {nid: i for nid, i in dropped.items() if nid not in ordered}
    for nid in dropped:
        patched[nid] = patched.get(nid, dag[nid]).with_attrs(floating=True)
    nodes = [patched.get(n.id, n) for n in dag.nodes] if patched else dag.nodes
    out = dag.replace(nodes=nodes, edges=(*dag.edges, *edges),
                      step=f"{len(orders)} directives")
    if dropped:
        out = out.replace(edges=(*out.edges, *_after_anchors(out, dropped)))
    return out


def _action(f: Mapping[str, Any]) -> str:
    """A filter of a schedule's slot in the grid's text form (`0F1`), else as a dict."""
    try:
        return str(Action(f["PP"], f["PASS"], f["MB"]))
    except (KeyError, TypeError, PlanError):
        return str(dict(f))


def _action_of(node: Node) -> str:
    return _action({**dict(node.tags), "PASS": node.op.value})


def _share(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two device lists meet (the same list, on one stage's thousands of replicas,
    without building sets)."""
    return bool(a) and (a is b or a == b or not set(a).isdisjoint(b))


def _sizes(dag: TrainingDAG, directive) -> str:
    """What a schedule runs against what the model has, and the fix, in numbers."""
    def count(values) -> int:
        found = [v for v in values if isinstance(v, int)]
        return max(found) + 1 if found else 1
    wants = [dict(f) for g in directive.groups for f in g]
    stages, micro = count(f.get("PP") for f in wants), count(f.get("MB") for f in wants)
    have_pp = count(dict(r.tags).get("PP") for r in dag.regions())
    have_mb = count(n.mb for n in dag.nodes)
    fixes = ([f"cut the model into {stages} stages (pn.cut_stages(model, {stages}))"]
             if stages != have_pp else [])
    fixes += [f"split the batch into {micro} microbatches"] if micro != have_mb else []
    return (f"the schedule runs {stages} stages x {micro} microbatches, the model has "
            f"{have_pp} x {have_mb}: " + (" and ".join(fixes) or "check the cut's stage tags"))


def _order_edges(dag: TrainingDAG, directive, index: int, first_overlap: int):
    slots: list[list[str]] = []
    dropped: set[str] = set()
    for i, group in enumerate(directive.groups):
        ids: list[str] = []
        for f in group:
            selected = dag.select(f, COMPUTE)
            named = _named(dag, selected, f)
            if named is not selected:
                keep = {n.id for n in named}
                dropped.update(n.id for n in selected if n.id not in keep)
            hit = [n.id for n in named]
            if not hit and directive.schedule:
                raise PlanError(f"{directive.schedule}: its slot {i} ({_action(f)}) matches no "
                                f"pass of this model; {_sizes(dag, directive)}",
                                directive=index, op="order")
            if not hit:
                raise PlanError(f"order slot {i}: filter {dict(f)} matches no pass; check the "
                                "stage, microbatch and PASS (F, B, BI, BW)", directive=index,
                                op="order")
            ids += [h for h in hit if h not in ids]
        slots.append(ids)
    edges: list[Edge] = []
    overlap = first_overlap
    patched = {}
    for ids in slots:
        if len(ids) > 1 and len(directive.groups[slots.index(ids)]) > 1:
            for nid in ids:
                patched[nid] = dag[nid].with_attrs(overlap=overlap)
            overlap += 1
    for i in range(len(slots) - 1):
        pairs = _pairs(dag, slots[i], slots[i + 1])
        if not pairs:
            a, b = slots[i][0], slots[i + 1][0]
            if directive.schedule:
                raise PlanError(
                    f"{directive.schedule} runs {_action_of(dag[a])} and then "
                    f"{_action_of(dag[b])} on one rank, but they are "
                    f"placed on devices {list(dag[a].devices)} and {list(dag[b].devices)}; "
                    "place the stages where the schedule runs them (its place=True does)",
                    directive=index, op="order")
            raise PlanError(
                f"order slot {i} ({a} on {list(dag[a].devices)}) and slot {i + 1} ({b} on "
                f"{list(dag[b].devices)}) run on different devices; an order sequences "
                "one device's work: write one order per device", directive=index, op="order")
        edges += [Edge(a, b, EdgeKind.TEMPORAL, origin=index) for a, b in pairs]
    return edges, patched, overlap, dropped, slots


def _pairs(dag: TrainingDAG, first: list[str], then: list[str]) -> list[tuple[str, str]]:
    """The temporal edges that run slot `first` before slot `then`: every pair on shared
    devices, or, where both slots run on one device list, only from the passes of `first`
    that reach no other of its passes to those of `then` that no other of its passes reaches
    (the same order, one step of a stage's parts ordered by tens of edges, not thousands)."""
    devs = dag[first[0]].devices
    if all(dag[n].devices == devs for n in (*first, *then)):
        return [(a, b) for a in _ends(dag, first, devs, True)
                for b in _ends(dag, then, devs, False)]
    return [(a, b) for a in first for b in then if _share(dag[a].devices, dag[b].devices)]


def _ends(dag: TrainingDAG, ids: list[str], devs: tuple[int, ...], last: bool) -> list[str]:
    """The passes of one slot that reach (`last`), or are reached from, no other of its
    passes through nodes of the slot's devices and microbatch (a path on other devices
    would not order this device's work). One depth-first walk for the whole slot: whether
    a node leads to the slot is remembered, so each node is walked once, not once a pass."""
    slot = set(ids)
    mb = dag[ids[0]].mb
    nexts = ((lambda n: (e.dst for e in dag.out_edges(n))) if last
             else (lambda n: (e.src for e in dag.in_edges(n))))
    leads: dict[str, bool] = {}   # a node of the slot's devices and microbatch -> to the slot

    def reaches(start: str) -> bool:
        stack = [(start, iter(nexts(start)))]
        while stack:
            nid, it = stack[-1]
            for nxt in it:
                if nxt in slot or leads.get(nxt):
                    for x, _ in stack:       # every node on the stack leads there
                        leads[x] = True
                    return True
                if nxt in leads:
                    continue
                n = dag[nxt]
                if n.devices == devs and n.mb == mb:
                    stack.append((nxt, iter(nexts(nxt))))
                    break
            else:
                leads[nid] = False
                stack.pop()
        return False

    return [start for start in ids if not reaches(start)]


def _named(dag: TrainingDAG, nodes: list[Node], filt) -> list[Node]:
    """The nodes a filter orders: a later segment of a stage that comes back after another
    stage (it depends on a region that differs in a tag the filter names and that itself
    depends on this stage) is left to run when its inputs arrive, unless the filter names
    SEG (see the docstring). A mixture of experts' combine, after its own stage's experts,
    stays."""
    if SEG in filt or all(n.tag(SEG) is None for n in nodes):
        return nodes
    keys = [k for k in filt if k not in ("MB", "PASS")]
    return [n for n in nodes if not n.tag(SEG) or not _comes_back(dag, n.region, keys)]


def _comes_back(dag: TrainingDAG, region: int, keys: list[str]) -> bool:
    tags = [dict(r.tags) for r in dag.regions()]
    anc = _ancestors(dag)
    stage = lambda r: tuple(tags[r].get(k) for k in keys)
    mine = stage(region)
    return any(stage(a) != mine and any(stage(b) == mine for b in anc[a]) for a in anc[region])


def _ancestors(dag: TrainingDAG) -> list[set[int]]:
    """Per region, the regions its forward depends on (transitively), from the values."""
    cache = dag._idx()
    if "region_ancestors" not in cache:
        regions = dag.regions()
        producer = {v: r.index for r in regions for v in r.outputs}
        out: list[set[int]] = []
        for r in regions:   # regions are numbered in dependency order
            anc = set()
            for v in r.inputs:
                if v in producer:
                    anc |= {producer[v]} | out[producer[v]]
            out.append(anc)
        cache["region_ancestors"] = out
    return cache["region_ancestors"]


def _after_anchors(dag: TrainingDAG, dropped: dict[str, int]) -> list[Edge]:
    """Temporal edges that keep each left-out pass after the passes of its own device it
    waits on through other devices (its data goes out and comes back, after whatever the
    other devices' orders put first), so its device does not wait for it too early."""
    edges = []
    for nid, index in sorted(dropped.items()):
        here = set(dag[nid].devices)
        seen, todo, anchors = {nid}, [nid], set()
        while todo:
            for e in dag.in_edges(todo.pop()):
                if e.src in seen:
                    continue
                seen.add(e.src)
                src = dag[e.src]
                if src.op in COMPUTE and set(src.devices) & here:
                    anchors.add(e.src)
                else:
                    todo.append(e.src)
        edges += [Edge(a, nid, EdgeKind.TEMPORAL, origin=index) for a in sorted(anchors)
                  if not any(e.dst == nid for e in dag.out_edges(a))]
    return edges
