"""Gradient completeness: a static check that every backward sees each gradient once.

A value's gradient is the sum of one contribution per region that reads it, made by that
region's backward on whatever device it runs; a parameter's gradient is the sum over every
region that uses it, every microbatch and every replica. The worker keeps one gradient
buffer per (value, microbatch) and per parameter, adds what arrives, and sends what it
holds. So a plan trains the wrong model, silently, when a backward runs before one of its
contributions arrived, when a contribution arrives twice (two messages cut from one
running sum), or when an update runs before its gradient reduction is complete.

This check replays the plan symbolically, in the lockstep order of the deadlock dry run
(`dryrun.dry_run` calls a `Flow` for each instruction that moves gradients, as it runs),
with the worker's bookkeeping over *sets of contributions* instead of tensors: bit c of a
value's mask is region c's contribution, bit (region, microbatch, replica) of a parameter
unit's mask (a bucket, or a parameter outside buckets) is one backward's. A RECV adds the
mask its SEND held at issue; an all-reduce's WAIT sets the union of the members' masks at
issue; a reduce-scatter's adds it to the shard; an all-to-all moves masks as
`runtime.exchange` moves rows. Before a backward (B or BI), each of its outputs' masks must
be exactly the set of the value's readers; before an update, each parameter unit's exactly
every backward that uses it. An overlap while adding is a contribution counted twice.
Either is a `PlanError` naming the value or parameter, the devices and the order directive.
Activations are not followed: a missing one stops the worker with a clear error, it never
trains silently wrong. The parameter units and their bits live in `grad_units`.
"""

from __future__ import annotations

from collections import defaultdict

from piper_nb.compiler.grad_units import Units, set_bits
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import PASSES, EdgeKind, Op, Purpose

__all__ = ["Flow", "Asymmetric"]



class Asymmetric(Exception):
    """A replica's gradients differ from its template's in more than the replica index:
    replay every device instead (`checks.check_plan` does)."""


