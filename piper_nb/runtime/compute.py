"""A worker's compute instructions: F, B, BI, BW and U (`ComputePasses`, a part of
`worker.Worker`).

F runs a region's GraphModule on detached input leaves (the batch's slice for this
microbatch and replica, or the activations received) and stashes the autograd state; B
runs autograd from the stashed outputs with the received output gradients (the loss's
gradient is `plan.loss_scale`) and hands input gradients upstream; BI computes the input
gradients only and keeps the graph for BW, which then computes the parameters'. U applies
the optimizer to full parameters and to this device's bucket shards. A recomputed region
(`Instr.recompute`, `pn.recompute`) runs its F under `torch.no_grad()` and stashes its
inputs; its B or BI first runs the forward again, seeded as F was, with autograd.
"""

from __future__ import annotations

import torch

from piper_nb.ir.kinds import Op
from piper_nb.ir.loss_outputs import LOSS, is_loss_output
from piper_nb.plan.sizes import SavedBytes
from piper_nb.runtime.layout import batch_part
from piper_nb.runtime.stores import Stash

__all__ = ["ComputePasses", "on_device"]


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: region outputs made on the host (sizes, `capture.split.pack_size`)
    are moved, so that everything a SEND hands NCCL is a device tensor."""
    return t.to(device)   # the same tensor when it is there already



class ComputePasses:
    """The compute instructions of a `Worker`, which holds what they use: `plan`, `rank`,
    `device`, `modules` (region -> module), `store` (parameters), `values` (activations,
    gradients, stashes), `needs` (region -> ZeRO-3 buckets), `updater`, `rng`, `seed`,
    `step_no`, `tracing`, and per step `batch`, `parts`, `losses` and `ends` (the count and
    metrics each forward of the loss region returned, by name)."""

    def run(self, ins) -> None:
        """Run one compute instruction (F, B, BI, BW or U) as the step loop does."""
        if ins.kind != Op.U:
            missing = [b for b in self.needs[ins.region] if not self.store.gathered(b)]
            if missing:
                raise RuntimeError(f"{ins} on device {self.rank} needs the parameters of ZeRO-3 "
                                   f"bucket {missing[0]}, which are not gathered: the plan has "
                                   "no ALL_GATHER (or frees it too early) before this pass")
        if ins.kind == Op.F:
            self._forward(ins)
        elif ins.kind == Op.U:
            if self.updater is None:
                raise RuntimeError("no optimizer: reset the worker before stepping")
            self.updater.update(ins.data.params, ins.data.buckets)
        else:
            self._backward(ins)

    def _forward(self, ins) -> None:
        plan, info, mb = self.plan, self.plan.regions[ins.region], ins.mb
        args, leaves = [], []
        for v in info.inputs:
            if v in self.batch:
                t = self._batch_part(v, mb, ins.replica, ins.replicas)
            else:
                t = self.values.acts.get((v, mb))
                if t is None:
                    raise RuntimeError(f"input {v}@{mb} of region {ins.region} is not on device "
                                       f"{self.rank}: no RECV or forward produced it before {ins}")
                vi = plan.values.get(v)
                if t.is_floating_point() and (vi is None or vi.requires_grad):
                    t = t.detach().requires_grad_(True)
                    leaves.append((v, t))
            args.append(t)
        start = self.rng.start(self.seed, self.step_no, ins)
        if ins.data.recompute:   # keep the inputs only: the backward runs this forward again
            with torch.no_grad():
                outputs, _ = self._run_region(ins, args, count=False)
        else:
            outputs, saved = self._run_region(ins, args, count=self.tracing)
        self.rng.end(self.step_no, ins)
        for name, out in outputs.items():
            if name == LOSS:
                self.losses.append(out.detach())
            elif is_loss_output(name):   # the count, a metric: reported, not sent
                self.ends.setdefault(name, []).append(out.detach())
            else:   # a size crossing regions is made on the host (`pack_size`): move it
                self.values.acts[(name, mb)] = on_device(out, self.device)
        if ins.data.recompute:
            self.values.stash[(ins.region, mb)] = Stash(leaves, outputs, 0, args=args,
                                                        rng=start)
        else:
            self.values.stash[(ins.region, mb)] = Stash(leaves, outputs, saved)

    def _run_region(self, ins, args: list, count: bool) -> tuple[dict, int]:
        """Run the region on `args` (its random state set by the caller): its outputs by
        name and (`count`) the bytes autograd saved, parameters and inputs excluded."""
        saved = 0
        if count:
            exclude = {p.untyped_storage().data_ptr() for p in self.store.params.values()}
            exclude |= {a.untyped_storage().data_ptr() for a in args}
            with SavedBytes(exclude) as counter:
                outs = self.modules[ins.region](*args)
            saved = counter.bytes
        else:
            outs = self.modules[ins.region](*args)
        return dict(zip(self.plan.regions[ins.region].outputs, outs, strict=True)), saved

    def _recompute(self, ins, st: Stash) -> None:
        """B or BI of a recomputed region: its forward again, with autograd, on the stashed
        inputs and the forward's random state; the stash then holds that graph."""
        self.rng.restore(st.rng)
        with torch.enable_grad():
            st.outputs, st.saved = self._run_region(ins, st.args, count=self.tracing)
        st.args = st.rng = None

    def _batch_part(self, v: str, mb: int, replica: int, replicas: int) -> torch.Tensor:
        """`batch_part` of batch input `v`, from views cut once per step (one split per
        input and replica count instead of a slice per forward)."""
        parts = self.parts.get((v, replicas))
        if parts is None:
            t, m = self.batch[v], self.plan.microbatches
            chunk = t.shape[0] // m
            if chunk * m != t.shape[0] or chunk % replicas:  # uneven: slice as batch_part does
                return batch_part(t, m, mb, replica, replicas)
            parts = self.parts[(v, replicas)] = t.split(chunk // replicas)
        return parts[mb * replicas + replica]

    def _out_grads(self, st: Stash, mb: int) -> tuple[list, list]:
        outs, grads = [], []
        for name, out in st.outputs.items():
            if name == LOSS:
                outs.append(out)
                grads.append(torch.full_like(out, self.plan.loss_scale))
            elif out.requires_grad and (name, mb) in self.values.grads:
                outs.append(out)
                grads.append(self.values.grads[(name, mb)])
        return outs, grads

    def _backward(self, ins) -> None:
        key = (ins.region, ins.mb)
        st = self.values.stash.get(key)
        if st is None:
            raise RuntimeError(f"{ins} on device {self.rank} has no stashed forward "
                               f"{ins.region}F{ins.mb} (never ran, or already dropped)")
        if ins.kind == Op.BW:
            outs, grads = st.out_grads or ([], [])
            held = self.store.params
            params = [held[p] for p in self.plan.regions[ins.region].params
                      if p in held and held[p].requires_grad]
            if outs and params:
                torch.autograd.backward(outs, grads, inputs=params)
            del self.values.stash[key]
            return
        if ins.data.recompute and st.args is not None:
            self._recompute(ins, st)
        outs, grads = self._out_grads(st, ins.mb)
        if ins.kind == Op.B:
            if outs:
                torch.autograd.backward(outs, grads)
            for v, leaf in st.leaves:
                if leaf.grad is not None:
                    self.values.add_grad(v, ins.mb, leaf.grad)
            del self.values.stash[key]
            return
        leaves = [leaf for _, leaf in st.leaves]  # BI: input gradients only, keep the graph
        if outs and leaves:
            got = torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)
            for (v, _), g in zip(st.leaves, got, strict=True):
                if g is not None:
                    self.values.add_grad(v, ins.mb, g)
        st.out_grads = (outs, grads)
