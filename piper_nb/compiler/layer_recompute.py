"""Full recompute of a tensor-parallel layer as one unit: it keeps only the layer's input.

`pn.recompute` marks every forward and backward it matches (`directives.recompute`), and a
recomputed region keeps its inputs until its backward runs its forward again. A region cut
into tensor-parallel parts (`tp.rewrite`) would then keep every part's inputs: the
all-reduced (under SP, all-gathered) activations between the parts, about five times the
layer's input, where Megatron's full recompute keeps the input alone (2sbh bytes in bf16,
over t with SP; Korthikanti et al. 2022, section 5).

So when every part of a (region, microbatch) is recomputed in full, this pass, run right
after the recompute pass, recomputes them together:

- each part's forward runs once without autograd and keeps nothing (`Unit.FIRST`);
- a second forward of every part (`Unit.AGAIN`, node id `...#again`) and a copy of each
  forward collective between the parts run before the layer's backwards: the first of them
  after whatever any of those backwards waits on from outside the layer (the gradients
  received or made, the schedule's order), each reading the layer's inputs from their
  producers and the other parts' values from the copies;
- a ZeRO-3 gather before a part's forward gets a copy before its second run (or, kept for
  the step, that run as one more consumer);
- the parts' backwards are plain backwards of the second runs' stashes.

A second run stores only the outputs another second run reads (`Pass.keep`); the lowering
frees each value between the parts after its last reader in the first forward and again
after the second. Each second run draws the random numbers its first run drew
(`runtime.rng` seeds part 0 as the region, and part k from where part k - 1 ended), so
dropout masks match. Where a value between the parts also leaves the layer, the filter
names some parts only, or the parts are a segment an order left out (`floating`, placed by
`compiler.floating_passes`), the parts recompute alone, each keeping its inputs.
"""

from __future__ import annotations

from collections import defaultdict

from piper_nb.directives.base import Context, Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import BACKWARDS, EdgeKind, Op, Purpose, Unit
from piper_nb.ir.node import Edge, Node

__all__ = ["recompute_layers", "AGAIN"]

AGAIN = "#again"   # the id suffix of a second run and of its collectives' copies


def recompute_layers(dag: TrainingDAG, _: Directives, ctx: Context) -> TrainingDAG:
    """The DAG with each fully recomputed tensor-parallel (region, microbatch) run again as
    one unit (the module docstring)."""
    layout = ctx.capture.tp
    if layout is None:
        return dag
    units: dict[tuple, dict[int, Node]] = defaultdict(dict)
    for n in dag.nodes:
        if n.op == Op.F and n.region in layout.parts:
            orig, k = layout.parts[n.region]
            units[(orig, n.mb)][k] = n
    count = {orig: sum(1 for o, _ in layout.parts.values() if o == orig)
             for orig, _ in units}
    nodes, edges = list(dag.nodes), list(dag.edges)
    done = 0
    for (orig, _), forwards in sorted(units.items(), key=lambda kv: str(kv[0])):
        if len(forwards) != count[orig] or len(forwards) < 2 or not all(
                f.attrs and f.attr("recompute") is not None and not f.attr("floating")
                for f in forwards.values()):
            continue
        unit = _Unit(dag, forwards)
        if unit.leaks():
            continue
        nodes, edges = unit.rewrite(nodes, edges)
        done += 1
    if not done:
        return dag
    return dag.replace(nodes=nodes, edges=edges, step=f"{done} layers as units")


