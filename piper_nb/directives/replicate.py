"""`replicate`: data-parallel replicas with ZeRO 0-3, and every other gradient sum.

A parameter whose copies live on several devices needs its gradient summed over them:
replicas of a region (data parallel), a stage held twice (DualPipe), or a weight tied
across regions (embeddings). Parameters with the same device group, ZeRO level and
regions form buckets (cut by `bucket_size` MB). A weight tied across stages that are
replicated with one ZeRO level forms a bucket over every device holding it (both stages'
replicas): its gradient is reduce-scattered over all of them, each updates its shard, and
the gather gives every copy the same new weight (Megatron-LM sums the first and last
stage's copies, then shards within each stage; one group shards the optimizer state
further). Per bucket:

- zero 0: ALL_REDUCE after the last backward, then U on full parameters;
- zero 1: REDUCE_SCATTER after the last backward, U on the shard (optimizer state is
  sharded), ALL_GATHER of the updated parameters;
- zero 2: REDUCE_SCATTER after every microbatch's backward (gradients stay sharded),
  U on the shard, ALL_GATHER of the parameters;
- zero 3: parameters stay sharded: ALL_GATHER before every pass that needs them (freed
  after it), REDUCE_SCATTER after every backward, U on the shard; with `reshard=False`,
  one ALL_GATHER before the region's first pass (freed after its last) and one
  REDUCE_SCATTER after its last backward.

`grad_sync` says when ZeRO-2/3 gradients are reduced: "microbatch" (the default) reduce-
scatters each microbatch's gradients after its backward, so full gradients of one
microbatch at a time are held (the lowering waits for a reduction before the next);
"step" (zero 3) accumulates full gradients over the step's microbatches and reduce-
scatters them once after the last backward, as FSDP2 does with
`set_requires_gradient_sync(False)` until the last microbatch (torchtitan's pipeline
recipe): one reduction per step instead of one per microbatch, for a region's full
gradients held from its first backward to the end of the step. `reshard=False` implies
"step" unless told otherwise.

A bucket spread over more devices than one pass runs on (a weight tied across stages, a
stage held twice by full DualPipe) is gathered once per step under ZeRO-3 and reduced once
per step under ZeRO-2: its devices run their microbatches' backwards in different orders
(the copies of a DualPipe stage each run half of them), so per-microbatch collectives
over all of them would not line up.

JSON: Piper's `{"op": "replicate", "filter", "devices", "shard_grads", "shard_params"}`
plus our `zero`, `bucket_size`, `reduce_stream`, `gather_stream`, `reshard` and
`grad_sync`.
"""

from __future__ import annotations

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
)
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter, freeze_tags
from piper_nb.ir.kinds import EdgeKind, Op, Purpose
from piper_nb.ir.node import Edge, Node, node_id

__all__ = ["Replicate", "replicate", "replica_width", "check_widths", "Bucket",
           "ReplicaConfig", "replica_configs", "insert_grad_sync"]


