"""Expert parallelism in the worker: the ALL_TO_ALL instructions around the experts.

An ALL_TO_ALL moves token rows between the replicas of a group (`ins.group`) and the
devices holding the experts (`ins.owners`, one per value), as `directives.shard` lays out:

- dispatch (forward: expert inputs; `grad`: gradients of expert outputs): every replica
  sends its rows of value v to v's owner, which keeps their concatenation in group order;
- combine (forward: expert outputs; `grad`: gradients of expert inputs): the owner splits
  v into the replicas' pieces and every replica gets its own rows back.

Token counts vary per microbatch and replica. A forward dispatch first all-gathers each
member's row count of every value (small, blocking) and records them on every member under
`(value, mb)`; the other three kinds size their pieces from those records (`ins.split_by`
names the dispatched value whose counts apply), so they exchange data only. The data of all
the instruction's values travels as bytes in one asynchronous `all_to_all_single` (value
order inside each member's piece), so index (integer) values go the same way as floats;
shapes past the first dimension and dtypes come from `plan.values`.

At the WAIT the results replace what was sent: a dispatched value leaves every sender
(the owner then holds the concatenation, other members nothing: no FREE is planned for
it there), a combined value leaves its owner, which, like every replica, then holds its
own rows. Gradients are added (`ValueStore.add_grad`) after the sent full tensor is dropped;
a gradient a pass never produced travels as zeros.
"""

from __future__ import annotations

import math

import torch

from piper_nb.ir.kinds import Purpose

__all__ = ["TokenExchange"]

_BYTE = torch.uint8


