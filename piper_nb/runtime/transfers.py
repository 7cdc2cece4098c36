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

from piper_nb.ir.kinds import Op, Purpose
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
        if ins.kind == Op.ALL_REDUCE and ins.purpose == Purpose.TP:   # one flat copy
            table = self.values.grads if ins.data.grad else self.values.acts
            t = comm.all_reduce(torch.cat([table[(v, ins.mb)].detach().reshape(-1)
                                           for v in ins.data.values]), key)
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

    def _summed(self, src, flat: torch.Tensor) -> None:
        """A tensor-parallel all-reduce's WAIT: each value becomes the group's sum, written
        over this device's share in place (the producing pass's stash holds that tensor:
        one buffer either way; autograd saved none of them, a rowwise layer's output)."""
        table = self.values.grads if src.data.grad else self.values.acts
        at = 0
        for v in src.data.values:
            old = table[(v, src.mb)]
            old.detach().copy_(flat[at:at + old.numel()].view(old.shape))
            at += old.numel()

    def _to_reduce(self, b: int) -> torch.Tensor:
        """Bucket b's gradients as one flat buffer in the plan's reduction dtype."""
        flat = self.store.flat_grads(b)
        want = self.plan.reduce_dtype
        return flat if want is None else flat.to(getattr(torch, want))   # no copy if same
