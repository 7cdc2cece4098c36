"""Widen a lowered plan over its tensor-parallel groups: every member of a group runs the
instructions of the group's first device, with its own peers and its own buckets.

The passes place and schedule on the first device of each group (`tensor_parallel`'s
rule); here member `k` of the group led by device `l` gets `l`'s list with every other
device `d` it talks to replaced by member `k` of `d`'s group (so stage 0's member 1 sends to
stage 1's member 1, and data-parallel replicas reduce among the members of one rank), each
bucket by that rank's copy of it, and each tensor-parallel all-reduce over the group
itself. Devices that exchange data must lead groups of one size. The lists are stamped out
when first read (`StampedDevicePlan`), so a 512-device plan holds one per class.
"""

from __future__ import annotations

import dataclasses

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op, Purpose
from piper_nb.plan.instr import Instr
from piper_nb.plan.plan import DevicePlan, Plan, StampedDevicePlan

__all__ = ["widen", "widen_plan", "tp_rank_of"]


def tp_rank_of(groups: dict[int, tuple[int, ...]]) -> dict[int, tuple[int, int]]:
    """Device -> (its group's first device, its rank in the group), for grouped devices."""
    return {m: (g[0], k) for g in groups.values() for k, m in enumerate(g)}


class _Mapper:
    def __init__(self, groups: dict[int, tuple[int, ...]], bmap):
        self.groups, self.bmap = groups, bmap
        self._mapped: dict[tuple, tuple[int, ...]] = {}

    def group(self, group: tuple[int, ...], k: int, who: int) -> tuple[int, ...]:
        key = (group, k)
        out = self._mapped.get(key)
        if out is None:
            out = self._mapped[key] = tuple(self.member(g, k, who) for g in group)
        return out

    def member(self, d: int, k: int, who: int) -> int:
        g = self.groups.get(d)
        if g is None:
            if k == 0:
                return d
            raise PlanError(f"device {who} is in a tensor-parallel group and exchanges data with "
                            f"device {d}, which leads none; give every stage the same "
                            "tensor-parallel degree")
        if k >= len(g):
            raise PlanError(f"tensor-parallel groups {list(self.groups[who])} and {list(g)} differ "
                            "in size, and data flows between them; give them one degree")
        return g[k]

    def instrs(self, leader: int, k: int, src: tuple[Instr, ...]) -> tuple[Instr, ...]:
        group = self.groups[leader]
        out = []
        for ins in src:
            if ins.kind in (Op.SEND, Op.RECV):
                ins = ins.with_data(peer=self.member(ins.data.peer, k, leader))
            elif ins.is_issue and ins.purpose == Purpose.TP:
                ins = ins.with_data(group=group)
            elif ins.is_issue:
                ins = ins.with_data(
                    group=self.group(ins.data.group, k, leader),
                    bucket=self.bmap[k].get(ins.data.bucket, ins.data.bucket),
                    owners=self.group(ins.data.owners, k, leader))
            elif ins.kind == Op.U and ins.data.buckets:
                ins = ins.with_data(buckets=tuple(self.bmap[k].get(b, b)
                                                  for b in ins.data.buckets))
            elif ins.kind == Op.FREE and any(key.startswith("param:") for key in ins.data.keys):
                ins = ins.with_data(keys=tuple(
                    f"param:{self.bmap[k].get(int(key[6:]), int(key[6:]))}"
                    if key.startswith("param:") else key for key in ins.data.keys))
            out.append(ins)
        return tuple(out)


def widen(devices: tuple[DevicePlan, ...], groups: dict[int, tuple[int, ...]], buckets: tuple,
          world: int) -> tuple[tuple[DevicePlan, ...], tuple]:
    """(every device's plan, the buckets with one copy per rank of each grouped bucket)."""
    if not groups:
        return devices, buckets
    degree = {len(g) for g in groups.values()}
    out_buckets = list(buckets)
    bmap: list[dict[int, int]] = [{} for _ in range(max(degree))]
    for b in buckets:
        sizes = {len(groups.get(d, (d,))) for d in b.group}
        if sizes == {1}:
            continue
        if len(sizes) > 1 or any(d not in groups for d in b.group):
            raise PlanError(f"bucket {b.index} is reduced over devices {list(b.group)}, whose "
                            "tensor-parallel groups differ in size; give the replicas one degree")
        for k in range(1, sizes.pop()):
            copy = dataclasses.replace(b, index=len(out_buckets),
                                       group=tuple(groups[d][k] for d in b.group))
            bmap[k][b.index] = copy.index
            out_buckets.append(copy)
    mapper = _Mapper(groups, bmap)
    plans = list(devices) + [DevicePlan(d, ()) for d in range(len(devices), world)]
    for leader, g in groups.items():
        for k, m in enumerate(g):
            if k and plans[m].instrs:
                raise PlanError(f"device {m} is a member of the tensor-parallel group "
                                f"{list(g)} but runs work of its own; place that work on "
                                f"device {leader}, which the group follows")
    # every member is stamped from its group's first device or, when that one is a
    # data-parallel replica, from the first device it was stamped from: the simulator and
    # the checks then run one device per class (`Plan.stamps`); a member's list is its
    # template's but for peers, groups and buckets, all of them a member's of the same rank
    template = _templates(devices)
    order = sorted(groups, key=lambda lead: (template.get(lead, lead) != lead, lead))
    for leader in order:
        t = template.get(leader, leader)
        for k, m in enumerate(groups[leader]):
            stamp = _Stamp(mapper, leader, k, devices[leader])
            if m == t:
                plans[m] = DevicePlan(m, stamp(m))
            else:
                plans[m] = StampedDevicePlan(m, plans[t].instrs, stamp)
    return tuple(plans), tuple(out_buckets)


def widen_plan(plan: Plan, groups: dict[int, tuple[int, ...]], layout) -> Plan:
    """The plan phase's step: `plan` widened over `groups` (first device -> group), with the
    groups and the sharded parameters of `layout` (`rewrite.TPLayout`) recorded."""
    if not groups:
        return plan
    devices, buckets = widen(plan.devices, groups, plan.buckets, plan.world)
    return dataclasses.replace(
        plan, devices=devices, buckets=buckets,
        tp_groups=tuple(groups[k] for k in sorted(groups)),
        tp_params=dict(layout.params) if layout is not None else {})


def _templates(devices) -> dict[int, int]:
    """Device -> the device the lowering stamped its list from (`Plan.stamps`' rule)."""
    made = {id(dp.instrs): dp.device for dp in devices if dp.stamp is None}
    return {dp.device: made[id(dp.stamp[0])] for dp in devices
            if dp.stamp is not None and id(dp.stamp[0]) in made}


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """Member `k`'s instructions, from its group's first device's (picklable)."""

    mapper: _Mapper
    leader: int
    k: int
    src: DevicePlan

    def __call__(self, _device: int) -> tuple[Instr, ...]:
        return self.mapper.instrs(self.leader, self.k, self.src.instrs)
