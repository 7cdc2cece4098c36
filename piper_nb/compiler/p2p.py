"""Receives in the order their sender sends: what makes a plan's point-to-point NCCL-safe.

NCCL matches a pair's messages by order, not tag: the k-th send from a to b meets the k-th
receive b posts from a. The runtime gives each direction of a pair its own communicator
(`runtime.comm`), so a direction's stream carries only those sends on one side and those
receives on the other; what is left is to post the receives in the sender's order. The
lowering posts a receive one compute step before its consumer, and consumers need not come
in the order their producers send (DualPipeV's rank 1 wants gradient B0 before activation
F6, which rank 0 sends first). So this pass moves each receive up to its place in the
sender's order: a receive is posted no later than it was, and together with every receive
from the same peer that the peer sends before it. Posting never blocks the host, so this
only holds some receive buffers a little longer (the memory model sees the same
instructions). Checked by `nccl.check_nccl`.
"""

from __future__ import annotations

from collections import defaultdict

from piper_nb.ir.kinds import Op
from piper_nb.plan.instr import Instr

__all__ = ["in_send_order"]


def in_send_order(programs: dict[int, tuple[Instr, ...]], partner: dict,
                  program_of: dict[int, int] | None = None) -> dict[int, tuple[Instr, ...]]:
    """`programs` (device -> instructions) with every device's receives from each peer
    reordered to that peer's send order; `partner` maps a RECV node to its SEND node;
    `program_of` maps a device to the one whose program it runs (a replica stamped from a
    template sends in its template's order), by default itself."""
    sent_at = {(d, ins.node): i for d, instrs in programs.items()
               for i, ins in enumerate(instrs) if ins.kind == Op.SEND}
    program_of = program_of or {}
    return {d: _reordered(instrs, sent_at, partner, program_of)
            for d, instrs in programs.items()}


def _reordered(instrs: tuple[Instr, ...], sent_at: dict, partner: dict, program_of: dict
               ) -> tuple[Instr, ...]:
    by_peer: dict[int, list[tuple[int, int]]] = defaultdict(list)   # peer -> (send pos, i)
    for i, ins in enumerate(instrs):
        if ins.kind == Op.RECV:
            sender = program_of.get(ins.data.peer, ins.data.peer)
            by_peer[ins.data.peer].append((sent_at[(sender, partner[ins.node].id)], i))
    if all(lst == sorted(lst) for lst in by_peer.values()):
        return instrs
    for lst in by_peer.values():
        lst.sort()
    nxt = dict.fromkeys(by_peer, 0)
    out: list[Instr] = []
    where: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        if ins.kind == Op.RECV:
            if i in where:
                continue
            lst = by_peer[ins.data.peer]
            while True:   # every receive the peer sends before this one, then this one
                j = lst[nxt[ins.data.peer]][1]
                nxt[ins.data.peer] += 1
                where[j] = len(out)
                out.append(instrs[j])
                if j == i:
                    break
        else:
            where[i] = len(out)
            out.append(ins)
    return tuple(x.with_data(target=where[x.data.target]) if x.kind == Op.WAIT else x
                 for x in out)
