"""`shard`: expert parallelism (Piper's shard): experts spread over a group, all-to-all.

`pn.shard({"PP": 0, "EP": "*"}, devices=[0, 2])` acts on whole regions carrying an EP tag
(the experts). The expert with EP index e runs, all its passes and every microbatch, on
the single device `devices[e % len(devices)]`; its parameters and update live there too
(experts are not replicated). More experts than devices is fine, also uneven counts
(3 experts over 2 devices: device 0 holds experts 0 and 2); fewer experts than devices
is an error, since a device would hold none.

The regions around the experts (the router side that dispatches tokens and the side that
combines the expert outputs) run on a device group G, normally data-parallel replicas
(`pn.replicate({"PP": 0}, [0, 2])`: EP inside DP, as in DeepSpeed-MoE and Megatron). G
must be the shard's devices. Every data edge between an expert and a region on G becomes
an ALL_TO_ALL over G, one node per (non-expert pass, direction), so all the experts one
pass feeds on one microbatch share one all-to-all:

- dispatch (purpose "dispatch"): each replica sends value v to the device owning its
  expert; the expert's input is the concatenation over the replicas, in G's order. Forward:
  F[router side] -> A2A -> F[expert]; backward (grad=True): B[combine side] -> A2A ->
  B[expert] carries the gradients of the expert outputs.
- combine (purpose "combine"): the owner splits v by the token counts each replica sent
  and returns every replica its rows. Forward: F[expert] -> A2A -> F[combine side];
  backward: B[expert] -> A2A -> B[router side] carries the gradients of expert inputs.

Node attrs (the runtime needs nothing else): `values` (names, in edge order), `purpose`,
`grad`, `owners` ((value, device) pairs: the device holding the expert that reads or
writes the value), `split_by` ((value, dispatched value) pairs: whose per-replica token
counts, recorded by the forward dispatch of that microbatch, size each value's pieces; a
dispatched value names itself, an expert output names its expert's first input).

Several experts may read one value on one device (their input gradients are summed
there); one value read by experts on different devices is an error. Experts may not feed
experts on other devices directly.

Three passes of the pipeline (`compiler.passes`): `place_experts` places the experts
before send/recv insertion (which leaves expert edges alone; the expert regions are the
DAG's `experts` meta), `apply_shards` checks the surroundings of each directive's experts
(errors name the directive), and `insert_all_to_all` rewrites the edges of all experts at
once.
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
    each,
)
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter, freeze_tags, tags_text
from piper_nb.ir.kinds import COMPUTE, PASSES, EdgeKind, Op, Purpose
from piper_nb.ir.node import Edge, Node, node_id

__all__ = ["Shard", "shard", "place_experts", "apply_shards", "insert_all_to_all", "EP",
           "routes_tokens"]

EP = "EP"


@dataclass(frozen=True)
class Shard(Directive):
    """Expert parallelism: the matched (EP) regions are spread over `devices`, with
    all-to-all on the edges into and out of them; they are not replicated."""

    filter: Mapping[str, Any]
    devices: tuple[int, ...]
    stream: str | None = None
    op = "shard"

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="shard filter"))
        object.__setattr__(self, "devices", check_devices(self.devices, "shard"))
        object.__setattr__(self, "stream", check_stream(self.stream, "shard"))

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "shard", "filter": {"EP": "*"}, "devices": list(range(stages))}

    def code(self) -> str:
        return call_code("pn.shard", shard, vars(self))


def shard(filter: Mapping[str, Any], devices: Sequence[int], stream: str | None = None) -> Shard:
    """Spread the expert regions `filter` matches over `devices`, expert e on
    `devices[e % len(devices)]`, with all-to-all around them (see `Shard`)."""
    return Shard(filter, devices, stream)


def _region_name(dag: TrainingDAG, r: int) -> str:
    regions = dag.regions()
    return "{" + (regions[r].name if 0 <= r < len(regions) else str(r)) + "}"


def _selected_regions(dag: TrainingDAG, directive) -> set[int]:
    return {n.region for n in dag.nodes if n.op in COMPUTE and n.selected_by(directive.filter)}


def place_experts(dag: TrainingDAG, shards: Directives, ctx: Context) -> TrainingDAG:
    """Each shard's expert regions placed; all of them recorded as the `experts` meta."""
    experts: set[int] = set()

    def one(dag: TrainingDAG, d: Shard) -> TrainingDAG:
        dag, regions = _place_experts(dag, d)
        experts.update(regions)
        return dag
    dag = each(dag, shards, one)
    return dag.replace(meta={"experts": frozenset(experts)}) if experts else dag


