"""TrainingDAG -> graphviz: one cluster per device set, comm nodes set apart, temporal
edges dashed, and nodes collapsed by tag so large DAGs stay readable.

Walk-then-draw: `dag_view` walks the DAG into merged nodes and edges (collapsing
`collapse=("MB",)` merges nodes that differ only in their microbatch, labelled "x8";
the pseudo-tag "bucket" also merges a stage's collectives over its parameter buckets);
`draw_dag` renders them. When a DAG has more than `max_nodes` nodes and no collapse is
given, microbatches are collapsed automatically, then buckets, then passes (the pseudo-tag
"PASS": one node per stage listing what it stands for, "PP=3 / F x16 B x16 U ..."), until
at most READABLE nodes remain; an 80-layer model's plan opens as one node per stage.
Beyond `max_nodes`, the rest is summarised in one note node. Clusters of many devices are
labelled by their first and last ("devices 0,8,16,...,120 (x16)") and the drawing is
capped at `size` inches, so it fits a notebook's width.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from piper_nb.ir.filters import tags_text
from piper_nb.ir.kinds import COMM, SHORT, EdgeKind, Op
from piper_nb.viz.replicas import group_label

__all__ = ["DagView", "dag_view", "draw_dag", "dag_to_graphviz", "auto_collapse", "stage_label",
           "STYLE"]

READABLE = 60      # auto-collapsing aims at no more nodes than this

# op -> (shape, fill colour)
STYLE = {Op.F: ("box", "#c6dbef"), Op.B: ("box", "#fdd0a2"), Op.BI: ("box", "#fcbba1"),
         Op.BW: ("box", "#c7e9c0"), Op.U: ("box3d", "#d9d9d9"),
         Op.SEND: ("cds", "#dadaeb"), Op.RECV: ("cds", "#efedf5"),
         Op.ALL_REDUCE: ("hexagon", "#fee391"), Op.ALL_GATHER: ("hexagon", "#d9f0a3"),
         Op.REDUCE_SCATTER: ("hexagon", "#fec44f"), Op.ALL_TO_ALL: ("octagon", "#bcbddc"),
         "stage": ("box", "#e6ecf5")}        # a whole stage (collapse with "PASS")


@dataclass
class DagView:
    nodes: dict[tuple, dict] = field(default_factory=dict)      # key -> {label, op, devices, n}
    edges: dict[tuple, int] = field(default_factory=dict)       # (src, dst, kind) -> count
    hidden: int = 0
    collapse: tuple[str, ...] = ()


def _key(n, collapse: frozenset[str], dag) -> tuple:
    kept = tuple((k, v) for k, v in n.tags if k not in collapse)
    if "PASS" in collapse:                 # one node per stage: its passes and messages
        return ("stage", kept, n.devices)
    extra = ()
    if n.op in COMM:
        before = n.attr("before")
        bucket = None if "bucket" in collapse else n.attr("bucket")
        extra = (n.attr("grad"), bucket, n.attr("purpose"),
                 dag[before].op.value if before in dag else None,
                 n.attr("src_region"), n.attr("dst_region"))
    return (n.op.value, kept, n.devices, n.id if not collapse else extra)


def _label(n, kept: tuple, count: int, collapse: frozenset[str] = frozenset()) -> str:
    text = f"{n.op.value}[{tags_text(kept)}]"
    if n.op in (Op.SEND, Op.RECV):
        text += f" {'grad' if n.attr('grad') else 'act'} {n.attr('src_region')}>" \
                f"{n.attr('dst_region')}"
    elif n.op in COMM and n.attr("bucket") is not None:
        text += " buckets" if "bucket" in collapse else f" b{n.attr('bucket')}"
        if n.attr("before") is not None:
            text += f" for {n.attr('before').split('[')[0]}"
    return text + (f" x{count}" if count > 1 else "")


def stage_label(kept: tuple, ops: dict[str, int]) -> str:
    """A stage's node: its tags, then how many of each op it stands for (passes on one
    line, messages and collectives on the next: "F x16, B x16, U" / "SEND x32, RS")."""
    short = {op.value: name for op, name in SHORT.items()}
    lines = [tags_text(kept) or "untagged"]
    for comm in (False, True):
        words = [f"{short.get(op, op)} x{c}" if c > 1 else short.get(op, op)
                 for op, c in ops.items() if (Op(op) in COMM) == comm]
        lines += [", ".join(words)] if words else []
    return "\n".join(lines)


def auto_collapse(dag, max_nodes: int, key=None) -> tuple[str, ...]:
    """What to collapse so a DAG over `max_nodes` nodes reads at a glance (at most
    READABLE nodes): microbatches; then buckets too (one node per pass and stage); then
    passes too (one node per stage, as an 80-layer model's plan opens)."""
    if len(dag.nodes) <= max_nodes:
        return ()
    key = key or (lambda n, c: _key(n, c, dag))
    for level in (("MB",), ("MB", "bucket")):
        if len({key(n, frozenset(level)) for n in dag.nodes}) <= min(max_nodes, READABLE):
            return level
    return ("MB", "PASS", "bucket")


def dag_view(dag, collapse=None, max_nodes: int = 150) -> DagView:
    if collapse is None:
        collapse = auto_collapse(dag, max_nodes)
    coll = frozenset(collapse or ())
    view = DagView(collapse=tuple(sorted(coll)))
    of: dict[str, tuple] = {}
    for n in dag.nodes:
        key = _key(n, coll, dag)
        if key not in view.nodes:
            if len(view.nodes) >= max_nodes:
                view.hidden += 1
                continue
            op = "stage" if "PASS" in coll else n.op.value
            view.nodes[key] = {"op": op, "devices": n.devices, "n": 0, "node": n,
                               "kept": key[1], "ops": defaultdict(int)}
        view.nodes[key]["n"] += 1
        view.nodes[key]["ops"][n.op.value] += 1
        of[n.id] = key
    for info in view.nodes.values():
        ops, node, kept = info.pop("ops"), info.pop("node"), info.pop("kept")
        info["label"] = stage_label(kept, ops) if "PASS" in coll \
            else _label(node, kept, info["n"], coll)
    counts: dict[tuple, int] = defaultdict(int)
    for e in dag.edges:
        a, b = of.get(e.src), of.get(e.dst)
        if a is not None and b is not None and a != b:
            counts[(a, b, e.kind)] += 1
    view.edges = dict(counts)
    return view


def draw_dag(view: DagView, rankdir: str = "LR", name: str = "dag", size: str = "14,9"):
    from piper_nb.extras import require
    graphviz = require("graphviz", "drawing the DAG")
    g = graphviz.Digraph(name, graph_attr={"rankdir": rankdir, "fontsize": "10",
                                           "compound": "true", "size": size},
                         node_attr={"fontsize": "9", "style": "filled", "fontname": "Helvetica"},
                         edge_attr={"arrowsize": "0.6"})
    ids = {key: f"n{i}" for i, key in enumerate(view.nodes)}
    groups: dict[tuple, list[tuple]] = defaultdict(list)
    for key, info in view.nodes.items():
        groups[info["devices"]].append(key)
    for devs, keys in sorted(groups.items()):
        target = g
        if devs:
            label = f"device {devs[0]}" if len(devs) == 1 else group_label(devs)
            cname = "cluster_" + "_".join(map(str, devs))
            with g.subgraph(name=cname, graph_attr={"label": label, "style": "rounded",
                                                    "color": "#888888"}) as sub:
                _nodes(sub, keys, view, ids)
            continue
        _nodes(target, keys, view, ids)
    for (a, b, kind), count in view.edges.items():
        attrs = {"style": "dashed", "color": "#999999"} if kind == EdgeKind.TEMPORAL else {}
        if count > 1 and view.collapse:
            attrs["label"] = str(count)
            attrs["fontsize"] = "7"
        g.edge(ids[a], ids[b], **attrs)
    if view.hidden:
        g.node("more", f"... {view.hidden} more nodes (raise max_nodes or collapse tags)",
               shape="note", fillcolor="#ffffff")
    return g


def _nodes(g, keys, view: DagView, ids) -> None:
    for key in keys:
        info = view.nodes[key]
        shape, color = STYLE.get(info["op"], ("ellipse", "#ffffff"))
        g.node(ids[key], info["label"], shape=shape, fillcolor=color)


def dag_to_graphviz(dag, collapse=None, max_nodes: int = 150, rankdir: str = "LR"):
    """A `graphviz.Digraph` of the DAG (see the module docstring)."""
    return draw_dag(dag_view(dag, collapse, max_nodes), rankdir)
