"""The deadlock check: a lockstep dry run of all devices.

An issue never blocks (except a forward expert dispatch, which first exchanges token
counts with its group), a WAIT on a point-to-point op needs the peer's matching issue, and
a WAIT on a collective needs every member's. Each round runs every device until it blocks
(or after one WAIT). When no device can move, the device-by-step grid is printed with the
stuck instruction of each device marked. The gradient check (`gradflow.Flow`) rides along,
shown the instructions that move gradients in this valid global order.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from piper_nb.compiler.gradflow import Flow
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COLLECTIVES, REDUCTIONS, Op
from piper_nb.ir.text import wait_text
from piper_nb.plan.plan import Plan, columns_text

__all__ = ["dry_run", "p2p_key", "who_orders"]


def _moves_grads(ins) -> bool:
    """A collective the gradient flow follows: reductions, and a tensor-parallel sum of any
    kind (under sequence parallelism an all-gather of gradient slices)."""
    return ins.kind in REDUCTIONS or ins.sums_values


def p2p_key(dev: int, ins) -> tuple:
    """(sender, receiver, tag) of a SEND or RECV on device `dev`."""
    return (dev, ins.data.peer, ins.data.tag) if ins.kind == Op.SEND else (ins.data.peer, dev, ins.data.tag)


class _Lockstep:
    """The dry run's state: each device's next instruction (`ptr`) and the rounds its
    instructions ran in, the point-to-point ops posted, and per group how many members
    issued each of its collectives."""

    def __init__(self, plan: Plan, flow: Flow | None, runs: list[bool] | None):
        n = plan.world
        self.flow = flow
        self.ptr = [0] * n
        self.rounds: list[list[int]] = [[] for _ in range(n)]
        self.posted: set[tuple] = set()
        self.coll_posted: dict[tuple, Counter] = defaultdict(Counter)
        self.coll_index: list[dict] = [defaultdict(int) for _ in range(n)]
        self.coll_seq: dict[tuple, int] = {}
        if runs is None:
            runs = flow.active if flow is not None else [True] * n
        # a device that does not run keeps its (lazily stamped) instructions unmade
        self.instrs = [dp.instrs if on else () for dp, on in zip(plan.devices, runs, strict=True)]
        self.runs = runs
        self.active = flow.active if flow is not None else [False] * n
        self.freed = flow.freed if flow is not None else {}
        self.members: dict[tuple, int] = {}   # group -> members that run
        # what `advance` reads, unpacked at once (it runs once per device and round)
        self.shared = (flow, self.ptr, self.rounds, self.posted, self.coll_posted,
                       self.coll_seq, self.need, self.freed)
        self.mine = list(zip(self.instrs, self.active, self.coll_index, strict=False))

    def need(self, group: tuple) -> int:
        """How many of the group's members run (a stamped replica does not)."""
        if group not in self.members:
            self.members[group] = sum(1 for m in group if self.runs[m])
        return self.members[group]

    def done(self) -> bool:
        return all(self.ptr[d] == len(self.instrs[d]) for d in range(len(self.ptr))
                   if self.runs[d])

    def advance(self, d: int, r: int) -> bool:
        """Run device d in round r until it blocks (or after one WAIT); True when it ran any."""
        flow, ptr, rounds, posted, coll_posted, coll_seq, need, freed = self.shared
        mine, on, index = self.mine[d]
        progress = False
        while ptr[d] < len(mine):
            i = ptr[d]
            ins = mine[i]
            kind = ins.kind
            if kind == Op.SEND or kind == Op.RECV:
                posted.add((kind, p2p_key(d, ins)))
                if on and ins.data.grad and kind == Op.SEND:
                    flow.send(d, ins)
            elif kind in COLLECTIVES:
                if (d, i) not in coll_seq:
                    k = index[ins.data.group]
                    index[ins.data.group] = k + 1
                    coll_posted[ins.data.group][k] += 1
                    coll_seq[(d, i)] = k
                if ins.is_counted_dispatch and \
                        coll_posted[ins.data.group][coll_seq[(d, i)]] < need(ins.data.group):
                    break
                if on and _moves_grads(ins):
                    flow.issued(d, i, ins)
            elif kind == Op.WAIT:
                t = mine[ins.data.target]
                if t.kind == Op.SEND or t.kind == Op.RECV:
                    other = Op.RECV if t.kind == Op.SEND else Op.SEND
                    if (other, p2p_key(d, t)) not in posted:
                        break
                    if on and t.data.grad and t.kind == Op.RECV:
                        flow.received(d, t)
                else:
                    if coll_posted[t.data.group][coll_seq[(d, ins.data.target)]] < need(t.data.group):
                        break
                    if on and _moves_grads(t):
                        flow.completed(d, ins.data.target, t)
            elif on:
                if kind == Op.B or kind == Op.BI:
                    flow.backward(d, ins)
                elif kind == Op.FREE:
                    keys = freed.get(ins.data.keys)
                    if keys is None:
                        keys = flow.frees_grads(ins)
                    if keys:
                        flow.free(d, keys)
                elif kind == Op.BW:
                    flow.weights(d, ins)
                elif kind == Op.U:
                    flow.update(d, ins)
            rounds[d].append(r)
            ptr[d] = i + 1
            progress = True
            if kind == Op.WAIT:
                break  # one blocking step per round keeps the grid readable
        return progress


