"""The Designer's DAG picture: clickable SVG whose nodes carry DAG node ids, and the
details of one node (tags, device, stream, inputs, outputs).

Walk-then-draw, as in `viz/dag.py` (whose colours and shapes it reuses): `dag_groups`
walks the DAG into groups of nodes that differ only in collapsed tags (the group's id is
its first member's), `draw_groups` renders them with graphviz, setting each node's SVG
`id` to its group id so the front end (`widgets/dag_view.js`) can post the clicked node's
id back. Graphviz names stay `n0, n1, ...` because DAG ids may hold `:` (a port in dot).
"""

from __future__ import annotations

import html
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from piper_nb.ir.filters import tags_text
from piper_nb.ir.kinds import COMM, P2P, EdgeKind
from piper_nb.viz.dag import STYLE, auto_collapse, stage_label
from piper_nb.viz.replicas import group_label

__all__ = ["DagGroups", "dag_groups", "draw_groups", "dag_svg", "node_details", "MAX_NODES"]

MAX_NODES = 48      # beyond this, "auto" collapses microbatches (8 of 2 stages: 67 nodes)


@dataclass
class DagGroups:
    members: dict[str, list[str]] = field(default_factory=dict)   # group id -> node ids
    of: dict[str, str] = field(default_factory=dict)              # node id -> group id
    edges: dict[tuple[str, str, str], int] = field(default_factory=dict)
    collapse: tuple[str, ...] = ()


def _group_key(n, collapse: frozenset[str]) -> tuple:
    kept = tuple((k, v) for k, v in n.tags if k not in collapse)
    if "PASS" in collapse:                 # one node per stage
        return ("stage", kept, n.devices)
    bucket = None if "bucket" in collapse else n.attr("bucket")
    extra = (n.attr("grad"), bucket, n.attr("purpose"), n.attr("src_region"),
             n.attr("dst_region")) if n.op in COMM else ()
    return (n.op.value, kept, n.devices, n.stream, extra)


def dag_groups(dag, collapse: str | tuple[str, ...] = "auto") -> DagGroups:
    """Group the DAG's nodes; `collapse` is "auto", "none", a tag name or a tuple of them
    ("bucket" merges a stage's collectives over its buckets, "PASS" a stage's passes and
    messages into one node). "auto" collapses microbatches beyond MAX_NODES nodes, then
    buckets and passes while more than `viz.dag.READABLE` remain (an 80-layer model's plan
    opens as one node per stage)."""
    if collapse == "auto":
        collapse = auto_collapse(dag, MAX_NODES, _group_key)
    elif collapse in ("none", "", None):
        collapse = ()
    elif isinstance(collapse, str):
        collapse = (collapse,)
    coll = frozenset(collapse)
    groups = DagGroups(collapse=tuple(sorted(coll)))
    first: dict[tuple, str] = {}
    for n in dag.nodes:
        key = _group_key(n, coll) if coll else (n.id,)
        gid = first.setdefault(key, n.id)
        groups.members.setdefault(gid, []).append(n.id)
        groups.of[n.id] = gid
    counts: dict[tuple[str, str, str], int] = defaultdict(int)
    for e in dag.edges:
        a, b = groups.of.get(e.src), groups.of.get(e.dst)
        if a is not None and b is not None and a != b:
            counts[(a, b, e.kind)] += 1
    groups.edges = dict(counts)
    return groups


def _label(n, collapse: tuple[str, ...], count: int) -> str:
    kept = [(k, v) for k, v in n.tags if k not in collapse]
    text = f"{n.op.value}[{tags_text(kept)}]"
    if n.attr("grad") is not None and n.op in P2P:
        text += " grad" if n.attr("grad") else " act"
    elif n.op in COMM and n.attr("bucket") is not None:
        text += " buckets" if "bucket" in collapse else f" b{n.attr('bucket')}"
    return text + (f" x{count}" if count > 1 else "")