class TokenExchange:
    """Issues and completes one worker's ALL_TO_ALL instructions; keeps the token counts."""

    def __init__(self, plan, comm, values, rank: int, device: torch.device):
        self.plan, self.comm, self.values = plan, comm, values
        self.rank, self.device = rank, device
        self.counts: dict[tuple[str, int], tuple[int, ...]] = {}  # (value, mb) -> per member

    def reset(self) -> None:
        """A new step: forget the token counts of the last one."""
        self.counts.clear()

    # ---- shapes ------------------------------------------------------------------------
    def _spec(self, v: str) -> tuple[torch.dtype, tuple[int, ...], int]:
        """(dtype, shape past dim 0, bytes per row) of value v."""
        info = self.plan.values[v]
        dtype = getattr(torch, info.dtype)
        rest = tuple(info.shape[1:])
        return dtype, rest, math.prod(rest) * torch.empty((), dtype=dtype).element_size()

    def _bytes(self, ins, v: str, t: torch.Tensor) -> torch.Tensor:
        dtype, rest, _ = self._spec(v)
        if tuple(t.shape[1:]) != rest:
            raise RuntimeError(f"{ins} on device {self.rank}: {v} has shape {tuple(t.shape)}, "
                               f"the plan expects rows of shape {rest}")
        return t.detach().to(dtype).contiguous().reshape(-1).view(_BYTE)

    def _rows(self, ins, k: int) -> tuple[int, ...]:
        key = (ins.data.split_by[k] if ins.data.split_by else ins.data.values[k], ins.mb)
        rows = self.counts.get(key)
        if rows is None:
            raise RuntimeError(f"{ins} on device {self.rank} needs the token counts of "
                               f"{key[0]}@{key[1]}, which no forward dispatch recorded here")
        return rows

    def _held(self, ins, v: str, rows: int | None) -> torch.Tensor:
        """The local tensor of v to send; a missing gradient is zeros of `rows` rows."""
        table = self.values.grads if ins.data.grad else self.values.acts
        t = table.get((v, ins.mb))
        if t is None:
            if not ins.data.grad or rows is None:
                raise RuntimeError(f"{ins} sends activation {v}@{ins.mb}, which device "
                                   f"{self.rank} does not hold")
            dtype, rest, _ = self._spec(v)
            return torch.zeros((rows, *rest), dtype=dtype, device=self.device)
        if rows is not None and t.shape[0] != rows:
            raise RuntimeError(f"{ins} on device {self.rank}: {v}@{ins.mb} has {t.shape[0]} "
                               f"rows, the forward dispatch recorded {rows}")
        return t

    # ---- issue and wait ----------------------------------------------------------------
    def _checked(self, ins) -> None:
        c = ins.data
        if c.purpose not in (Purpose.DISPATCH, Purpose.COMBINE) or len(c.owners) != len(c.values):
            raise RuntimeError(f"{ins} on device {self.rank}: an ALL_TO_ALL needs purpose "
                               f"dispatch or combine and one owner per value, got "
                               f"{ins.purpose!r} with owners {list(ins.data.owners)}")

    def count(self, ins) -> None:
        """A forward dispatch's host step (the stream program's `exchange`): all-gather each
        member's row count of every value and record them under (value, mb)."""
        self._checked(ins)
        local = [self._held(ins, v, None) for v in ins.data.values]
        per = self.comm.gather_counts([t.shape[0] for t in local], ins.data.group)
        for k, v in enumerate(ins.data.values):
            self.counts[(v, ins.mb)] = tuple(per[i][k] for i in range(len(ins.data.group)))

    def transfer(self, ins, comm: str) -> tuple:
        """The exchange, ready to start: (transfer, receive layout for `finish`)."""
        self._checked(ins)
        n, me = len(ins.data.group), ins.replica
        owner = [ins.data.group.index(o) for o in ins.data.owners]
        gather = ins.purpose == Purpose.DISPATCH
        send: list[list[torch.Tensor]] = [[] for _ in range(n)]
        recv: list[tuple[int, int, int]] = []   # (source member, value index, rows)
        for k, v in enumerate(ins.data.values):
            rows, o = self._rows(ins, k), owner[k]
            if gather:
                t = self._held(ins, v, None if not ins.data.grad else rows[me])
                send[o].append(self._bytes(ins, v, t))
                if me == o:
                    recv += [(i, k, rows[i]) for i in range(n)]
            else:
                if me == o:
                    t = self._held(ins, v, sum(rows))
                    for j, part in enumerate(t.split(list(rows))):
                        send[j].append(self._bytes(ins, v, part))
                recv.append((o, k, rows[me]))
        recv.sort()
        in_splits = [sum(b.numel() for b in pieces) for pieces in send]
        out_splits = [0] * n
        for i, k, r in recv:
            out_splits[i] += r * self._spec(ins.data.values[k])[2]
        flat = [b for pieces in send for b in pieces]
        flat = torch.cat(flat) if flat else torch.empty(0, dtype=_BYTE, device=self.device)
        return self.comm.all_to_all(flat, out_splits, in_splits, comm), recv

    def finish(self, ins, out: torch.Tensor, recv: list[tuple[int, int, int]]) -> None:
        """The exchange is complete: drop what was sent, store what came (acts or grads)."""
        out = out.to(self.device)
        got: dict[int, list[torch.Tensor]] = {}
        total: dict[int, int] = {}
        offset = 0
        for _, k, rows in recv:
            size = rows * self._spec(ins.data.values[k])[2]
            got.setdefault(k, []).append(out[offset:offset + size])
            total[k] = total.get(k, 0) + rows
            offset += size
        table = self.values.grads if ins.data.grad else self.values.acts
        me = ins.replica
        for k, v in enumerate(ins.data.values):
            if ins.purpose == Purpose.DISPATCH or ins.data.group.index(ins.data.owners[k]) == me:
                table.pop((v, ins.mb), None)
            if k not in got:
                continue
            dtype, rest, _ = self._spec(v)
            t = torch.cat(got[k]).view(dtype).view(total[k], *rest)  # a copy: aligned, owned
            if ins.data.grad:
                self.values.add_grad(v, ins.mb, t)
            else:
                table[(v, ins.mb)] = t
