"""Text and JSON forms of a TrainingDAG that round-trip (nodes, edges, pass history).

Text: one line per node, then one per edge, so a DAG diff reads like a schedule diff:

    N F[PP=0,MB=1] region=0 devices=0,2 stream=compute tags=PP=0,MB=1,PASS=F attrs={}
    E F[PP=0,MB=1] -> F[PP=1,MB=1] values=h
    E F[PP=1,MB=0] ~> B[PP=1,MB=0] origin=4

Program-level facts (regions, buckets) travel in the JSON form's `meta`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, is_dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.dag import Edge, Node, Op, TrainingDAG
from piper_nb.ir.filters import tags_text

__all__ = ["dag_to_text", "dag_from_text", "dag_to_json", "dag_from_json"]


def _tags_parse(text: str) -> tuple:
    out = []
    for item in filter(None, text.split(",")):
        k, v = item.split("=", 1)
        out.append((k, int(v) if v.lstrip("-").isdigit() else v))
    return tuple(out)


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    return v


def _unjson(v):
    if isinstance(v, list):
        return tuple(_unjson(x) for x in v)
    return v


def dag_to_text(dag: TrainingDAG) -> str:
    lines = [f"# history: {' | '.join(dag.history)}"]
    for n in dag.nodes:
        attrs = json.dumps({k: _jsonable(v) for k, v in n.attrs}, separators=(",", ":"))
        lines.append(f"N {n.id} region={n.region} devices={','.join(map(str, n.devices))} "
                     f"stream={n.stream} op={n.op.value} tags={tags_text(n.tags, skip=())} attrs={attrs}")
    for e in dag.edges:
        arrow = "->" if e.kind == "data" else "~>"
        extra = f" values={','.join(e.values)}" if e.values else ""
        extra += f" origin={e.origin}" if e.origin >= 0 else ""
        lines.append(f"E {e.src} {arrow} {e.dst}{extra}")
    return "\n".join(lines)


def dag_from_text(text: str, meta: tuple = ()) -> TrainingDAG:
    nodes, edges, history = [], [], ()
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            if line.startswith("# history:"):
                body = line.removeprefix("# history:").strip()
                history = tuple(body.split(" | ")) if body else ()
            elif line.startswith("N "):
                head, attrs = line[2:].split(" attrs=", 1)
                nid, *fields = head.split(" ")
                kv = dict(f.split("=", 1) for f in fields)
                nodes.append(Node(
                    id=nid, op=Op(kv["op"]), tags=_tags_parse(kv["tags"]), region=int(kv["region"]),
                    devices=tuple(int(d) for d in kv["devices"].split(",") if d),
                    stream=kv["stream"],
                    attrs=tuple((k, _unjson(v)) for k, v in json.loads(attrs).items())))
            elif line.startswith("E "):
                src, arrow, dst, *rest = line[2:].split(" ")
                kv = dict(f.split("=", 1) for f in rest)
                edges.append(Edge(src, dst, "data" if arrow == "->" else "temporal",
                                  tuple(v for v in kv.get("values", "").split(",") if v),
                                  int(kv.get("origin", -1))))
        except (ValueError, KeyError) as err:
            raise PlanError(f"DAG text line {lineno} is malformed ({err}): {line!r}") from None
    return TrainingDAG(tuple(nodes), tuple(edges), meta, history)


def _meta_json(meta) -> dict:
    out = {}
    for k, v in meta:
        if isinstance(v, tuple) and v and is_dataclass(v[0]):
            out[k] = [asdict(x) for x in v]
        else:
            try:
                json.dumps(v)
                out[k] = v
            except TypeError:
                out[k] = repr(v)
    return out


def dag_to_json(dag: TrainingDAG) -> str:
    return json.dumps({"text": dag_to_text(dag), "meta": _meta_json(dag.meta)})


def dag_from_json(text: str) -> TrainingDAG:
    obj = json.loads(text)
    return dag_from_text(obj["text"], tuple(obj.get("meta", {}).items()))