def experts_of(dag: TrainingDAG) -> frozenset[int]:
    """The expert regions (those a shard placed)."""
    return dag.get_meta("experts", frozenset())


def _place_experts(dag: TrainingDAG, directive) -> tuple[TrainingDAG, set[int]]:
    """Place each matched expert region on `devices[EP % len(devices)]`."""
    f, devs = dict(directive.filter), tuple(directive.devices)
    regions = _selected_regions(dag, directive)
    if not regions:
        names = ", ".join(_region_name(dag, r.index) for r in dag.regions())
        raise PlanError(f"shard filter {f} matches no region; the regions are {names}")
    by_region = {n.region: n for n in dag.nodes if n.region in regions and n.op in COMPUTE}
    plain = sorted(r for r, n in by_region.items() if n.tag(EP) is None)
    if plain:
        names = ", ".join(_region_name(dag, r) for r in plain)
        raise PlanError(f"shard filter {f} selects regions without an {EP} tag ({names}); shard "
                        f"spreads experts: annotate them with {EP} and select them, e.g. "
                        f"{ {**{k: v for k, v in f.items() if k != EP}, EP: '*'} }")
    again = sorted(r for r, n in by_region.items() if n.attr("ep_group") is not None)
    if again:
        names = ", ".join(_region_name(dag, r) for r in again)
        raise PlanError(f"experts {names} are already sharded by an earlier shard directive; "
                        "shard each expert region once")
    experts = sorted({n.tag(EP) for n in by_region.values()})
    if len(experts) < len(devs):
        idle = [devs[i] for i in range(len(devs)) if not any(e % len(devs) == i for e in experts)]
        raise PlanError(f"{len(experts)} experts ({EP}={', '.join(map(str, experts))}) over "
                        f"{len(devs)} devices {list(devs)} leave devices {idle} without an expert; "
                        f"shard over at most {len(experts)} devices")
    stream = directive.stream or "ep"
    nodes = []
    for n in dag.nodes:
        if n.region in regions and n.op in COMPUTE:
            owner = devs[n.tag(EP) % len(devs)]
            n = dataclasses.replace(n, devices=(owner,)).with_attrs(ep_group=devs,
                                                                   ep_stream=stream)
        nodes.append(n)
    step = f"{f} over {list(devs)}"
    return dag.replace(nodes=nodes, step=step), regions


def _is_expert(n: Node) -> bool:
    return n.attr("ep_group") is not None


def _expert_edges(dag: TrainingDAG):
    """(edge, expert node, other node) for data edges between an expert pass and a pass of
    another region (F/B/BI/BW only: saved activations and updates stay local)."""
    for e in dag.edges:
        if e.kind != EdgeKind.DATA:
            continue
        a, b = dag[e.src], dag[e.dst]
        if a.op not in PASSES or b.op not in PASSES or a.region == b.region:
            continue
        if _is_expert(a):
            yield e, a, b
        elif _is_expert(b):
            yield e, b, a


def _suggest(dag: TrainingDAG, n: Node) -> dict:
    tags = dag.regions()[n.region].tags if dag.regions() else n.tags
    return {k: v for k, v in tags if k not in ("MB", "PASS", "SEG")}


def apply_shards(dag: TrainingDAG, shards: Directives, ctx: Context) -> TrainingDAG:
    """Each shard's surroundings checked (see `_check_surroundings`)."""
    return each(dag, shards, _check_surroundings)