class _Unit:
    """One (region, microbatch) whose parts are recomputed together."""

    def __init__(self, dag: TrainingDAG, forwards: dict[int, Node]):
        self.dag, self.forwards = dag, forwards
        self.fids = fids = frozenset(f.id for f in forwards.values())
        regions = {f.region for f in forwards.values()}
        mb = next(iter(forwards.values())).mb
        self.collectives = {n.id for f in fids for e in dag.out_edges(f)
                            if (n := dag[e.dst]).attr("purpose") == Purpose.TP
                            and not n.attr("grad")}
        self.copied = fids | self.collectives            # what runs again, by its copy
        self.backwards = {n.id for n in dag.nodes if n.op in BACKWARDS
                          and n.region in regions and n.mb == mb}
        self.inside = self.copied | self.backwards | {
            n.id for n in dag.nodes if n.region in regions and n.mb == mb
            and n.attr("purpose") == Purpose.TP}
        self.first = forwards[min(forwards)]

    def leaks(self) -> bool:
        """Does a value between the parts also leave the layer (then it would be stored
        twice, or freed while a later reader outside still needs it)?"""
        inner, outer = set(), set()
        for f in self.copied:
            for e in self.dag.out_edges(f):
                if e.kind == EdgeKind.DATA:
                    (inner if e.dst in self.copied else outer).update(e.values)
        return bool(inner & outer)

    def rewrite(self, nodes: list[Node], edges: list[Edge]) -> tuple[list[Node], list[Edge]]:
        dag, copy, fids = self.dag, {i: i + AGAIN for i in self.copied}, self.fids
        keep: dict[str, list[str]] = defaultdict(list)
        out_edges: list[Edge] = []
        for e in edges:
            if e.src in self.copied and e.dst in self.backwards:   # the stash: the 2nd run's
                out_edges.append(Edge(copy[e.src], e.dst, e.kind, e.values, e.origin))
                continue
            out_edges.append(e)
            if e.dst not in self.copied or e.kind != EdgeKind.DATA:
                continue
            if e.src in self.copied:
                out_edges.append(Edge(copy[e.src], copy[e.dst], e.kind, e.values, e.origin))
                if dag[e.src].op == Op.F:
                    keep[e.src] += e.values
            elif dag[e.dst].op == Op.F and not _pulled_gather(dag[e.src]):
                out_edges.append(Edge(e.src, copy[e.dst], e.kind, e.values, e.origin))
        waits = fids | {e.src for b in self.backwards if dag[b].op != Op.BW   # BW: later
                        for e in dag.in_edges(b)
                        if e.src not in self.inside and not _pulled_gather(dag[e.src])}
        out_edges += [Edge(w, copy[self.first.id], EdgeKind.TEMPORAL) for w in sorted(waits)]
        out_nodes: list[Node] = []
        for n in nodes:
            if n.id in fids:
                n = n.with_attrs(unit=Unit.FIRST)
            elif n.id in self.backwards and n.attrs and n.attr("recompute") is not None:
                n = n.with_attrs(recompute=None)
            elif _pulled_gather(n) and set(n.attr("consumers") or ()) & fids:
                mine = tuple(copy[c] for c in n.attr("consumers") if c in fids)
                n = n.with_attrs(consumers=(*n.attr("consumers"), *mine))
                out_edges += [Edge(n.id, c, EdgeKind.DATA, ()) for c in mine]
            elif _pulled_gather(n) and not n.attr("consumers") and n.attr("before") in fids:
                again = copy[n.attr("before")]
                g = Node(n.id + AGAIN, n.op, n.tags, n.region, n.devices, n.stream,
                         tuple(sorted({**dict(n.attrs), "before": again}.items())))
                out_nodes.append(g)
                out_edges.append(Edge(g.id, again, EdgeKind.DATA, ()))
            out_nodes.append(n)
        for i in sorted(self.copied):
            n = dag[i]
            attrs = {k: v for k, v in n.attrs if k not in ("overlap", "floating", "recompute")}
            if n.op == Op.F:
                attrs.update(unit=Unit.AGAIN, keep=tuple(dict.fromkeys(keep[i])))
            out_nodes.append(Node(copy[i], n.op, n.tags, n.region, n.devices, n.stream,
                                  tuple(sorted(attrs.items()))))
        return out_nodes, out_edges


def _pulled_gather(n: Node) -> bool:
    """A ZeRO-3 gather pulled before a pass (its own, not something the unit waits on)."""
    return n.op == Op.ALL_GATHER and n.attr("before") is not None
