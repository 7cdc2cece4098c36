"""A worker's communication instructions made ready on the host (`Transfers`, a part of
`worker.Worker`): what each SEND, RECV and collective moves, as a `comm.Transfer` on its
communicator, and what its buffers count as in memory. Where and when a transfer starts
is the stream program's business (`runtime.streams`); this only fills it.

A SEND hands on each value as the plan has it: the shape and dtype `plan.values` records,
on the worker's device (a region's outputs are moved there as they are made,
`compute.on_device`), and any difference is an error naming the instruction.
"""

from __future__ import annotations

import torch

from piper_nb.capture.sequence_ops import member_slice
from piper_nb.ir.kinds import Op
from piper_nb.plan.instr import slice_name
from piper_nb.plan.streams import communicator
from piper_nb.trace import Memory

__all__ = ["Transfers"]


class Transfers:
    """The transfers of a `Worker`, which holds what they read: `plan`, `rank`, `device`,
    `comm`, `store`, `values`, `layouts`, `updater`, `exchange` and `recv_specs`."""

    def _transfer(self, ins, idx: int):
        """(transfer, memory kind, buffers it allocates, what its WAIT needs)."""
        comm, store, key = self.comm, self.store, communicator(self.rank, ins)
        if ins.kind == Op.SEND:
            return (comm.send(self._sent(ins), ins.data.peer, ins.data.tag, key), Memory.BUFFERS, [], None)
        if ins.kind == Op.RECV:   # received act:/grad: buffers, as the simulator counts them
            t = comm.recv(self.recv_specs[idx], ins.data.peer, ins.data.tag, key)
            return t, Memory.ACTIVATIONS, t.bufs, None
        if ins.sums_values:   # one flat copy, and what comes back
            t = self._tp_sum(ins, key)
            return t, Memory.BUFFERS, t.bufs, None
        if ins.kind == Op.ALL_REDUCE:
            flat = (self.updater.norm_share() if ins.is_norm else self.count_share()
                    if ins.is_count else self._to_reduce(ins.data.bucket))
            t = comm.all_reduce(flat, key)
            return t, Memory.BUFFERS, t.bufs, None
        if ins.kind == Op.REDUCE_SCATTER:
            t = comm.reduce_scatter(self._to_reduce(ins.data.bucket), len(ins.data.group), key)
            store.clear_grads(ins.data.bucket)
            return t, Memory.BUFFERS, t.bufs, None
        if ins.kind == Op.ALL_GATHER:
            t = comm.all_gather(store.shards[ins.data.bucket], len(ins.data.group), key)
            zero3 = self.layouts[ins.data.bucket].zero == 3  # a gathered bucket counts as parameters
            return t, (Memory.PARAMS if zero3 else Memory.BUFFERS), t.bufs[:1], None
        if ins.kind == Op.ALL_TO_ALL:   # packed tokens in flight, as the simulator counts them
            t, meta = self.exchange.transfer(ins, key)
            return t, Memory.BUFFERS, t.bufs, meta
        raise NotImplementedError(f"{ins.kind} ({ins}) is not supported by the runtime yet")

    def _sent(self, ins) -> list[torch.Tensor]:
        """What a SEND sends: each value as the plan has it (shape, dtype), on the device."""
        table = self.values.grads if ins.data.grad else self.values.acts
        out = []
        for v in ins.data.values:
            t = table.get((v, ins.mb))
            if t is None:
                what = "gradient" if ins.data.grad else "activation"
                raise RuntimeError(f"{ins} sends {what} {v}@{ins.mb}, which device "
                                   f"{self.rank} does not hold")
            info = self.plan.values.get(v)
            if info is not None and v not in self.plan.rows and (tuple(t.shape) != tuple(info.shape)
                                     or str(t.dtype).removeprefix("torch.") != info.dtype):
                raise RuntimeError(f"{ins} on device {self.rank}: {v}@{ins.mb} is "
                                   f"{tuple(t.shape)} {t.dtype}, the plan sends "
                                   f"{tuple(info.shape)} {info.dtype}")
            if t.device != self.device and not self.comm.stage:
                raise RuntimeError(f"{ins} on device {self.rank}: {v}@{ins.mb} is on "
                                   f"{t.device}, not on the device {self.device}")
            out.append(t)
        return out

    def _tp_sum(self, ins, key: str):
        """A tensor-parallel sum's transfer: an all-reduce of the values flat; under sequence
        parallelism an all-gather of this member's slices of them (`SEQ_DIM`; of the slices
        a forward kept, for a regather), or a reduce-scatter of their slices in member
        order."""
        table = self.values.grads if ins.data.grad else self.values.acts
        n = len(ins.data.group)
        if ins.is_regather:   # the slices a forward kept, gathered whole again
            xs = [table[(slice_name(v), ins.mb)] for v in ins.data.values]
            return self.comm.all_gather(torch.cat([x.reshape(-1) for x in xs]), n, key)
        xs = [table[(v, ins.mb)].detach() for v in ins.data.values]
        if ins.kind == Op.ALL_REDUCE:
            return self.comm.all_reduce(torch.cat([x.reshape(-1) for x in xs]), key)
        if ins.kind == Op.ALL_GATHER:
            i = ins.data.group.index(self.rank)
            return self.comm.all_gather(torch.cat([member_slice(x, i, n).reshape(-1) for x in xs]),
                                        n, key)
        return self.comm.reduce_scatter(torch.cat([member_slice(x, j, n).reshape(-1)
                                                   for j in range(n) for x in xs]), n, key)

    def _summed(self, src, flat: torch.Tensor) -> None:
        """A tensor-parallel sum's WAIT: each value becomes the group's sum, written over
        this device's share in place (the producing pass's stash holds that tensor: one
        buffer either way; autograd saved none of them, a rowwise layer's output). An
        all-gather fills every member's slice; a reduce-scatter this member's, the rest
        zeros (what reads it reads that slice only). A regather fills a new buffer."""
        table = self.values.grads if src.data.grad else self.values.acts
        if src.is_regather:   # a new whole buffer per value (the slices may be gone)
            for v in src.data.values:
                table[(v, src.mb)] = flat.new_empty(self.plan.values[v].shape)
        olds = [table[(v, src.mb)].detach() for v in src.data.values]
        n, at = len(src.data.group), 0
        if src.kind == Op.ALL_REDUCE:
            for old in olds:
                old.copy_(flat[at:at + old.numel()].view(old.shape))
                at += old.numel()
            return
        mine = src.data.group.index(self.rank)
        for j in range(n) if src.kind == Op.ALL_GATHER else (mine,):
            for old in olds:
                if src.kind == Op.REDUCE_SCATTER:
                    old.zero_()
                part = member_slice(old, j, n)
                part.copy_(flat[at:at + part.numel()].view(part.shape))
                at += part.numel()

    def _to_reduce(self, b: int) -> torch.Tensor:
        """Bucket b's gradients as one flat buffer in the plan's reduction dtype."""
        flat = self.store.flat_grads(b)
        want = self.plan.reduce_dtype
        return flat if want is None else flat.to(getattr(torch, want))   # no copy if same