@dataclass(frozen=True)
class Replicate(Directive):
    """Data-parallel replicas of the matched regions, with ZeRO level 0-3.

    zero=0 all-reduces gradients; 1 shards optimizer state (reduce-scatter, update the
    shard, all-gather parameters); 2 also shards gradients (reduce-scatter after each
    microbatch's backward); 3 also shards parameters (all-gather before each pass that
    needs them, freed after). `bucket_size` is in MB (None: one bucket per region).
    `reshard=False` (zero 3 only) keeps a region's parameters gathered from its first pass
    to its last in the step and reduce-scatters gradients once after the last backward
    (FSDP's no-reshard + no-sync accumulation): fewer collectives, full parameters and
    gradients held within the step. `grad_sync` ("microbatch" or "step", zero 3; None:
    "step" without resharding, else "microbatch") says whether gradients are
    reduce-scattered after every microbatch's backward or accumulated in full and reduced
    once after the last (see the module docstring for the trade-off).
    """

    filter: Mapping[str, Any]
    devices: tuple[int, ...]
    zero: int = 0
    bucket_size: float | None = None
    reduce_stream: str | None = None
    gather_stream: str | None = None
    reshard: bool = True
    grad_sync: str | None = None
    op = "replicate"
    json_extra = frozenset({"shard_grads", "shard_params"})

    def __post_init__(self):
        object.__setattr__(self, "filter", as_filter(self.filter, where="replicate filter"))
        object.__setattr__(self, "devices", check_devices(self.devices, "replicate"))
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            raise PlanError(f"replicate: zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.bucket_size is not None and (
                isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, (int, float))
                or self.bucket_size <= 0):
            raise PlanError(f"replicate: bucket_size is a positive number of MB, got {self.bucket_size!r}")
        if not isinstance(self.reshard, bool):
            raise PlanError(f"replicate: reshard is true or false, got {self.reshard!r}")
        if not self.reshard and self.zero != 3:
            raise PlanError("replicate: reshard=false only applies to zero=3 (parameters are "
                            "sharded between uses only there); drop it or use zero=3")
        if self.grad_sync not in (None, "microbatch", "step"):
            raise PlanError(f"replicate: grad_sync is 'microbatch' or 'step', got "
                            f"{self.grad_sync!r}")
        if self.grad_sync == "step" and self.zero == 2:
            raise PlanError("replicate: zero=2 with grad_sync='step' holds full gradients "
                            "until one reduce-scatter per step, which is zero=1; use zero=1, "
                            "or zero=3 to shard the parameters too")
        if self.grad_sync is not None and self.zero < 2:
            raise PlanError(f"replicate: grad_sync applies to zero=2 and zero=3 (zero={self.zero}"
                            " reduces gradients once per step); drop it or raise zero")
        object.__setattr__(self, "reduce_stream", check_stream(self.reduce_stream, "replicate"))
        object.__setattr__(self, "gather_stream", check_stream(self.gather_stream, "replicate"))

    def to_json(self) -> dict:
        out = {"op": "replicate", "filter": dict(self.filter), "devices": list(self.devices),
               "zero": self.zero}
        if self.zero >= 2:
            out["shard_grads"] = True
        if self.zero == 3:
            out["shard_params"] = True
        for key in ("bucket_size", "reduce_stream", "gather_stream"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if not self.reshard:
            out["reshard"] = False
        if self.grad_sync is not None:
            out["grad_sync"] = self.grad_sync
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Replicate:
        """Piper's shard_grads/shard_params mean zero 2/3; our `zero` says 0-3 (both agree)."""
        zero = obj.get("zero")
        if zero is None:
            zero = 3 if obj.get("shard_params") else 2 if obj.get("shard_grads") else 0
        elif obj.get("shard_params") and zero != 3 or obj.get("shard_grads") and zero < 2:
            raise PlanError(f"replicate: zero={zero!r} contradicts shard_grads/shard_params; give one")
        plain = {k: v for k, v in obj.items() if k not in cls.json_extra}
        return super().from_json({**plain, "zero": zero})

    @classmethod
    def row(cls, stages: int, microbatches: int) -> dict[str, Any]:
        return {"op": "replicate", "filter": {"PP": 0}, "devices": [0, stages], "zero": 0}

    def code(self) -> str:
        return call_code("pn.replicate", replicate, vars(self))


def replicate(filter: Mapping[str, Any], devices: Sequence[int], zero: int = 0,
              bucket_size: float | None = None, reduce_stream: str | None = None,
              gather_stream: str | None = None, reshard: bool = True,
              grad_sync: str | None = None) -> Replicate:
    """Replicas of the regions `filter` matches on `devices`, gradients summed over them,
    with ZeRO level `zero` (see `Replicate`)."""
    return Replicate(filter, devices, zero, bucket_size, reduce_stream, gather_stream, reshard,
                     grad_sync)


@dataclass(frozen=True)
class ReplicaConfig:
    devices: tuple[int, ...]
    zero: int
    bucket_size: float | None
    reduce_stream: str
    gather_stream: str
    directive: int
    reshard: bool = True
    grad_sync: str | None = None   # as given (None: the level's default, see `_buckets`)


@dataclass(frozen=True)
class Bucket:
    """Parameters synchronised together: one flat buffer, sharded over `group` when zero>0."""

    index: int
    params: tuple[str, ...]
    group: tuple[int, ...]
    zero: int
    regions: tuple[int, ...]
    reduce_stream: str = "dp"
    gather_stream: str = "dp"
    reshard: bool = True      # zero 3: False keeps parameters gathered across the step's passes
    grad_sync: str = "microbatch"   # zero 2/3: "step" reduces full gradients once per step


def replica_configs(dag: TrainingDAG, replicates: list[tuple[int, object]]) -> dict[int, ReplicaConfig]:
    """Region -> replication, from the replicate directives (index, directive)."""
    configs: dict[int, ReplicaConfig] = {}
    for idx, d in replicates:
        regions = {n.region for n in dag.select(d.filter)}
        if not regions:
            raise PlanError(f"replicate filter {dict(d.filter)} matches no region",
                            directive=idx, op="replicate")
        for r in regions:
            configs[r] = ReplicaConfig(d.devices, d.zero, d.bucket_size, d.reduce_stream or "dp",
                                       d.gather_stream or "dp", idx, d.reshard, d.grad_sync)
    return configs


def _by_region(dag: TrainingDAG) -> dict[int, list[Node]]:
    """Region -> its nodes, in DAG order (cached on the DAG)."""
    cache = dag._idx()
    if "by_region" not in cache:
        out: dict[int, list[Node]] = {}
        for n in dag.nodes:
            out.setdefault(n.region, []).append(n)
        cache["by_region"] = out
    return cache["by_region"]


def _last_backward(dag: TrainingDAG, region: int) -> list[Node]:
    return [n for n in _by_region(dag).get(region, ()) if n.op in (Op.B, Op.BW)]


def _passes(dag: TrainingDAG, regions) -> list[Node]:
    """The compute passes of these regions, in DAG order."""
    found = [n for r in dict.fromkeys(regions) for n in _by_region(dag).get(r, ())
             if n.op in (Op.F, Op.B, Op.BI, Op.BW)]
    if len(set(regions)) > 1:
        pos = {n.id: i for i, n in enumerate(dag.nodes)}
        found.sort(key=lambda n: pos[n.id])
    return found


def _spread(dag: TrainingDAG, regions, devs: tuple[int, ...]) -> bool:
    """Whether the devices holding these regions' parameters are more than the group one
    pass runs on: a weight tied across stages, or a stage held twice (DualPipe)."""
    group = set(devs)
    return any(n.op == Op.F and n.devices != devs and set(n.devices) != group
               for r in regions for n in _by_region(dag).get(r, ()))


def _buckets(dag, region_params, param_bytes, configs) -> list[Bucket]:
    holders = {n.region: n.devices for n in dag.nodes if n.op == Op.U}
    regions_of: dict[str, list[int]] = {}
    for r, ps in region_params.items():
        for p in ps:
            regions_of.setdefault(p, []).append(r)
    groups: dict[tuple, list[str]] = {}
    for p, rs in regions_of.items():
        devs = tuple(sorted({d for r in rs for d in holders[r]}))
        if len(devs) < 2:
            continue
        cfgs = {configs[r].zero if r in configs else None for r in rs}
        zero = cfgs.pop() if len(cfgs) == 1 else None
        if zero is None and len(cfgs) > 0 and any(r in configs for r in rs):
            names = ", ".join(dag.regions()[r].name for r in rs)
            raise PlanError(f"parameter {p} is shared by regions {names} with different replicate "
                            "settings; replicate them with the same zero level")
        zero = zero or 0
        groups.setdefault((devs, zero, tuple(rs)), []).append(p)
    out: list[Bucket] = []
    for (devs, zero, rs), params in groups.items():
        cfg = configs.get(rs[0])
        limit = cfg.bucket_size * 2**20 if cfg and cfg.bucket_size else None
        # a weight summed across stages or copies is sharded over every device that holds
        # it; under ZeRO-3 it is gathered once per step, not before every pass (the stages'
        # passes would otherwise have to meet at every gather)
        spread = zero >= 2 and _spread(dag, rs, devs)
        reshard = (cfg.reshard if cfg else True) and not (zero == 3 and spread)
        # zero 0/1 reduce once per step, and so do ZeRO-2/3 buckets spread over stages or
        # copies (the members run their microbatches' backwards in different orders);
        # otherwise as given, by default once per microbatch unless parameters stay gathered
        sync = ("step" if zero < 2 or spread else
                cfg.grad_sync or ("microbatch" if cfg.reshard else "step"))
        chunk: list[str] = []
        size = 0
        for p in params:
            if chunk and limit is not None and size + param_bytes[p] > limit:
                out.append(Bucket(len(out), tuple(chunk), devs, zero, rs,
                                  cfg.reduce_stream, cfg.gather_stream, reshard, sync))
                chunk, size = [], 0
            chunk.append(p)
            size += param_bytes[p]
        out.append(Bucket(len(out), tuple(chunk), devs, zero, rs,
                          cfg.reduce_stream if cfg else "dp", cfg.gather_stream if cfg else "dp",
                          reshard, sync))
    return out


def insert_grad_sync(dag: TrainingDAG, replicates: Directives, ctx: Context) -> TrainingDAG:
    """Buckets over every parameter held on several devices (replicas, tied weights, a
    stage's two copies) and their collectives: all-reduce, or ZeRO's reduce-scatter and
    all-gathers. Frozen parameters get no gradient: never reduced, sharded or updated."""
    configs = replica_configs(dag, replicates)
    region_params = {r.index: tuple(p for p in r.params if p not in ctx.frozen)
                     for r in ctx.capture.regions}
    param_bytes = {k: p.numel() * p.element_size() for k, p in ctx.capture.named_parameters()}
    buckets = _buckets(dag, region_params, param_bytes, configs)
    nodes = list(dag.nodes)
    edges = list(dag.edges)
    u_of = {n.region: n for n in dag.nodes if n.op == Op.U}
    regions = dag.regions()

    def coll(op: Op, b: Bucket, tags: dict, suffix: str, stream: str, purpose: Purpose) -> Node:
        t = freeze_tags(tags)
        n = Node(id=node_id(op, t, f"#b{b.index}{suffix}"), op=op, tags=t, region=b.regions[0],
                 devices=b.group, stream=stream,
                 attrs=(("bucket", b.index), ("purpose", purpose), ("zero", b.zero)))
        nodes.append(n)
        return n

    last_of: dict[tuple[int, ...], str] = {}   # group -> its last step reduction so far
    spread_groups = {b.group for b in buckets if _spread(dag, b.regions, b.group)}
    gathers: dict[tuple[int, ...], list[str]] = {}   # group -> its ZeRO-1/2 step gathers
    for b in buckets:
        base = dict(regions[b.regions[0]].tags)
        producers = [n for r in b.regions for n in _last_backward(dag, r)]
        if b.grad_sync == "step":
            op = Op.ALL_REDUCE if b.zero == 0 else Op.REDUCE_SCATTER
            c = coll(op, b, base, "", b.reduce_stream, Purpose.GRAD)
            edges += [Edge(p.id, c.id) for p in producers]
            edges += [Edge(c.id, u_of[r].id) for r in b.regions]
            # where a group holds buckets spread over stages or copies, its members finish
            # their backwards in different orders: its step reductions go in bucket order,
            # then its gathers
            if b.group in spread_groups:
                if b.group in last_of:
                    edges.append(Edge(last_of[b.group], c.id, EdgeKind.TEMPORAL))
                last_of[b.group] = c.id
        else:
            by_mb: dict = {}
            for p in producers:
                by_mb.setdefault(p.mb, []).append(p)
            for mb in sorted(by_mb, key=lambda m: -1 if m is None else m):
                tags = {**base, "MB": mb} if mb is not None else base
                c = coll(Op.REDUCE_SCATTER, b, tags, "", b.reduce_stream, Purpose.GRAD)
                edges += [Edge(p.id, c.id) for p in by_mb[mb]]
                edges += [Edge(c.id, u_of[r].id) for r in b.regions]
        if b.zero in (1, 2):
            g = coll(Op.ALL_GATHER, b, base, "", b.gather_stream, Purpose.PARAM)
            edges += [Edge(u_of[r].id, g.id) for r in b.regions]
            if b.group in spread_groups:
                gathers.setdefault(b.group, []).append(g.id)
        if b.zero == 3 and not b.reshard:
            # one gather per device and step: pulled before the first pass, freed after the last
            passes = _passes(dag, b.regions)
            g = coll(Op.ALL_GATHER, b, base, ".step", b.gather_stream, Purpose.PARAM)
            nodes[-1] = g.with_attrs(before=passes[0].id, consumers=tuple(p.id for p in passes))
            edges += [Edge(g.id, p.id) for p in passes]
        elif b.zero == 3:
            for n in _passes(dag, b.regions):
                tags = {**base, "MB": n.mb} if n.mb is not None else base
                g = coll(Op.ALL_GATHER, b, tags, f".{n.op.value}{n.region}", b.gather_stream,
                         Purpose.PARAM)
                nodes[-1] = g.with_attrs(before=n.id)
                edges.append(Edge(g.id, n.id))
    for group, ids in gathers.items():   # then its gathers, in bucket order, after them
        chain = [last_of[group], *ids] if group in last_of else ids
        edges += [Edge(a, b, EdgeKind.TEMPORAL) for a, b in zip(chain, chain[1:], strict=False)]
    return dag.replace(nodes=nodes, edges=edges, meta={"buckets": tuple(buckets)},
                       step=f"{len(buckets)} buckets")


def replica_width(directives: Directives, share: int, per: int = 1) -> int:
    """The replicas a microbatch of `share` samples is cut into, as the program's
    replicates say: the widest, unless it does not divide the microbatch (its regions are
    then placed on smaller groups, as a stage's two copies; `check_widths` says which).
    `per`: devices sharing one sample (context parallelism cuts its sequence)."""
    width = max((max(len(d.devices) // per, 1) for _, d in directives
                 if isinstance(d, Replicate)), default=1)
    return width if share % width == 0 else 1


def check_widths(dag: TrainingDAG, directives: Directives, bsz: int, micro: int,
                 per: int = 1) -> int:
    """The replica width (devices per forward, over `per` devices sharing one sample) of
    the placed DAG, checked to divide a microbatch."""
    widths = {max(len(n.devices) // per, 1) for n in dag.nodes if n.op == Op.F}
    for w in sorted(widths, reverse=True):
        if (bsz // micro) % w:
            idx = next((i for i, d in directives if isinstance(d, Replicate)
                        and len(d.devices) % w == 0), None)
            raise PlanError(f"{w} replicas do not divide the microbatch of {bsz // micro} "
                            f"samples (batch {bsz} / {micro} microbatches); use a batch divisible "
                            f"by {micro * w}", directive=idx,
                            op="replicate" if idx is not None else None)
    return max(widths, default=1)
