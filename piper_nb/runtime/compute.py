"""A worker's compute instructions: F, B, BI, BW and U (`ComputePasses`, a part of
`worker.Worker`).

F runs a region's GraphModule on its inputs (the batch's slice for this microbatch and
replica, or the activations received), those needing gradients entered through
`runtime.entries` so that the stash holds only what autograd saved, and stashes the
autograd state; B runs autograd from the stashed outputs' gradient edges with the received
output gradients (the loss's
gradient is `plan.loss_scale`) and hands input gradients upstream; BI computes the input
gradients only and keeps the graph for BW, which then computes the parameters'. U applies
the optimizer to full parameters and to this device's bucket shards. A recomputed region
(`Instr.recompute`, `pn.recompute`) runs its F under `torch.no_grad()` and stashes its
inputs; its B or BI first runs the forward again, seeded as F was, with autograd. The
parts of a tensor-parallel layer recomputed as one unit (`compiler.layer_recompute`) run
their first forward without autograd and keep nothing (`Unit.FIRST`); their second
(`Unit.AGAIN`) is an ordinary forward that stores only the outputs the layer's other
second runs read.
"""

from __future__ import annotations

import contextlib

import torch

from piper_nb.capture.ring_attention import take_share
from piper_nb.capture.sequence_ops import SEQ_DIM
from piper_nb.ir.kinds import Op, Unit
from piper_nb.ir.loss_outputs import LOSS, is_loss_output
from piper_nb.plan.instr import slice_name
from piper_nb.plan.sizes import SavedBytes
from piper_nb.runtime.entries import Entries, roots
from piper_nb.runtime.layout import batch_part
from piper_nb.runtime.seq_slices import SliceSaver, unpack
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
    `tp_rank`, `step_no`, `tracing`, and per step `batch`, `parts`, `losses` and `ends` (the count and
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
        args, raw, entering = [], [], []
        for k, v in enumerate(info.inputs):
            if v in self.batch:
                t = self._share(v, ins, info)
                raw.append(None)
            else:
                t = self.values.acts.get((v, mb))
                if t is None:
                    raise RuntimeError(f"input {v}@{mb} of region {ins.region} is not on device "
                                       f"{self.rank}: no RECV or forward produced it before {ins}")
                raw.append(t)
                vi = plan.values.get(v)
                if t.is_floating_point() and (vi is None or vi.requires_grad):
                    t = t.detach()
                    entering.append(k)
            args.append(t)
        start = self.rng.start(self.seed, self.step_no, ins)
        unit = ins.data.unit
        if ins.data.recompute or unit == Unit.FIRST:   # the backward runs it again
            with torch.no_grad():
                outputs, _, _ = self._run_region(ins, args, raw, count=False)
        else:
            entries = self._enter(info, args, entering)
            outputs, saved, kept = self._run_region(ins, args, raw, count=self.tracing,
                                                    slices=self._slices(ins, raw))
        self.rng.end(self.step_no, ins)
        for name, out in outputs.items():
            if unit == Unit.AGAIN and name not in ins.data.keep:
                continue   # a second run: what the layer's other second runs read, only
            if name == LOSS:
                self.losses.append(out.detach())
            elif is_loss_output(name):   # the count, a metric: reported, not sent
                self.ends.setdefault(name, []).append(out.detach())
            else:   # a size crossing regions is made on the host (`pack_size`): move it
                self.values.acts[(name, mb)] = on_device(out, self.device)
        if ins.data.recompute:   # the inputs, detached, are what the stash holds
            held = [None if r is None else a for a, r in zip(args, raw, strict=True)]
            self.values.stash[(ins.region, mb)] = Stash(
                None, {}, 0, [a for a in held if a is not None], args=args, rng=start,
                entering=entering, raw=held)
        elif unit != Unit.FIRST:   # a first run of a unit keeps nothing
            self.values.stash[(ins.region, mb)] = Stash(entries, roots(outputs), saved, kept)

    def _enter(self, info, args: list, entering: list[int]) -> Entries | None:
        """The inputs at `entering` made `Entries` views (in place in `args`)."""
        if not entering:
            return None
        entries = Entries(args[entering[0]].device)
        for k in entering:
            args[k] = entries.enter(info.inputs[k], args[k])
        return entries

    def _slices(self, ins, raw: list) -> SliceSaver | None:
        """The inputs the forward keeps as this device's sequence slices (`Pass.slices`)."""
        if not ins.data.slices:
            return None
        names = self.plan.regions[ins.region].inputs
        whole = {v: raw[names.index(v)] for v in ins.data.slices}
        degree = {v: x.shape[SEQ_DIM] // self.plan.values[slice_name(v)].shape[SEQ_DIM]
                  for v, x in whole.items()}
        return SliceSaver(self.values.acts, ins.mb, whole, self.tp_rank, degree, str(ins))

    def _run_region(self, ins, args: list, raw: list, count: bool,
                    slices: SliceSaver | None = None) -> tuple[dict, int, list]:
        """Run the region on `args` (its random state set by the caller): its outputs by
        name and (`count`) the bytes autograd saved outside parameters, inputs and outputs
        (`SavedBytes.split`) and the input (`raw`: the buffers, None for the batch's) and
        output buffers it saved, which the stash then holds; `slices`: inputs whose saved
        views are kept as sequence slices instead."""
        if not count:
            with slices.hooks() if slices is not None else contextlib.nullcontext():
                outs = self.modules[ins.region](*args)
            return dict(zip(self.plan.regions[ins.region].outputs, outs, strict=True)), 0, []
        exclude = {p.untyped_storage().data_ptr() for p in self.store.params.values()}
        exclude |= {a.untyped_storage().data_ptr() for a, t in zip(args, raw, strict=True)
                    if t is None and isinstance(a, torch.Tensor)}
        with SavedBytes(exclude, slices and slices.pack, unpack) as counter:
            outs = self.modules[ins.region](*args)
        saved, kin, kout = counter.split(raw, outs)
        kept = [raw[i] for i in kin] + [outs[j] for j in kout]
        return dict(zip(self.plan.regions[ins.region].outputs, outs, strict=True)), saved, kept

    def _recompute(self, ins, st: Stash) -> None:
        """B or BI of a recomputed region: its forward again, with autograd, on the stashed
        inputs and the forward's random state; the stash then holds that graph."""
        self.rng.restore(st.rng)
        args = list(st.args)
        st.inputs = self._enter(self.plan.regions[ins.region], args, st.entering)
        with torch.enable_grad():
            outputs, st.saved, st.kept = self._run_region(ins, args, st.raw,
                                                          count=self.tracing)
        st.roots = roots(outputs)
        st.args = st.rng = st.raw = None

    def _share(self, v: str, ins, info) -> torch.Tensor:
        """Batch input `v` as forward `ins` of region `info` takes it: its microbatch and
        replica's samples, and under context parallelism this device's tokens of them."""
        if not info.context:
            return self._batch_part(v, ins.mb, ins.replica, ins.replicas)
        degree, balance, cut = info.context
        t = self._batch_part(v, ins.mb, ins.replica // degree, max(ins.replicas // degree, 1))
        return take_share(t, degree, ins.replica % degree, balance) if v in cut else t

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
        for name, (edge, shape, dtype, device) in st.roots.items():
            if name == LOSS:
                outs.append(edge)
                grads.append(torch.full(shape, self.plan.loss_scale, dtype=dtype, device=device))
            elif (name, mb) in self.values.grads:
                outs.append(edge)
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
            self._input_grads(st, ins.mb, grads)
            del self.values.stash[key]
            return
        if outs and st.inputs is not None:   # BI: input gradients only, keep the graph
            torch.autograd.grad(outs, [st.inputs.anchor], grads, retain_graph=True,
                                allow_unused=True)
        self._input_grads(st, ins.mb, grads)
        st.out_grads = (outs, grads)

    def _input_grads(self, st: Stash, mb: int, given: list) -> None:
        """Hand on the input gradients a B or BI computed (`Entries.grads`), each a buffer
        of its own: autograd passes one tensor on unchanged (a sum's operands, an input
        returned as is), which a leaf's accumulator would have copied."""
        if st.inputs is None:
            return
        seen = {g.untyped_storage().data_ptr() for g in given}
        for v, g in st.inputs.grads.items():
            ptr = g.untyped_storage().data_ptr()
            if ptr in seen:
                g = g.clone()
            seen.add(ptr)
            self.values.add_grad(v, mb, g)
        st.inputs.grads.clear()