def draw_groups(dag, groups: DagGroups, rankdir: str = "LR"):
    """A `graphviz.Digraph`: one cluster per device set, temporal edges dashed."""
    import graphviz
    g = graphviz.Digraph("dag", graph_attr={"rankdir": rankdir, "fontsize": "10", "nodesep": "0.12",
                                            "ranksep": "0.3"},
                         node_attr={"fontsize": "9", "style": "filled", "fontname": "Helvetica",
                                    "margin": "0.06,0.02", "height": "0.3"},
                         edge_attr={"arrowsize": "0.6"})
    names = {gid: f"n{i}" for i, gid in enumerate(groups.members)}
    by_devices: dict[tuple, list[str]] = defaultdict(list)
    for gid in groups.members:
        by_devices[dag[gid].devices].append(gid)
    for devs, gids in sorted(by_devices.items()):
        label = "unplaced" if not devs else (
            f"device {devs[0]}" if len(devs) == 1 else group_label(devs))
        cname = "cluster_" + ("_".join(map(str, devs)) or "none")
        with g.subgraph(name=cname, graph_attr={"label": label, "style": "rounded",
                                                "color": "#888888"}) as sub:
            for gid in gids:
                n, members = dag[gid], groups.members[gid]
                if "PASS" in groups.collapse:
                    ops = Counter(dag[m].op.value for m in members)
                    kept = [(k, v) for k, v in n.tags if k not in groups.collapse]
                    label, (shape, color) = stage_label(kept, ops), STYLE["stage"]
                else:
                    label = _label(n, groups.collapse, len(members))
                    shape, color = STYLE.get(n.op.value, ("ellipse", "#ffffff"))
                sub.node(names[gid], label, shape=shape, fillcolor=color, id=gid, tooltip=gid)
    for (a, b, kind), count in groups.edges.items():
        attrs = {"style": "dashed", "color": "#999999"} if kind == EdgeKind.TEMPORAL else {}
        if count > 1:
            attrs.update(label=str(count), fontsize="7")
        g.edge(names[a], names[b], **attrs)
    return g


def dag_svg(dag, collapse: str | tuple[str, ...] = "auto") -> tuple[str, DagGroups]:
    """(SVG text, groups) of the DAG; needs graphviz's `dot`."""
    groups = dag_groups(dag, collapse)
    svg = draw_groups(dag, groups).pipe(format="svg").decode()
    return svg[svg.find("<svg"):], groups


def _edge_rows(edges, other: str) -> str:
    rows = []
    for e in edges:
        vals = f" ({', '.join(e.values)})" if e.values else ""
        rows.append(f"<li><code>{html.escape(getattr(e, other))}</code> "
                    f"<span class='pn-muted'>{e.kind}{html.escape(vals)}</span></li>")
    return "<ul>" + "".join(rows) + "</ul>" if rows else "<p class='pn-muted'>none</p>"


def node_details(dag, node_id: str, groups: DagGroups | None = None) -> str:
    """HTML: the node's op, tags, devices, stream, attributes, inputs and outputs."""
    if not node_id:
        return "<p class='pn-muted'>Click a node of the DAG to see its details.</p>"
    if dag is None or node_id not in dag:
        return (f"<p class='pn-muted'>Node <code>{html.escape(node_id)}</code> is not in the "
                "current DAG.</p>")
    n = dag[node_id]
    tags = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in n.tags)
    attrs = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                    for k, v in n.attrs)
    members = groups.members.get(node_id, [node_id]) if groups else [node_id]
    group = ""
    if len(members) > 1:
        shown = ", ".join(html.escape(m) for m in members[:8]) + (" ..." if len(members) > 8 else "")
        group = f"<p>Stands for {len(members)} nodes: {shown}</p>"
    devices = ", ".join(map(str, n.devices)) or "not placed"
    return (f"<div class='pn-details'><h4><code>{html.escape(n.id)}</code></h4>{group}"
            f"<table><tr><td>op</td><td>{n.op.value}</td></tr>"
            f"<tr><td>devices</td><td>{devices}</td></tr>"
            f"<tr><td>stream</td><td>{html.escape(n.stream)}</td></tr>"
            f"<tr><td>region</td><td>{n.region}</td></tr></table>"
            f"<h5>tags</h5><table>{tags}</table>"
            + (f"<h5>attributes</h5><table>{attrs}</table>" if attrs else "")
            + f"<h5>inputs</h5>{_edge_rows(dag.in_edges(n.id), 'src')}"
            f"<h5>outputs</h5>{_edge_rows(dag.out_edges(n.id), 'dst')}</div>")
