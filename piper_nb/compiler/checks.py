"""Static checks of a Plan, run before anything starts.

- every SEND has its RECV (same peers and tag) and the reverse;
- the members of each group issue their collectives in the same order;
- every backward sees each gradient contribution once, and every update a complete
  gradient (`gradflow`, replayed in the dry run's order);
- NCCL can run it (`nccl`): per communicator stream, messages meet in order, and no
  receive at a stream's head blocks what the peer needs first;
- no deadlock: a lockstep dry run of all devices, where an issue never blocks (except a
  forward expert dispatch, which first exchanges token counts with its group), a WAIT on
  a point-to-point op needs the peer's matching issue, and a WAIT on a collective needs
  every member's. When it gets stuck, the device-by-step grid is printed with the stuck
  instruction of each device marked.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from piper_nb.compiler.gradflow import Asymmetric, Flow
from piper_nb.compiler.nccl import check_nccl
from piper_nb.compiler.plan import Plan, _columns
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COLLECTIVES as COLLECTIVE_KINDS
from piper_nb.ir.kinds import REDUCTIONS as _REDUCTIONS

__all__ = ["check_plan", "dry_run"]


def _p2p_key(dev: int, ins) -> tuple:
    return (dev, ins.peer, ins.tag) if ins.kind == "SEND" else (ins.peer, dev, ins.tag)


def check_matching(plan: Plan) -> None:
    sends, recvs = Counter(), Counter()
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == "SEND":
                sends[_p2p_key(dp.device, ins)] += 1
            elif ins.kind == "RECV":
                recvs[_p2p_key(dp.device, ins)] += 1
            if ins.kind in ("SEND", "RECV") and not 0 <= ins.peer < plan.world:
                raise PlanError(f"device {dp.device}: {ins} names device {ins.peer} outside the "
                                f"world of {plan.world}")
    for key in (sends - recvs):
        raise PlanError(f"device {key[0]} sends to device {key[1]} (tag {key[2]}) but device "
                        f"{key[1]} never receives it")
    for key in (recvs - sends):
        raise PlanError(f"device {key[1]} waits for a message from device {key[0]} (tag {key[2]}) "
                        "that is never sent")


def _collectives(plan: Plan) -> dict[tuple, dict[int, list]]:
    seqs: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind in COLLECTIVE_KINDS:
                seqs[ins.group][dp.device].append(ins)
    return seqs


def check_collective_order(plan: Plan) -> None:
    for group, per_dev in _collectives(plan).items():
        ref_dev = group[0]
        ref = per_dev.get(ref_dev, [])
        for dev in group:
            mine = per_dev.get(dev, [])
            for k in range(max(len(ref), len(mine))):
                a = ref[k] if k < len(ref) else None
                b = mine[k] if k < len(mine) else None
                sig = lambda x: None if x is None else (x.kind, x.bucket, x.mb, x.purpose, x.node)
                if sig(a) != sig(b):
                    raise PlanError(
                        f"devices {ref_dev} and {dev} of group {list(group)} issue their "
                        f"collective #{k} differently: {a.node if a else 'nothing'} vs "
                        f"{b.node if b else 'nothing'}; every member must issue the same "
                        "collectives in the same order (check the order directives of these "
                        "devices)")


def _blocks_at_issue(ins) -> bool:
    """A forward expert dispatch first exchanges token counts, synchronously."""
    return ins.kind == "ALL_TO_ALL" and ins.purpose == "dispatch" and not ins.grad




def dry_run(plan: Plan, flow: Flow | None = None, runs: list[bool] | None = None
            ) -> list[list[int]]:
    """Run all devices in lockstep; returns per device the round each instruction ran in.

    A `flow` (the gradient check, `gradflow.Flow`) is shown, as they run, the instructions
    that move gradients: backwards and updates, gradient sends, reductions and exchanges,
    the WAITs that complete them and the FREEs of gradient buffers. Only the devices in
    `runs` (default: the flow's `active` ones, else all) run: a replica stamped from a
    template (`Plan.stamps`) does what its template does, so a collective waits for its
    running members only."""
    n = plan.world
    ptr = [0] * n
    rounds: list[list[int]] = [[] for _ in range(n)]
    posted: set[tuple] = set()
    coll_posted: dict[tuple, Counter] = defaultdict(Counter)
    coll_index: list[dict] = [defaultdict(int) for _ in range(n)]
    coll_seq: dict[tuple, int] = {}
    instrs = [dp.instrs for dp in plan.devices]
    if runs is None:
        runs = flow.active if flow is not None else [True] * n
    active = flow.active if flow is not None else [False] * n
    freed = flow.freed if flow is not None else {}
    members: dict[tuple, int] = {}   # group -> members that run

    def need(group: tuple) -> int:
        if group not in members:
            members[group] = sum(1 for m in group if runs[m])
        return members[group]
    r = 0
    while True:
        progress = False
        for d in range(n):
            if not runs[d]:
                continue
            mine, on = instrs[d], active[d]
            while ptr[d] < len(mine):
                i = ptr[d]
                ins = mine[i]
                kind = ins.kind
                if kind == "SEND" or kind == "RECV":
                    posted.add((kind, _p2p_key(d, ins)))
                    if on and ins.grad and kind == "SEND":
                        flow.send(d, ins)
                elif kind in COLLECTIVE_KINDS:
                    if (d, i) not in coll_seq:
                        k = coll_index[d][ins.group]
                        coll_index[d][ins.group] = k + 1
                        coll_posted[ins.group][k] += 1
                        coll_seq[(d, i)] = k
                    if _blocks_at_issue(ins) and \
                            coll_posted[ins.group][coll_seq[(d, i)]] < need(ins.group):
                        break
                    if on and kind in _REDUCTIONS:
                        flow.issued(d, i, ins)
                elif kind == "WAIT":
                    t = mine[ins.target]
                    if t.kind == "SEND" or t.kind == "RECV":
                        other = "RECV" if t.kind == "SEND" else "SEND"
                        if (other, _p2p_key(d, t)) not in posted:
                            break
                        if on and t.grad and t.kind == "RECV":
                            flow.received(d, t)
                    else:
                        if coll_posted[t.group][coll_seq[(d, ins.target)]] < need(t.group):
                            break
                        if on and t.kind in _REDUCTIONS:
                            flow.completed(d, ins.target, t)
                elif on:
                    if kind == "B" or kind == "BI":
                        flow.backward(d, ins)
                    elif kind == "FREE":
                        keys = freed.get(ins.keys)
                        if keys is None:
                            keys = flow.frees_grads(ins)
                        if keys:
                            flow.free(d, keys)
                    elif kind == "BW":
                        flow.weights(d, ins)
                    elif kind == "U":
                        flow.update(d, ins)
                rounds[d].append(r)
                ptr[d] = i + 1
                progress = True
                if kind == "WAIT":
                    break  # one blocking step per round keeps the grid readable
        if all(ptr[d] == len(instrs[d]) for d in range(n) if runs[d]):
            return rounds
        if not progress:
            raise PlanError("deadlock: no device can make progress; the order of the marked "
                            "passes cannot be met by their peers (check those devices' order "
                            "directives)" + _segment_note(plan, ptr) + "\n"
                            + _stuck_grid(plan, ptr))
        r += 1


def _segment_note(plan: Plan, ptr: list[int]) -> str:
    """In the model's terms, when a stuck pass belongs to a stage that comes back later in
    the model (a module called again after another stage: a SEG region)."""
    seen = []
    for dp in plan.devices:
        if ptr[dp.device] < len(dp.instrs):
            ins = dp.instrs[ptr[dp.device]]
            if ins.kind == "WAIT":
                ins = dp.instrs[ins.target]
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
            label = f"wait({dp.instrs[ins.target]})" if ins.kind == "WAIT" else str(ins)
            if i == ptr[dp.device]:
                mark[dp.device] = len(rows)
            rows.append(label)
        if ptr[dp.device] >= len(dp.instrs):
            rows.append("(done)")
        cols.append(rows)
    return _columns(cols, mark) + "\n(>x< marks where each device is stuck)"


def check_plan(plan: Plan) -> None:
    check_matching(plan)
    check_collective_order(plan)
    if not plan.regions:
        dry_run(plan)
    else:
        try:
            dry_run(plan, Flow(plan))
        except Asymmetric:  # replicas whose gradients differ in more than the replica index
            dry_run(plan, Flow(plan, replicas=False))
    check_nccl(plan)