def _check_surroundings(dag: TrainingDAG, directive) -> TrainingDAG:
    """Check that the regions around this directive's experts allow all-to-all over its devices."""
    devs = tuple(directive.devices)
    regions = _selected_regions(dag, directive)
    groups: dict[tuple[int, ...], Node] = {}
    readers: dict[tuple[str, str], set[int]] = {}
    for e, x, other in _expert_edges(dag):
        if x.region not in regions:
            continue
        if _is_expert(other):
            if other.devices != x.devices:
                raise PlanError(f"expert {_region_name(dag, x.region)} on {list(x.devices)} "
                                f"exchanges data directly with expert "
                                f"{_region_name(dag, other.region)} on {list(other.devices)}; "
                                "experts must be surrounded by non-expert regions (router and "
                                "combine), which all-to-all talks to")
            continue
        if set(other.devices) != set(devs):
            raise PlanError(
                f"{other.id} runs on {list(other.devices)} but exchanges tokens with the experts "
                f"sharded over {list(devs)}; all-to-all runs over one group: replicate the "
                f"surrounding regions over the same devices, e.g. "
                f"pn.replicate({_suggest(dag, other)}, {list(devs)})")
        groups.setdefault(other.devices, other)
        if len(groups) > 1:
            a, b = groups.values()
            raise PlanError(f"the regions around the experts list their devices in different "
                            f"orders ({a.id} on {list(a.devices)}, {b.id} on {list(b.devices)}); "
                            "replica i must be the same device on both sides: list the devices "
                            "in one order")
        if e.dst == x.id and x.op == Op.F:
            for v in e.values:
                readers.setdefault((other.id, v), set()).update(x.devices)
    for (src, v), where in readers.items():
        if len(where) > 1:
            raise PlanError(f"value {v} of {src} is read by experts on devices {sorted(where)}; "
                            "each token goes to one device: gather every expert's own tokens "
                            "before it (as TinyMoE does with x[idx])")
    return dag


def insert_all_to_all(dag: TrainingDAG, _: Directives, ctx: Context) -> TrainingDAG:
    """Turn every edge between an expert and a region on its group into ALL_TO_ALL nodes."""
    experts = experts_of(dag)
    if not experts:
        return dag
    regions = dag.regions()
    made = {v for info in regions for v in info.outputs}   # values regions make (not the batch)

    def first_input(r: int) -> str | None:
        ins = [v for v in regions[r].inputs if v in made] if regions else []
        return ins[0] if ins else None

    groups: dict[str, dict] = {}
    keep: list[Edge] = []
    for e in dag.edges:
        a, b = dag[e.src], dag[e.dst]
        if (e.kind != EdgeKind.DATA or a.op not in PASSES or b.op not in PASSES
                or a.region == b.region or (a.region in experts) == (b.region in experts)):
            keep.append(e)
            continue
        x, other = (a, b) if a.region in experts else (b, a)
        if x.devices == other.devices:  # a group of one device: nothing to exchange
            keep.append(e)
            continue
        purpose = Purpose.COMBINE if x is a else Purpose.DISPATCH
        grad = a.op != Op.F
        nid = node_id(Op.ALL_TO_ALL, freeze_tags({k: v for k, v in other.tags if k != "PASS"}),
                      f"#{purpose}{'.grad' if grad else ''}")
        g = groups.setdefault(nid, {"other": other, "purpose": purpose, "grad": grad,
                                    "edges": [], "stream": x.attr("ep_stream") or "ep"})
        g["edges"].append((e, x))
    nodes = list(dag.nodes)
    edges = keep
    for nid, g in groups.items():
        other, purpose = g["other"], g["purpose"]
        values: list[str] = []
        owners: list[tuple[str, int]] = []
        split_by: list[tuple[str, str]] = []
        for e, x in g["edges"]:
            dispatched = (purpose == Purpose.DISPATCH) != g["grad"]  # the value is an expert input
            for v in e.values:
                if v in values:
                    continue
                values.append(v)
                owners.append((v, x.devices[0]))
                split_by.append((v, v if dispatched else first_input(x.region) or v))
        node = Node(id=nid, op=Op.ALL_TO_ALL,
                    tags=freeze_tags({k: v for k, v in other.tags if k != "PASS"}),
                    region=other.region, devices=other.devices, stream=g["stream"],
                    attrs=tuple(sorted({"values": tuple(values), "purpose": purpose,
                                        "grad": g["grad"], "owners": tuple(owners),
                                        "split_by": tuple(split_by)}.items())))
        nodes.append(node)
        vals = tuple(values)
        if purpose == Purpose.DISPATCH:
            edges.append(Edge(other.id, nid, EdgeKind.DATA, vals))
            edges += [Edge(nid, x.id, EdgeKind.DATA, e.values) for e, x in g["edges"]]
        else:
            edges += [Edge(x.id, nid, EdgeKind.DATA, e.values) for e, x in g["edges"]]
            edges.append(Edge(nid, other.id, EdgeKind.DATA, vals))
    names = ", ".join(tags_text(regions[r].tags) for r in sorted(experts)) if regions else ""
    return dag.replace(nodes=nodes, edges=edges,
                       step=f"{len(groups)} nodes; experts {names}")


def routes_tokens(directives: Directives) -> bool:
    """Whether the program shards experts, so the shapes pass counts routed rows as
    symbols (`compiler.token_rows`)."""
    return any(isinstance(d, Shard) for _, d in directives)
