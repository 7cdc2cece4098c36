"""Static checks of a Plan, run before anything starts.

- every SEND has its RECV (same peers and tag) and the reverse;
- the members of each group issue their collectives in the same order;
- every backward sees each gradient contribution once, and every update a complete
  gradient (`gradflow`, replayed in the dry run's order);
- NCCL can run it (`nccl`): per communicator stream, messages meet in order, and no
  receive at a stream's head blocks what the peer needs first;
- no deadlock (`dryrun`): a lockstep dry run of all devices, where an issue never blocks
  (except a forward expert dispatch, which first exchanges token counts with its group), a
  WAIT on a point-to-point op needs the peer's matching issue, and a WAIT on a collective
  needs every member's. When it gets stuck, the device-by-step grid is printed with the
  stuck instruction of each device marked.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from piper_nb.compiler.dryrun import dry_run, p2p_key, who_orders
from piper_nb.compiler.gradflow import Asymmetric, Flow
from piper_nb.compiler.nccl import check_nccl
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COLLECTIVES, P2P, Op
from piper_nb.plan.plan import Plan

__all__ = ["check_plan", "dry_run"]


def _checked(plan: Plan, on: list[bool] | None = None) -> list:
    """The devices the checks read (`Plan.replayed`). A replica stamped from a template
    sends, receives and issues what its template does, with the peers and tags of its own
    position in the same nodes' device lists, so its messages meet its peers' at that
    position and its collectives come in its template's order, the template being a member
    of each of its groups: checking the replayed devices checks them all."""
    on = plan.replayed() if on is None else on
    return [dp for dp in plan.devices if on[dp.device]]


def check_matching(plan: Plan) -> None:
    sends, recvs = Counter(), Counter()
    for dp in _checked(plan):
        for ins in dp.instrs:
            if ins.kind == Op.SEND:
                sends[p2p_key(dp.device, ins)] += 1
            elif ins.kind == Op.RECV:
                recvs[p2p_key(dp.device, ins)] += 1
            if ins.kind in P2P and not 0 <= ins.data.peer < plan.world:
                raise PlanError(f"device {dp.device}: {ins} names device {ins.data.peer} outside the "
                                f"world of {plan.world}")
    for key in (sends - recvs):
        raise PlanError(f"device {key[0]} sends to device {key[1]} (tag {key[2]}) but device "
                        f"{key[1]} never receives it")
    for key in (recvs - sends):
        raise PlanError(f"device {key[1]} waits for a message from device {key[0]} (tag {key[2]}) "
                        "that is never sent")


def _collectives(plan: Plan, on: list[bool]) -> dict[tuple, dict[int, list]]:
    seqs: dict[tuple, dict[int, list]] = defaultdict(lambda: defaultdict(list))
    for dp in _checked(plan, on):
        for ins in dp.instrs:
            if ins.kind in COLLECTIVES:
                seqs[ins.data.group][dp.device].append(ins)
    return seqs


def check_collective_order(plan: Plan) -> None:
    on = plan.replayed()
    for group, per_dev in _collectives(plan, on).items():
        members = [d for d in group if on[d]]
        ref_dev = members[0]
        ref = per_dev.get(ref_dev, [])
        for dev in members:
            mine = per_dev.get(dev, [])
            for k in range(max(len(ref), len(mine))):
                a = ref[k] if k < len(ref) else None
                b = mine[k] if k < len(mine) else None
                sig = lambda x: None if x is None else (x.kind, x.bucket, x.mb, x.purpose, x.node)
                if sig(a) != sig(b):
                    raise PlanError(
                        f"devices {ref_dev} and {dev} of group {list(group)} issue their "
                        f"collective #{k} differently: {a if a else 'nothing'} vs "
                        f"{b if b else 'nothing'}; every member must issue the same "
                        "collectives in the same order: "
                        + who_orders(plan, "the passes before them",
                                     "give the members of the group the same order"))


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