class Flow:
    """The symbolic replay. `dryrun.dry_run` calls, in a valid global order: `backward`
    (B, BI), `weights` (BW), `update` (U), `send` (a gradient SEND), `received` (the WAIT of
    a gradient RECV), `issued` / `completed` (reductions and exchanges, and their WAITs) and
    `free` (a FREE of gradient buffers, see `frees_grads`)."""

    def __init__(self, plan, replicas: bool = True):
        self.plan = plan
        n = plan.world
        # devices stamped from a template by the lowering are not replayed: their gradients
        # flow as their template's, the replica index aside (`_payload` derives theirs)
        self.template = self._templates(plan) if replicas else {}
        self.active = [d not in self.template for d in range(n)]
        self.grads: list[dict] = [{} for _ in range(n)]     # (value, mb) -> readers' bits
        self.pgrads: list[dict] = [{} for _ in range(n)]    # unit -> backward bits
        self.shards: list[dict] = [{} for _ in range(n)]    # bucket -> reduced shard bits
        self.sent: dict[tuple, dict] = {}            # p2p key -> value masks at issue
        self.coll: dict[tuple, dict] = {}            # (group, seq) -> device -> payload
        self.coll_seq: dict[tuple, int] = {}         # (device, index) -> collective number
        self.coll_next: list[dict] = [defaultdict(int) for _ in range(n)]
        self.total: dict[tuple, int] = {}            # (group, seq) -> reduced mask
        readers: dict[str, int] = defaultdict(int)
        for r in plan.regions:
            for v in r.inputs:
                if v not in plan.batch_names:
                    readers[v] |= 1 << r.index
        self.expect = {v: m for v, m in readers.items()
                       if v in plan.values and plan.values[v].requires_grad
                       and plan.values[v].dtype.startswith(("float", "bfloat", "complex"))}
        # per region: (outputs whose gradient it waits for, inputs it contributes to, its bit)
        self.passes = [(tuple((v, self.expect[v]) for v in r.outputs if v in self.expect),
                        tuple(v for v in r.inputs if v in self.expect), 1 << r.index)
                       for r in plan.regions]
        # a sharded part's contribution to an input whose gradient the tensor-parallel group
        # sums is one device's share: bit `shift + region` until that all-reduce's WAIT
        # makes it the region's bit
        tp = getattr(getattr(plan, "capture", None), "tp", None)
        cp = getattr(getattr(plan, "capture", None), "cp", None)
        self.shared = (tp.grad_sum if tp is not None else frozenset()) | (
            cp.grad_sum if cp is not None else frozenset())
        self.shift = len(plan.regions)
        self.units = Units(plan, self._widths(plan), frozenset(plan.frozen))
        self.position: dict[tuple[int, int], int] = {}   # (device, region) -> replica
        if self.template:
            seen = set()
            for node in plan.dag.nodes:
                if node.op == Op.F and (node.region, node.devices) not in seen:
                    seen.add((node.region, node.devices))
                    for k, dev in enumerate(node.devices):
                        self.position[(dev, node.region)] = k
            lead = {m: g[0] for g in plan.tp_groups for m in g[1:]}
            if lead:   # a tensor-parallel member stands where its group's first device does
                for (dev, r), k in list(self.position.items()):
                    for m in (m for m, first in lead.items() if first == dev):
                        self.position[(m, r)] = k
        self.region_units: list[dict] = [{} for _ in range(n)]   # region -> its units
        self.freed: dict[tuple[str, ...], tuple] = {}       # FREE keys -> gradient keys

    @staticmethod
    def _templates(plan) -> dict[int, int]:
        """Stamped device -> its template, for the stamps whose point-to-point peers are all
        replayed (a replayed device only ever receives from replayed ones)."""
        template = plan.stamps()
        if not template:
            return template
        groups: dict[int, set] = defaultdict(set)   # region -> its passes' device groups
        if plan.dag is not None:
            for node in plan.dag.nodes:
                if node.op in PASSES:
                    groups[node.region].add(node.devices)
        mixed = {d for r, gs in groups.items() if len(gs) > 1 for g in gs for d in g}
        if plan.dag is None or mixed:   # positions not one per region: replay those
            template = {d: t for d, t in template.items() if d not in mixed and t not in mixed}
        todo = [d for d in range(plan.world) if d not in template]
        seen = set(todo)
        while todo:
            for ins in plan.devices[todo.pop()].instrs:
                if (ins.kind == Op.SEND or ins.kind == Op.RECV) and ins.data.peer not in seen:
                    seen.add(ins.data.peer)
                    template.pop(ins.data.peer, None)
                    todo.append(ins.data.peer)
        return template

    @staticmethod
    def _widths(plan) -> dict[int, int]:
        """Region -> replicas running each of its passes (from the DAG when there is one)."""
        if plan.dag is not None:
            return {n.region: len(n.devices) for n in plan.dag.nodes if n.op == Op.F}
        return {i.region: i.replicas for dp in plan.devices for i in dp.instrs if i.kind == Op.F}

    # ---- messages --------------------------------------------------------------------
    def _fail(self, d: int, ins, what: str, fix: str) -> PlanError:
        directive = None
        dag = self.plan.dag
        if dag is not None and ins.node in dag:
            origins = [e.origin for e in dag.in_edges(ins.node) if e.kind == EdgeKind.TEMPORAL]
            directive = origins[0] if origins else None
        return PlanError(f"device {d}: {ins} {what}; {fix}", directive=directive,
                         op="order" if directive is not None else None)

    def _readers(self, mask: int, mb: int) -> str:
        where = defaultdict(list)
        for dp in self.plan.devices:   # only on the way to an error
            for i in dp.instrs:
                if i.kind in (Op.B, Op.BI) and i.mb == mb and mask >> i.region & 1:
                    where[i.region].append(dp.device)
        return ", ".join(f"{{{self.plan.regions[r].name}}} on device"
                         f"{'s' if len(where[r]) > 1 else ''} "
                         f"{', '.join(map(str, where[r])) or '?'}" for r in set_bits(mask))

    def _twice(self, d: int, ins, key, both: int) -> PlanError:
        if isinstance(key, tuple):
            what = f"{self._readers(both, key[1])} to the gradient of {key[0]}@{key[1]}"
        else:
            what = f"{self.units.describe(key, both)} to the gradient of {self.units.name(key)}"
        return self._fail(d, ins, f"adds the contribution of {what} a second time",
                          "each contribution must reach its sum once: a device holds one "
                          "running sum per value, so send it once, after its last contribution")

    def _add(self, d: int, ins, table: dict, key, bits: int) -> None:
        old = table.get(key, 0)
        if old & bits:
            raise self._twice(d, ins, key, old & bits)
        table[key] = old | bits

    # ---- compute ---------------------------------------------------------------------
    def backward(self, d: int, ins) -> None:
        waits, feeds, bit = self.passes[ins.region]
        mb, grads = ins.mb, self.grads[d]
        for v, want in waits:
            got = grads.get((v, mb), 0)
            if got >> self.shift:
                raise self._fail(
                    d, ins, f"runs on this device's share of the gradient of {v}@{mb} from "
                    f"{self._readers(got >> self.shift, mb)}: the tensor-parallel all-reduce "
                    "of those shares has not completed",
                    "issue and wait for the group's all-reduce of the gradient ("
                    + ", ".join(f"r{r}:AR_B{mb}" for r in set_bits(got >> self.shift))
                    + ") before this backward")
            if got != want:
                raise self._fail(
                    d, ins, f"runs before the gradient of {v}@{mb} is complete: it lacks the "
                    f"contribution of {self._readers(want & ~got, mb)} (every reader: "
                    f"{self._readers(want, mb)})",
                    "order this backward after the backward passes of every region that reads "
                    "its outputs and after the messages that bring their gradients")
        for v in feeds:
            key = (v, mb)
            old = grads.get(key, 0)
            mine = bit << self.shift if v in self.shared else bit
            if old & mine:
                raise self._twice(d, ins, key, mine)
            grads[key] = old | mine
        if ins.kind == Op.B:
            self.weights(d, ins)

    def weights(self, d: int, ins) -> None:
        pgrads, step = self.pgrads[d], max(ins.mb, 0)
        units = self.region_units[d].get(ins.region)
        if units is None:
            units = self.region_units[d][ins.region] = self.units.of_region(ins.region, d)
        for u, offset, width in units:
            bit = 1 << offset + step * width + ins.replica
            old = pgrads.get(u, 0)
            if old & bit:
                raise self._twice(d, ins, u, bit)
            pgrads[u] = old | bit

    def update(self, d: int, ins) -> None:
        seen = set()
        for p in ins.data.params:
            if p in self.units.frozen:
                continue
            u = self.units.unit(p, d)
            if u not in seen:
                seen.add(u)
                self._complete(d, ins, u, self.pgrads[d].pop(u, 0))
        for b in ins.data.buckets:
            if b in self.units.expected:
                self._complete(d, ins, b, self.shards[d].pop(b, 0))

    def _complete(self, d: int, ins, u, got: int) -> None:
        want = self.units.expected.get(u, 0)
        if got != want:
            raise self._fail(
                d, ins, f"updates {self.units.name(u)} before its gradient is complete: it "
                f"lacks {self.units.describe(u, want & ~got)}",
                "the update must follow every backward that uses the parameter and the "
                "gradient reduction over all its replicas and copies")

    # ---- messages and buffers --------------------------------------------------------
    def send(self, d: int, ins) -> None:
        grads = self.grads[d]
        self.sent[(d, ins.data.peer, ins.data.tag)] = {v: grads.get((v, ins.mb), 0) for v in ins.data.values}

    def received(self, d: int, src) -> None:
        payload = self.sent.get((src.data.peer, d, src.data.tag))
        if payload is not None:   # unmatched messages are check_matching's to report
            for v in src.data.values:
                self._add(d, src, self.grads[d], (v, src.mb), payload.get(v, 0))

    def frees_grads(self, ins) -> tuple:
        """The (value, mb) gradient buffers a FREE drops (parsed once per distinct list,
        kept in `freed`)."""
        keys = self.freed.get(ins.data.keys)
        if keys is None:
            keys = self.freed[ins.data.keys] = tuple(
                (v, int(mb)) for k in ins.data.keys if k.startswith("grad:")
                for v, _, mb in [k[5:].rpartition("@")])
        return keys

    def free(self, d: int, keys: tuple) -> None:
        grads = self.grads[d]
        for key in keys:
            grads.pop(key, None)

    def issued(self, d: int, i: int, ins) -> None:
        """A reduction or exchange is issued: what it takes from this member, now (clipping's
        all-reduce of the gradient norm moves no gradient: not followed; a tensor-parallel
        sum of activations neither: activations are not followed)."""
        if ins.is_scalar:
            return
        seq = self.coll_next[d][ins.data.group]
        self.coll_next[d][ins.data.group] = seq + 1
        self.coll_seq[(d, i)] = seq
        if ins.sums_values:        # the group's sum of per-device shares
            grads = self.grads[d]
            payload = {v: grads.get((v, ins.mb), 0) for v in ins.data.values} if ins.data.grad else None
        elif ins.kind == Op.ALL_REDUCE:
            payload = self.pgrads[d].get(ins.data.bucket, 0)
        elif ins.kind == Op.REDUCE_SCATTER:   # the runtime takes the gradients at issue
            payload = self.pgrads[d].pop(ins.data.bucket, 0)
        elif ins.data.grad:                       # ALL_TO_ALL of gradients
            grads = self.grads[d]
            payload = {v: grads.get((v, ins.mb), 0) for v in ins.data.values}
        else:
            payload = None
        self.coll.setdefault((ins.data.group, seq), {})[d] = payload

    def completed(self, d: int, t: int, src) -> None:
        seq = self.coll_seq.get((d, t))
        if seq is None:
            return
        key = (src.data.group, seq)
        if src.kind == Op.ALL_TO_ALL:
            self._exchanged(d, src, key)
            return
        if src.sums_values:
            if src.data.grad:
                self._shares_summed(d, src, key)
            return
        total = self.total.get(key)
        if total is None:
            total = 0
            for m, mask in self._members(src, key).items():
                if total & mask:
                    raise self._twice(m, src, src.data.bucket, total & mask)
                total |= mask
            self.total[key] = total
        if src.kind == Op.ALL_REDUCE:   # the reduced bucket replaces the gradients held
            self.pgrads[d][src.data.bucket] = total
        else:
            self._add(d, src, self.shards[d], src.data.bucket, total)

    def _shares_summed(self, d: int, src, key) -> None:
        """A tensor-parallel all-reduce of gradients, at its WAIT (the runtime writes the
        group's sum over what each member held at issue): a share every member held becomes
        its region's whole contribution; one some member lacked stays a share; a whole
        contribution summed over the group would count `degree` times."""
        members, mb, low = self._members(src, key), src.mb, (1 << self.shift) - 1
        for v in src.data.values:
            masks = [p.get(v, 0) for p in members.values()]
            whole = 0
            for m in masks:
                whole |= m & low
            if whole:
                raise self._fail(d, src, f"sums the gradient of {v}@{mb} over the "
                                 f"tensor-parallel group {list(src.data.group)}, but it holds the "
                                 f"whole contribution of {self._readers(whole, mb)}, which the "
                                 f"sum would count {len(src.data.group)} times",
                                 "sum only the shares of sharded parts: a value a sharded part "
                                 "reads goes through an alias of its own (tp.rewrite)")
            every = -1
            for m in masks:
                every &= m
            some = 0
            for m in masks:
                some |= m
            self.grads[d][(v, mb)] = (every >> self.shift) | (some & ~every)

    def _members(self, src, key) -> dict:
        """Each member's payload of collective `key`; a stamped member's is its template's
        (a parameter mask moved to the member's replica index)."""
        got = self.coll[key]
        if len(got) == len(src.data.group):
            return got
        out = {}
        for m in src.data.group:
            if m in got:
                out[m] = got[m]
            else:
                t = self.template[m]
                if src.sums_values:   # the members' shares mirror each other
                    out[m] = got.get(t, next(iter(got.values())))
                else:
                    out[m] = (got[t] if src.kind == Op.ALL_TO_ALL
                              else self._relabel(src.data.bucket, got[t], t, m))
        return out

    def _relabel(self, u, mask: int, t: int, m: int) -> int:
        """Template t's parameter mask of unit u as replica m's: each region's bits move
        from t's replica index to m's (they must all sit at t's)."""
        out, units = 0, self.units
        for r in units.regions_of[u]:
            seg = mask & units.column(u, r, None)
            if not seg:
                continue
            a, b = self.position.get((t, r)), self.position.get((m, r))
            if a is None or b is None or seg & ~units.column(u, r, a):
                raise Asymmetric
            out |= seg << (b - a) if b >= a else seg >> (a - b)
        return out

    def _exchanged(self, d: int, src, key) -> None:
        """A gradient ALL_TO_ALL's WAIT (runtime.exchange.finish): a dispatch leaves every
        sender and reaches the owner (concatenated rows: the members must agree), a combine
        leaves the owner and is added on every member."""
        if not src.data.grad:
            return
        members, mb, grads = self._members(src, key), src.mb, self.grads[d]
        for v, owner in zip(src.data.values, src.data.owners, strict=True):
            if src.purpose == Purpose.DISPATCH:
                masks = {m: p[v] for m, p in members.items()}
                if len(set(masks.values())) > 1:
                    (a, ma), (b, mb_) = list(masks.items())[:2]
                    raise self._fail(d, src, f"gathers the gradient of {v}@{mb} with "
                                     f"contributions {self._readers(ma, mb) or 'none'} from "
                                     f"device {a} but {self._readers(mb_, mb) or 'none'} from "
                                     f"device {b}", "every member must finish the backward "
                                     "passes that read its rows before the exchange")
                grads.pop((v, mb), None)
                if d == owner:
                    grads[(v, mb)] = masks[owner]
            else:
                if d == owner:
                    grads.pop((v, mb), None)
                self._add(d, src, grads, (v, mb), members[owner][v])
