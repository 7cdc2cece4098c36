"""Full recompute of a tensor- or context-parallel layer as one unit: it keeps only the
layer's input.

`pn.recompute` marks every forward and backward it matches (`directives.recompute`), and a
recomputed region keeps its inputs until its backward runs its forward again. A region cut
into tensor-parallel parts (`tp.rewrite`) would then keep every part's inputs: the
all-reduced (under SP, all-gathered) activations between the parts, about five times the
layer's input, where Megatron's full recompute keeps the input alone (2sbh bytes in bf16,
over t with SP; Korthikanti et al. 2022, section 5). A region cut over the context
(`cp.rewrite`) likewise keeps its queries and every member's gathered keys and values
between its parts, which grow with the whole sequence; as a unit it keeps its share of
the input, and gathers the keys and values again before its backward, as torchtitan's
activation checkpointing around ring attention does (on the point-to-point ring, its
exchanges run again: `cp.ring_dag`).

So when every part of a (region, microbatch) is recomputed in full, this pass, run right
after the recompute pass, recomputes them together:

- each part's forward runs once without autograd and keeps nothing (`Unit.FIRST`);
- a second forward of every part (`Unit.AGAIN`, node id `...#again`) and a copy of each
  forward collective between the parts run before the layer's backwards: the first of them
  after the parts' first runs and whatever any of those backwards (BW aside) waits on from
  outside the layer (the gradients received or made, the schedule's order), each reading
  the layer's inputs from their producers and the other parts' values from the copies;
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

from collections import Counter, defaultdict

from piper_nb.directives.base import Context, Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import BACKWARDS, EdgeKind, Op, Purpose, Unit
from piper_nb.ir.node import Edge, Node

__all__ = ["recompute_layers", "pulled_gather", "AGAIN"]

AGAIN = "#again"   # the id suffix of a second run and of its collectives' copies
_BETWEEN_PARTS = (Purpose.TP, Purpose.CP)   # the collectives between a region's parts


def recompute_layers(dag: TrainingDAG, _: Directives, ctx: Context) -> TrainingDAG:
    """The DAG with each fully recomputed tensor-parallel (region, microbatch) run again as
    one unit (the module docstring). One pass over the nodes and edges for all of them: a
    405B plan has thousands of units."""
    layout = ctx.capture.tp or ctx.capture.cp   # one of them per program (`cp.cut_context`)
    if layout is None:
        return dag
    forwards: dict[tuple, dict[int, Node]] = defaultdict(dict)
    by_part: dict[tuple, list[Node]] = defaultdict(list)   # (region, mb) -> its nodes
    for n in dag.nodes:
        by_part[(n.region, n.mb)].append(n)
        if n.op == Op.F and n.region in layout.parts:
            orig, k = layout.parts[n.region]
            forwards[(orig, n.mb)][k] = n
    count = Counter(orig for orig, _ in layout.parts.values())
    units = [u for key, fs in sorted(forwards.items(), key=lambda kv: str(kv[0]))
             if len(fs) == count[key[0]] > 1 and all(
                 f.attrs and f.attr("recompute") is not None and not f.attr("floating")
                 for f in fs.values())
             and not (u := _Unit(dag, fs, by_part)).leaks()]
    if not units:
        return dag
    nodes, gathers = _nodes(dag, units)
    return dag.replace(nodes=nodes, edges=_edges(dag, units) + gathers,
                       step=f"{len(units)} layers as units")


class _Unit:
    """One (region, microbatch) whose parts are recomputed together: its first forwards
    (`fids`), the forward collectives between them, its backwards, and `keep`, what each
    forward hands another part (its second run stores those)."""

    def __init__(self, dag: TrainingDAG, forwards: dict[int, Node], by_part: dict):
        self.fids = fids = frozenset(f.id for f in forwards.values())
        mine = [n for f in forwards.values() for n in by_part[(f.region, f.mb)]]
        self.collectives = {n.id for f in fids for e in dag.out_edges(f)   # to a part
                            if _between(n := dag[e.dst]) and not n.attr("grad")
                            and any(x.dst in fids for x in dag.out_edges(n.id))}
        self.collectives |= {e.dst for c in list(self.collectives)   # a ring's receives
                             if dag[c].op == Op.SEND for e in dag.out_edges(c)
                             if dag[e.dst].op == Op.RECV}
        self.copied = fids | self.collectives            # what runs again, by its copy
        self.backwards = {n.id for n in mine if n.op in BACKWARDS}
        self.inside = self.copied | self.backwards | {n.id for n in mine if _between(n)}
        self.first = forwards[min(forwards)].id
        self.keep: dict[str, list[str]] = defaultdict(list)
        inner, outer = set(), set()   # values handed between the parts, and out of the layer
        for c in self.copied:
            for e in dag.out_edges(c):
                if e.kind == EdgeKind.DATA:
                    (inner if e.dst in self.copied else outer).update(e.values)
                    if e.dst in self.copied and c in fids:
                        self.keep[c] += e.values
        self.leaked = inner & outer

    def leaks(self) -> bool:
        """Does a value between the parts also leave the layer (then it would be stored
        twice, or freed while a later reader outside still needs it)?"""
        return bool(self.leaked)


def _nodes(dag: TrainingDAG, units: list[_Unit]) -> tuple[list[Node], list[Edge]]:
    """The units' first forwards marked, their backwards no longer recomputing, the second
    runs and collective copies added, and the ZeRO-3 gathers for the second runs (with
    their edges)."""
    unit_of = {f: u for u in units for f in u.fids}
    backwards = set().union(*(u.backwards for u in units))
    nodes, edges = [], []
    for n in dag.nodes:
        if n.id in unit_of:
            n = n.with_attrs(unit=Unit.FIRST)
        elif n.id in backwards and n.attrs and n.attr("recompute") is not None:
            n = n.with_attrs(recompute=None)
        elif pulled_gather(n) and n.attr("consumers"):   # kept for the step: one more use
            mine = tuple(c + AGAIN for c in n.attr("consumers") if c in unit_of)
            if mine:
                n = n.with_attrs(consumers=(*n.attr("consumers"), *mine))
                edges += [Edge(n.id, c, EdgeKind.DATA, ()) for c in mine]
        elif pulled_gather(n) and n.attr("before") in unit_of:   # its own gather
            again = n.attr("before") + AGAIN
            g = Node(n.id + AGAIN, n.op, n.tags, n.region, n.devices, n.stream,
                     tuple(sorted({**dict(n.attrs), "before": again}.items())))
            nodes.append(g)
            edges.append(Edge(g.id, again, EdgeKind.DATA, ()))
        nodes.append(n)
    for u in units:
        for i in sorted(u.copied):
            n = dag[i]
            attrs = {k: v for k, v in n.attrs if k not in ("overlap", "floating", "recompute")}
            if n.op == Op.F:
                attrs.update(unit=Unit.AGAIN, keep=tuple(dict.fromkeys(u.keep[i])))
            nodes.append(Node(i + AGAIN, n.op, n.tags, n.region, n.devices, n.stream,
                              tuple(sorted(attrs.items()))))
    return nodes, edges


def _edges(dag: TrainingDAG, units: list[_Unit]) -> list[Edge]:
    """The DAG's edges with the stash edges from the second runs, the second runs' inputs
    (from the copies, or from the layer's producers), and each unit's first second run
    after what its backwards wait on."""
    unit_of = {i: u for u in units for i in u.copied}
    back_of = {b: u for u in units for b in u.backwards}
    out: list[Edge] = []
    for e in dag.edges:
        u = unit_of.get(e.src)
        if u is not None and back_of.get(e.dst) is u:   # the stash: the second run's
            out.append(Edge(e.src + AGAIN, e.dst, e.kind, e.values, e.origin))
            continue
        out.append(e)
        v = unit_of.get(e.dst)
        if v is None:
            continue
        if u is v:   # an order inside the unit too (a ring's exchange beside its step)
            out.append(Edge(e.src + AGAIN, e.dst + AGAIN, e.kind, e.values, e.origin))
        elif e.kind == EdgeKind.DATA and dag[e.dst].op == Op.F and not pulled_gather(dag[e.src]):
            out.append(Edge(e.src, e.dst + AGAIN, e.kind, e.values, e.origin))
    for u in units:
        waits = u.fids | {e.src for b in u.backwards if dag[b].op != Op.BW   # BW: later
                          for e in dag.in_edges(b)
                          if e.src not in u.inside and not pulled_gather(dag[e.src])}
        out += [Edge(w, u.first + AGAIN, EdgeKind.TEMPORAL) for w in sorted(waits)]
    return out


def _between(n: Node) -> bool:
    """A collective between a region's parts, or an exchange of a context ring's
    (`cp.ring_dag`)."""
    return n.attr("purpose") in _BETWEEN_PARTS or bool(n.attrs and n.attr("ring"))


def pulled_gather(n: Node) -> bool:
    """A ZeRO-3 gather pulled before a pass (its own, not something the unit waits on)."""
    return n.op == Op.ALL_GATHER and n.attr("before") is not None
