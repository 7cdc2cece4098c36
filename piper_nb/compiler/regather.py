"""Sequence-parallel inputs kept as slices: a sharded part saves its device's slice of an
all-gathered input and gathers it again before its backward, as Megatron does.

Under sequence parallelism (`tp.sequence`) a sharded part (a column-parallel layer) reads
the whole sequence, all-gathered from every device's slice. Its linear layers save that
input for the weight gradient, so each device would keep the whole sequence, t times its
slice: (4 - 4/t)sbh bytes a transformer layer more than Korthikanti et al. (2022, section
4.2.2) count, which keep the slice and all-gather it again in the backward.

This pass does the same, for each forward of a sharded part that autograd saves an
all-gathered input of (`Context.kept`, measured by the shapes pass) and that runs once with
autograd (not recomputed, not a floating segment):

- the forward stores its device's slice of each such input (`Pass.slices`; the value
  `slice_name(v)`, s/t of the sequence) and autograd's saved copies of the input refer to
  the whole one gathered again (`runtime.compute`);
- an all-gather of those slices (`Collective.regather`, node id `...#regather`) runs before
  the part's backward (B, or BI): after the forward, while the backward of the sharded
  part before it computes, so the whole input is held from there to the backward that
  last reads it (B, or BW), not from the forward on;
- the backwards read it (`Pass.slices`), which the lowering's frees follow.

An input gathered for several readers, or that the forward does not save, is left as it
was.
"""

from __future__ import annotations

from collections import defaultdict

from piper_nb.compiler.layer_recompute import pulled_gather
from piper_nb.directives.base import Context, Directives
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import BACKWARDS, EdgeKind, Op, Purpose
from piper_nb.ir.node import Edge, Node

__all__ = ["regather_inputs", "REGATHER"]

REGATHER = "#regather"   # the id suffix of an all-gather run again before a backward


def regather_inputs(dag: TrainingDAG, _: Directives, ctx: Context) -> TrainingDAG:
    """The DAG with the all-gathered inputs of sharded parts' forwards kept as slices and
    gathered again before their backwards (the module docstring)."""
    layout = ctx.capture.tp
    if layout is None or not any(k == Op.ALL_GATHER for k in layout.sums.values()):
        return dag
    backs: dict[tuple, list[Node]] = defaultdict(list)   # (region, mb, devices) -> backwards
    for n in dag.nodes:
        if n.op in BACKWARDS:
            backs[(n.region, n.mb, n.devices)].append(n)
    found: dict[str, tuple[Node, Node, tuple[str, ...]]] = {}   # regather id -> (G, F, values)
    for g in dag.nodes:
        if g.op != Op.ALL_GATHER or g.attr("purpose") != Purpose.TP or g.attr("grad"):
            continue
        readers = [e for e in dag.out_edges(g.id) if e.kind == EdgeKind.DATA]
        for e in readers:
            f = dag[e.dst]
            kept = ctx.kept.get(f.region, ((), ()))[0]
            values = tuple(v for v in e.values if v in kept
                           and sum(v in x.values for x in readers) == 1)
            if values and _plain(f) and backs.get((f.region, f.mb, f.devices)):
                found[f"{g.id}{REGATHER}:{f.id}"] = (g, f, values)
    if not found:
        return dag
    light = {r for r in layout.parts if not set(ctx.capture.regions[r].params) & set(layout.params)}
    heavy = {n.region for n in dag.nodes if n.region >= 0} - light   # with sharded matmuls
    slices: dict[str, tuple[str, ...]] = defaultdict(tuple)   # pass id -> its sliced inputs
    nodes, edges, degree = [], [], {}
    for rid, (g, f, values) in found.items():
        bs = backs[(f.region, f.mb, f.devices)]
        for n in (f, *bs):
            slices[n.id] += values
        first = next(b for b in bs if b.op in (Op.B, Op.BI))
        nodes.append(Node(rid, Op.ALL_GATHER, g.tags, f.region, g.devices, g.stream,
                          tuple(sorted({"grad": False, "purpose": str(Purpose.TP),
                                        "values": values, "regather": True}.items()))))
        edges.append(Edge(rid, first.id, EdgeKind.DATA, values))
        edges += [Edge(w, rid, EdgeKind.TEMPORAL) for w in sorted(_waits(dag, f, first, heavy))]
        degree.update(dict.fromkeys(values, layout.degree[layout.parts[f.region][0]]))
    marked = [n.with_attrs(slices=tuple(dict.fromkeys(slices[n.id]))) if n.id in slices else n
              for n in dag.nodes]
    return dag.replace(nodes=marked + nodes, edges=list(dag.edges) + edges,
                       meta={"slices": tuple(sorted(degree.items()))},
                       step=f"{len(found)} inputs gathered again")


def _plain(f: Node) -> bool:
    """A forward run once with autograd: not recomputed (alone or as a unit), not a
    floating segment (placed later, `compiler.floating_passes`)."""
    return (f.op == Op.F and f.attr("recompute") is None and not f.attr("unit")
            and not f.attr("floating"))


def _waits(dag: TrainingDAG, f: Node, first: Node, heavy: set[int]) -> set[str]:
    """What the gather before backward `first` waits on: forward `f`, and what the backward
    of the sharded part before it waits on, found back through the collectives and the
    replicated parts' backwards (norms, sums: no matmul to hide it behind) on the same
    devices, so that it runs while that backward's matmuls do (Megatron overlaps it with
    the layer's other matmuls). A forward, a transfer from elsewhere, or a pass of another
    microbatch (reached by the schedule's order) is waited on, not walked through: walking
    on would cross every earlier microbatch, once for each gather (quadratic in them)."""
    waits, seen = {f.id}, set()
    todo = [e.src for e in dag.in_edges(first.id) if e.src != f.id]
    while todo:
        x = dag[todo.pop()]
        if x.id in seen or pulled_gather(x):
            continue
        seen.add(x.id)
        if (x.devices != first.devices or x.mb != first.mb
                or x.op not in BACKWARDS and x.attr("purpose") != Purpose.TP):
            waits.add(x.id)
        elif x.op not in BACKWARDS or x.region not in heavy:   # walked back through
            todo += [e.src for e in dag.in_edges(x.id)]
        else:
            waits |= {e.src for e in dag.in_edges(x.id) if not pulled_gather(dag[e.src])}
    return waits
