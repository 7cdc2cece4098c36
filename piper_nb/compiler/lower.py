"""Lower a placed, ordered TrainingDAG into one instruction list per device.

Per device: a topological order of its nodes (data and temporal edges) with Piper's
priorities inside a level: SEND first, then collectives, then compute; receives and
ZeRO-3 gathers are *pulled*: issued one compute step before the pass that needs them so
the transfer overlaps the previous pass (a gather kept for the whole step is issued at the
start, so every member of its group issues it at one point). Every issue gets a WAIT right
before its first consumer (sends: at the end of the step, as PyTorch's pipelining does:
waiting for a send earlier can deadlock deep DualPipe schedules; a ZeRO-2/3 microbatch's
gradient reduce-scatter before its group's next one is issued, as FSDP2 does, so the
unsharded gradients of one bucket and microbatch at a time wait to be reduced), and FREE
instructions release each buffer after its last reader. Last, every device posts its
receives from a peer in the order that peer sends (`p2p.in_send_order`), as NCCL needs.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from piper_nb.compiler.floating_passes import merge_floating
from piper_nb.compiler.p2p import in_send_order
from piper_nb.compiler.replica_stamps import Stamper, classes_of
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import BACKWARDS, COLLECTIVES, COMPUTE, PASSES, EdgeKind, Op, Purpose, Unit
from piper_nb.ir.node import Node
from piper_nb.plan.instr import Collective, Free, Instr, Message, Pass, Update, Wait, slice_name
from piper_nb.plan.plan import DevicePlan, StampedDevicePlan

__all__ = ["lower", "owned_params"]

_PASS_RANK = {Op.F: 0, Op.B: 1, Op.BI: 1, Op.BW: 2, Op.U: 3}


def _key(n: Node, remote: bool = True) -> tuple:
    """Heap priority on one device. Forwards run in region order and backwards in reverse
    (the pass a peer waits on comes first). Without an order directive a backward that
    waits on a peer (`remote`: a RECV or an all-to-all upstream on this device) comes after
    every ready forward (GPipe's fill), while one this device can finish alone runs as soon
    as its microbatch's forward is done: F0 B0 F1 B1, gradient accumulation's order, which
    frees each microbatch's activations before the next forward."""
    if n.op == Op.SEND:
        return (0, 0, 0, 0, 0, n.id)
    if n.op in COLLECTIVES:
        return (1, 0, n.mb if n.mb is not None else -1, 0, 0, n.id)
    mb = n.mb if n.mb is not None else -1
    if n.attrs and n.attr("floating"):   # a later segment left out of the order: it waits
        return (2, -1, mb, -_PASS_RANK[n.op], n.region, n.id)   # on a peer that waits on it
    if n.op in BACKWARDS:
        if remote:
            return (2, _PASS_RANK[n.op], mb, 0, -n.region, n.id)
        return (2, 0, mb, _PASS_RANK[n.op], -n.region, n.id)
    return (2, _PASS_RANK[n.op], mb, 0, n.region, n.id)


def _waits_on_peers(dag: TrainingDAG, nodes: list[Node], ids: set[str]) -> set[str]:
    """Ids of this device's nodes downstream (on this device) of a RECV or an all-to-all."""
    todo = [n.id for n in nodes if n.op in (Op.RECV, Op.ALL_TO_ALL) and not n.attr("ring")]
    seen = set(todo)
    while todo:
        for e in dag.out_edges(todo.pop()):
            if e.dst in ids and e.dst not in seen:
                seen.add(e.dst)
                todo.append(e.dst)
    return seen


def _is_pulled(n: Node) -> bool:
    return n.op == Op.RECV or (n.op == Op.ALL_GATHER and n.attr("before") is not None)


def owned_params(dag: TrainingDAG, buckets, device: int,
                 local: list[Node] | None = None) -> dict[int, tuple[list[str], list[int]]]:
    """Region -> (full parameters, sharded buckets) its U updates on `device`."""
    regions, frozen = dag.regions(), dag.get_meta("frozen", frozenset())
    nodes = local if local is not None else dag.nodes
    mine = sorted({n.region for n in nodes if n.op == Op.U and device in n.devices})
    sharded = {p: b for b in buckets if b.zero > 0 and device in b.group for p in b.params}
    taken: set[str] = set()
    out: dict[int, tuple[list[str], list[int]]] = {}
    for r in mine:
        full, bks = [], []
        for p in regions[r].params:
            if p in taken or p in frozen:
                continue
            taken.add(p)
            if p in sharded:
                if sharded[p].index not in bks:
                    bks.append(sharded[p].index)
            else:
                full.append(p)
        out[r] = (full, bks)
    return out


def _cycle_error(dag: TrainingDAG, left: set[str], device: int) -> PlanError:
    # walk predecessors inside `left` until a node repeats: that is a cycle
    start = min(left)
    path, seen = [start], {start: 0}
    while True:
        preds = [e for e in dag.in_edges(path[-1]) if e.src in left]
        nxt = preds[0].src
        if nxt in seen:
            cyc = path[seen[nxt]:] + [nxt]
            break
        seen[nxt] = len(path)
        path.append(nxt)
    cyc.reverse()
    origin = None
    for a, b in zip(cyc, cyc[1:], strict=False):
        for e in dag.out_edges(a):
            if e.dst == b and e.kind == EdgeKind.TEMPORAL:
                origin = e.origin
    text = " -> ".join(cyc)
    return PlanError(f"the order makes a cycle on device {device}: {text}; a pass is ordered "
                     "before something it depends on: swap those slots", directive=origin,
                     op="order" if origin is not None else None)


def _order_device(dag: TrainingDAG, d: int, nodes: list[Node],
                  floating: frozenset[str] = frozenset()) -> tuple[list[Node], dict]:
    """A device's order (floating nodes left out, see `floating_passes`) and, per node, the
    pulled issues (receives, ZeRO-3 gathers) that come just before it."""
    ids = {n.id for n in nodes}
    pulled_of: dict[str, list[Node]] = defaultdict(list)
    indeg = {n.id: 0 for n in nodes if not _is_pulled(n) and n.id not in floating}
    for n in nodes:
        for e in dag.out_edges(n.id):
            if e.dst not in ids:
                continue
            if _is_pulled(n):
                pulled_of[e.dst].append(n)
            elif e.dst in indeg and n.id not in floating:
                indeg[e.dst] += 1
    remote = _waits_on_peers(dag, nodes, ids)
    heap = [(_key(dag[i], i in remote), i) for i, k in indeg.items() if k == 0]
    heapq.heapify(heap)
    seq = []
    while heap:
        _, nid = heapq.heappop(heap)
        seq.append(dag[nid])
        for e in dag.out_edges(nid):
            if e.dst in indeg:
                indeg[e.dst] -= 1
                if indeg[e.dst] == 0:
                    heapq.heappush(heap, (_key(dag[e.dst], e.dst in remote), e.dst))
    if len(seq) != len(indeg):
        raise _cycle_error(dag, {i for i in indeg if indeg[i] > 0}, d)
    return seq, pulled_of


def lower(dag: TrainingDAG, buckets, world: int) -> tuple[DevicePlan, ...]:
    width = max((len(n.devices) for n in dag.nodes), default=1)
    tags = {}
    for i, n in enumerate(x for x in dag.nodes if x.op == Op.SEND):
        tags[n.id] = i * width
    partner = {}
    for n in dag.nodes:
        if n.op == Op.SEND:
            (e,) = [e for e in dag.out_edges(n.id) if dag[e.dst].op == Op.RECV]
            partner[n.id], partner[e.dst] = dag[e.dst], n
            tags[e.dst] = tags[n.id]
    regions = dag.regions()
    # Devices that hold exactly the same nodes (the replicas of one stage) share one
    # schedule: order and emit it once, then stamp out each replica's peers and tags.
    classes, local = classes_of(dag, world)
    plans: list[DevicePlan | None] = [None] * world
    floating = _floating(dag)
    if floating:
        local = [local[d] if d in local else [n for n in dag.nodes if d in n.devices]
                 for d in range(world)]
        return _lower_merged(dag, buckets, world, local, classes, floating, partner, tags)
    templates = {}
    for devs in classes.values():
        rep = devs[0]
        seq, pulled_of = _order_device(dag, rep, local[rep])
        owned = owned_params(dag, buckets, rep, local[rep])
        templates[rep] = _emit(dag, rep, seq, pulled_of, partner, tags, owned, regions)
    templates = in_send_order(templates, partner,
                              {d: devs[0] for devs in classes.values() for d in devs})
    for devs in classes.values():
        template = templates[devs[0]]
        plans[devs[0]] = DevicePlan(devs[0], template)
        if len(devs) > 1:   # each replica's list is stamped when first asked for
            stamp = Stamper(dag, template, partner, tags)
            for d in devs[1:]:
                plans[d] = StampedDevicePlan(d, template, stamp)
    return tuple(plans)


def _floating(dag: TrainingDAG) -> frozenset[str]:
    """The passes an order left out (`floating`) and what follows them on their device
    without being ordered itself: their sends, updates and gradient collectives."""
    todo = [n.id for n in dag.nodes if n.attrs and n.attr("floating")]
    seen = set(todo)
    while todo:
        n = dag[todo.pop()]
        for e in dag.out_edges(n.id):
            m = dag[e.dst]
            if (e.dst not in seen and set(m.devices) & set(n.devices) and not _is_pulled(m)
                    and m.op not in (Op.F, Op.B, Op.BI, Op.BW)):
                seen.add(e.dst)
                todo.append(e.dst)
    return frozenset(seen)


def _lower_merged(dag, buckets, world, local, classes, floating, partner, tags):
    """`lower` for a DAG with floating nodes: the devices' orders are merged with them by
    one global list schedule (`floating.merge_floating`), then emitted device by device."""
    seqs, pulled = [None] * world, [None] * world
    for devs in classes.values():
        seq, pulled_of = _order_device(dag, devs[0], local[devs[0]], floating)
        for d in devs:
            seqs[d], pulled[d] = seq, pulled_of
    extra = [[n for n in local[d] if n.id in floating] for d in range(world)]
    merged = merge_floating(dag, seqs, extra, key=lambda n: (_key(n), n.id))
    regions = dag.regions()
    instrs = in_send_order({d: _emit(dag, d, merged[d], pulled[d], partner, tags,
                                     owned_params(dag, buckets, d, local[d]), regions)
                            for d in range(world)}, partner)
    return tuple(DevicePlan(d, instrs[d]) for d in range(world))


def _instr(n: Node, d: int, partner, tags, owned) -> Instr:
    pos = n.devices.index(d)
    mb = n.mb if n.mb is not None else -1
    if n.op in COMPUTE:
        full, bks = owned.get(n.region, ((), ())) if n.op == Op.U else ((), ())
        data = (Update(tuple(full), tuple(bks)) if n.op == Op.U else
                Pass(n.attr("overlap", -1), n.attr("recompute") is not None
                     and not n.attr("unit"), Unit(n.attr("unit", "")), n.attr("keep", ()),
                     n.attr("slices", ()), n.attr("compiled", "")))
        return Instr(n.op, n.id, "compute", n.region, mb, pos, len(n.devices), data)
    if n.op in (Op.SEND, Op.RECV):
        other = partner[n.id]
        return Instr(n.op, n.id, n.stream, n.region, mb, pos, len(n.devices),
                     Message(other.devices[pos], tags[n.id] + pos, n.attr("values"),
                             n.attr("grad")))
    values = n.attr("values", ())
    owners, split_by = dict(n.attr("owners", ())), dict(n.attr("split_by", ()))
    return Instr(n.op, n.id, n.stream, n.region, mb, pos, len(n.devices), Collective(
        n.devices, Purpose(n.attr("purpose", "")), n.attr("bucket", -1), values,
        bool(n.attr("grad", False)), tuple(owners[v] for v in values) if owners else (),
        tuple(split_by[v] for v in values) if split_by else (), bool(n.attr("regather"))))


def _emit(dag, d, seq, pulled_of, partner, tags, owned, regions) -> tuple[Instr, ...]:
    out: list[Instr] = []
    issued: dict[str, int] = {}
    waited: set[str] = set()
    computes = [n for n in seq if n.op in COMPUTE]

    def issue(n: Node) -> None:
        if n.id not in issued:
            issued[n.id] = len(out)
            out.append(_instr(n, d, partner, tags, owned))

    def wait(nid: str) -> None:
        if nid in issued and nid not in waited:
            waited.add(nid)
            out.append(Instr(Op.WAIT, nid, out[issued[nid]].stream, data=Wait(issued[nid])))

    # gathers kept for the whole step (ZeRO-3 without resharding, weights spread over
    # stages or copies) are issued first, in one order on every member of their group
    for p in sorted({p.id: p for ps in pulled_of.values() for p in ps
                     if p.op == Op.ALL_GATHER and p.attr("consumers")}.values(),
                    key=lambda p: p.attr("bucket")):
        issue(p)
    if computes:
        for p in pulled_of.get(computes[0].id, ()):
            issue(p)
    ci = 0
    reducing: dict[tuple, list[str]] = {}   # group -> its per-microbatch reduce-scatters
    for n in seq:
        if n.op not in COMPUTE:
            if _per_microbatch_reduce(n):
                # ZeRO-2/3 under microbatches, as FSDP2: the group's previous reduce-scatter
                # is waited for before the next is issued, so one is in flight (its flat
                # copy of the unsharded gradients with it)
                for prior in reducing.get(n.devices, ()):
                    wait(prior)
                reducing.setdefault(n.devices, []).append(n.id)
            for e in dag.in_edges(n.id):   # a transfer of what another one delivers (a
                if e.src in issued and e.kind == EdgeKind.DATA:   # summed gradient sent on)
                    wait(e.src)
            issue(n)
            continue
        ci += 1
        if ci < len(computes):
            for p in pulled_of.get(computes[ci].id, ()):
                issue(p)
        for p in pulled_of.get(n.id, ()):
            issue(p)
        for e in dag.in_edges(n.id):
            if e.src in issued:
                wait(e.src)
        out.append(_instr(n, d, partner, tags, owned))
    for nid in sorted(set(issued) - waited, key=issued.get):
        wait(nid)
    return _add_frees(out, regions, dag)


def _per_microbatch_reduce(n: Node) -> bool:
    """A ZeRO-2/3 gradient reduce-scatter of one microbatch (not the step's one reduction)."""
    return (n.op == Op.REDUCE_SCATTER and n.attr("zero") in (2, 3) and n.attr("purpose") ==
            Purpose.GRAD and dict(n.tags).get("MB") is not None)


def _grad_values(dag) -> frozenset[str]:
    cache = dag._idx()
    if "grad_values" not in cache:
        cache["grad_values"] = frozenset(
            v for e in dag.edges if dag[e.src].op in (Op.B, Op.BI) for v in e.values)
    return cache["grad_values"]


def _gathered(dag) -> dict[str, list[str]]:
    """Pass node -> the ZeRO-3 parameter buffers gathered for it ("param:<bucket>")."""
    cache = dag._idx()
    if "gathered" not in cache:
        out: dict[str, list[str]] = defaultdict(list)
        kept: set[str] = set()
        for n in dag.nodes:
            if n.op == Op.ALL_GATHER and n.attr("before") is not None:
                key = f"param:{n.attr('bucket')}"
                for consumer in n.attr("consumers") or (n.attr("before"),):
                    out[consumer].append(key)
                if n.attr("consumers"):
                    kept.add(key)
        cache["gathered"] = (dict(out), kept)
    return cache["gathered"]


def _add_frees(instrs: list[Instr], regions, dag) -> tuple[Instr, ...]:
    """Insert FREE after the last reader of every buffer the device holds; a second run
    of a layer recomputed as one unit (`Unit.AGAIN`) writes its kept values again, and so
    do a sequence-parallel input's gather before its backward (`compiler.regather`) and
    the second run's receives of a context ring's keys and values, so each is freed after
    its last reader before that write too, and after the write itself when nothing reads
    it later."""
    last: dict[str, int] = {}
    now: dict[int, list[str]] = defaultdict(list)
    grad_values = _grad_values(dag)
    gathered, kept = _gathered(dag)
    made = {v for r in regions for v in r.outputs}     # not the batch: regions make these
    made |= {v for ins in instrs if ins.kind == Op.RECV for v in ins.data.values}   # (a ring)
    for i, ins in enumerate(instrs):
        reads: list[str] = []
        again: list[str] = []   # values written again
        if ins.kind == Op.F:
            reads = [f"act:{v}@{ins.mb}" for v in regions[ins.region].inputs
                     if v in made]
            reads += [f"act:{slice_name(v)}@{ins.mb}" for v in ins.data.slices]
            again = [f"act:{v}@{ins.mb}" for v in ins.data.keep]
        elif ins.kind in BACKWARDS:
            reads = [f"act:{v}@{ins.mb}" for v in ins.data.slices]
            if ins.kind != Op.BW:
                reads += [f"grad:{v}@{ins.mb}" for v in regions[ins.region].outputs
                          if v in grad_values]
                if ins.data.recompute:   # the forward runs again on its inputs
                    reads += [f"act:{v}@{ins.mb}" for v in regions[ins.region].inputs
                              if v in made]
        elif ins.is_regather:
            reads = [f"act:{slice_name(v)}@{ins.mb}" for v in ins.data.values]
        elif ins.kind == Op.WAIT:
            s = instrs[ins.data.target]
            if s.kind == Op.SEND:
                reads = [f"{'grad' if s.data.grad else 'act'}:{v}@{s.mb}" for v in s.data.values]
            elif s.is_regather:   # the gathered input, whole again
                again = [f"act:{v}@{s.mb}" for v in s.data.values]
            elif s.kind == Op.RECV and not s.data.grad:   # a unit's second run receives
                again = [f"act:{v}@{s.mb}" for v in s.data.values]   # a ring's keys again
        for k in again:   # written again: the earlier buffer is done after its last reader
            if k in last:
                now[last.pop(k)].append(k)
            reads.append(k)
        if ins.kind in PASSES:
            reads += gathered.get(ins.node, ())
        for k in reads:
            last[k] = i
            if k.startswith("param:") and k not in kept:  # freed right after its pass
                now[i].append(k)
    after: dict[int, list[str]] = now
    for k, i in last.items():
        if not k.startswith("param:") or k in kept:
            after[i].append(k)
    if not after:
        return tuple(instrs)
    remap: dict[int, int] = {}
    out: list[Instr] = []
    for i, ins in enumerate(instrs):
        remap[i] = len(out)
        out.append(ins)
        if i in after:
            out.append(Instr(Op.FREE, ins.node, "compute", data=Free(tuple(sorted(after[i])))))
    return tuple(
        Instr(x.kind, x.node, x.stream, data=Wait(remap[x.data.target])) if x.kind == Op.WAIT
        else x
        for x in out)