def dry_run(plan: Plan, flow: Flow | None = None, runs: list[bool] | None = None
            ) -> list[list[int]]:
    """Run all devices in lockstep; returns per device the round each instruction ran in.

    A `flow` (the gradient check, `gradflow.Flow`) is shown, as they run, the instructions
    that move gradients: backwards and updates, gradient sends, reductions and exchanges,
    the WAITs that complete them and the FREEs of gradient buffers. Only the devices in
    `runs` (default: the flow's `active` ones, else all) run: a replica stamped from a
    template (`Plan.stamps`) does what its template does, so a collective waits for its
    running members only."""
    run = _Lockstep(plan, flow, runs)
    ptr, instrs, advance = run.ptr, run.instrs, run.advance
    going = [d for d in range(plan.world) if run.runs[d]]
    r = 0
    while True:
        progress = False
        for d in going:
            if ptr[d] < len(instrs[d]) and advance(d, r):
                progress = True
        if run.done():
            return run.rounds
        if not progress:
            raise PlanError("deadlock: no device can make progress; " + who_orders(plan)
                            + _segment_note(plan, run.ptr) + "\n" + _stuck_grid(plan, run.ptr))
        r += 1


def who_orders(plan: Plan, what: str = "the marked passes",
               unordered: str = "they wait for each other (no order directive orders them)"
               ) -> str:
    """Who put `what` in an order their peers cannot meet, in the user's terms: the schedule
    builder or grid they used (the `schedule` an order remembers), else their order
    directives by index, and what to change."""
    labels, hand = [], []
    for i, d in plan.program or ():
        if getattr(d, "op", "") != "order":
            continue
        if d.schedule and d.schedule not in labels:
            labels.append(d.schedule)
        elif not d.schedule and i not in hand:
            hand.append(i)
    parts = []
    if labels and all("from_grid" in x for x in labels):
        parts.append(f"{labels[0]} orders {what} so that their peers cannot meet them: "
                     "reorder them in the grid's rows")
    elif labels:
        parts.append(f"{' and '.join(labels)} orders {what} in a way their peers cannot "
                     "meet with the stages placed as they are: place each stage where the "
                     "schedule runs it (its place=True does), or write the order as a grid "
                     "(pn.schedules.from_grid) and fix it there")
    if hand:
        nums = ", ".join(f"#{i}" for i in hand)
        parts.append(f"the order directive{'s' * (len(hand) > 1)} {nums} put {what} in an "
                     "order their peers cannot meet: reorder those passes on the marked "
                     "devices")
    if not parts:
        return unordered
    return "; ".join(parts)


def _segment_note(plan: Plan, ptr: list[int]) -> str:
    """In the model's terms, when a stuck pass belongs to a stage that comes back later in
    the model (a module called again after another stage: a SEG region)."""
    seen = []
    for dp in plan.devices:
        if ptr[dp.device] < len(dp.instrs):
            ins = dp.instrs[ptr[dp.device]]
            if ins.kind == Op.WAIT:
                ins = dp.instrs[ins.data.target]
            if 0 <= ins.region < len(plan.regions) and "SEG" in dict(plan.regions[ins.region].tags):
                info = plan.regions[ins.region]
                if info not in seen:
                    seen.append(info)
    if not seen:
        return ""
    parts = [f"{{{r.name}}} runs {', '.join(r.modules) or 'operations'} of stage "
             f"{{{r.name.split(',SEG')[0]}}} again, after other stages" for r in seen]
    return ("; " + "; ".join(parts) + ": a schedule orders each stage's passes once per "
            "microbatch, and this model goes through that stage twice. Name the later pass in "
            "the order with its SEG tag, give the repeated call its own stage (pn.region, or a "
            "tag on the caller), or use a schedule that runs each stage's forwards before its "
            "backwards (gpipe)")


def _stuck_grid(plan: Plan, ptr: list[int], context: int = 8) -> str:
    cols, mark = [], {}
    for dp in plan.devices:
        lo = max(0, ptr[dp.device] - context)
        rows = [f"dev{dp.device}"]
        for i in range(lo, min(len(dp.instrs), ptr[dp.device] + 3)):
            ins = dp.instrs[i]
            label = wait_text(dp.instrs[ins.data.target]) if ins.kind == Op.WAIT else str(ins)
            if i == ptr[dp.device]:
                mark[dp.device] = len(rows)
            rows.append(label)
        if ptr[dp.device] >= len(dp.instrs):
            rows.append("(done)")
        cols.append(rows)
    return columns_text(cols, mark) + "\n(>x< marks where each device is stuck)"
