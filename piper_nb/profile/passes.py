"""Measure a plan's passes on this machine, the way a worker runs them.

`profile_plan`: a `runtime.worker.Worker` is built here for a device that runs each region
(from a fresh copy of the plan's modules, no process group, through `Worker.bench`) and
runs single passes exactly as a worker does, on one intra-op thread (workers call
`torch.set_num_threads(1)`): F (stash bookkeeping and saved-bytes hooks included), B, or
BI then BW where the plan splits backwards, and U with the optimizer; one microbatch
each, a mean over repeats. The same worker times its bookkeeping after every instruction
(the memory count over parameters, gradients, optimizer state and stashes, the clock, the
recorder): the per-instruction host overhead. `profile_packing`: what the worker's own
host does around a collective on each bucket: flatten gradients into the buffer it sends,
and put the result back.

Every figure is a mean over repeats spread over time, less the largest (`typical`): a
step's median time is near the sum of its parts' means, their stalls included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time

import torch

from piper_nb.ir.kinds import BUCKET_COLLECTIVES, PASSES, Op, Unit
from piper_nb.plan.sizes import random_value
from piper_nb.runtime.bundle import load_bundle, make_bundle
from piper_nb.runtime.worker import Worker

__all__ = ["profile_plan", "profile_packing", "runnable_others", "one_thread", "replace_kind",
           "typical"]

_KINDS = frozenset(BUCKET_COLLECTIVES)


@contextlib.contextmanager
def one_thread(threads: int = 1):
    """Run the block with `threads` intra-op threads, as a worker process does."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def typical(times: list[float]) -> float:
    """The mean without the single largest time. A step is a sum of many passes, calls and
    messages, so its median sits near the sum of their means: the occasional stall of a
    few milliseconds (a gloo call, a preemption by other work here) belongs in it; one
    outlier among the repeats (a collection, a page fault) does not."""
    if not times:
        return 0.0
    times = sorted(times)
    return statistics.fmean(times[:-1] if len(times) >= 5 else times)


class _NoComm:
    """A worker built here runs passes only: it makes no groups and sends nothing."""

    def ensure_groups(self, comms=(), counted=(), batchnorm=()) -> None:
        pass

    def barrier(self) -> None:
        pass

    def recycle(self) -> None:
        pass


def _batch(plan) -> tuple[torch.Tensor, ...]:
    """A full batch shaped like the one the plan was compiled for (random floats, zero ids),
    its tensors in the order of `plan.batch_names`."""
    return tuple(random_value(plan.values[v], (plan.batch_size, *plan.values[v].shape[1:]))
                 for v in plan.batch_names)


class _Bench:
    """A `runtime.worker.Worker` for device d, built in this process from a fresh copy of
    the plan's modules, that runs single passes exactly as a worker does."""

    def __init__(self, plan, d: int, optimizer, blob: bytes):
        self.plan = plan
        self.w = w = Worker(d, load_bundle(blob), _NoComm(), torch.device("cpu"))
        w.reset(optimizer)
        w.bench(_batch(plan))
        self.first = {}
        for ins in w.instrs:   # timed without recompute: the cost model adds the forward
            if ins.is_compute:
                self.first.setdefault((ins.region, ins.kind), ins.with_data(
                    recompute=False, unit=Unit.NONE, keep=(), slices=()) if ins.kind in PASSES else ins)

    def _gather(self, r: int) -> None:
        st = self.w.store
        for b in self.w.needs.get(r, ()):
            if not st.gathered(b):
                st.acquire(b, torch.zeros(self.w.layouts[b].padded, dtype=st.full[b].dtype))

    def _inputs(self, ins) -> None:
        for v in self.plan.regions[ins.region].inputs:
            if v not in self.plan.batch_names:
                self.w.values.acts[(v, ins.mb)] = random_value(self.plan.values[v])

    def _out_grads(self, ins) -> None:
        """Gradients for the outputs forward `ins` just made, shaped like them: an expert
        region's token count depends on the routing, not on the plan's captured shapes."""
        made = self.w.values.acts
        for v in self.plan.regions[ins.region].outputs:
            info = self.plan.values.get(v)
            if v != "loss" and info is not None and info.requires_grad:
                out = made.get((v, ins.mb))
                self.w.values.grads[(v, ins.mb)] = (
                    torch.ones_like(out) if out is not None else
                    torch.ones(info.shape, dtype=getattr(torch, info.dtype)))

    def timed(self, ins) -> float:
        t0 = time.perf_counter()
        self.w.run(ins)
        return time.perf_counter() - t0

    def passes(self, r: int, split_too: bool = False) -> dict[str, float]:
        """One round of region r's passes as this device's plan runs them: F, then B, and
        F then BI and BW where the plan splits backwards (DualPipe runs both kinds for one
        region; `split_too`: both whatever the plan runs)."""
        first, w = self.first, self.w
        f = first.get((r, Op.F))
        if f is None:
            return {}
        got = {}
        modes = [m for m, kind in ((False, "B"), (True, "BI")) if (r, kind) in first]
        for split in ((False, True) if split_too or not modes else modes):
            self._gather(r)
            self._inputs(f)
            got[Op.F] = self.timed(f)
            self._out_grads(f)
            if split:
                got[Op.BI] = self.timed(replace_kind(f, Op.BI))
                got[Op.BW] = self.timed(replace_kind(f, Op.BW))
            else:
                got[Op.B] = self.timed(replace_kind(f, Op.B))
            w.values.clear()
            w.losses.clear()
        return got

    def update(self, r: int) -> float:
        """One U of region r: gradients (or reduced shards) in place, the optimizer's step.
        The gradients are small random numbers, as in training: all-zero ones leave AdamW's
        second moments at zero, where its arithmetic runs about 3x slower on CPU."""
        ins = self.first.get((r, Op.U))
        if ins is None:
            return 0.0
        st = self.w.store
        for n in ins.data.params:
            p = st.params.get(n)
            if p is not None:
                p.grad = torch.randn_like(p) * 1e-3
        for b in ins.data.buckets:
            lay = self.w.layouts[b]
            dtype = st.params[lay.names[0]].dtype
            st.grad_shards[b] = torch.randn(lay.shard).to(dtype) * 1e-3
        took = self.timed(ins)
        for b in ins.data.buckets:
            if self.w.layouts[b].zero != 3:
                st.shards.pop(b, None)
        return took

    def bookkeeping(self, repeats: int) -> float:
        """What the worker does after each instruction: poll, count memory, record; in a
        mid-step state (every gradient present, the optimizer's state made, a stash alive)."""
        w = self.w
        for r, kind in list(self.first):
            if kind == Op.U:
                self.update(r)
        for p in w.store.params.values():
            p.grad = torch.zeros_like(p)
        for (r, kind), ins in self.first.items():
            if kind == Op.F:
                self._gather(r)
                self._inputs(ins)
                w.run(ins)
        clock, rec, times = w.clock, w.rec, []
        for _ in range(repeats):
            t0 = time.perf_counter()
            start = clock.mark()
            rec.event(next(iter(self.first.values())), start, clock.mark())
            for p in w.pending.values():
                w.comm.poll(p, clock)
            rec.memory(clock.mark(), *w.memory())
            times.append(time.perf_counter() - t0)
        w.values.clear()
        for p in w.store.params.values():
            p.grad = None
        return typical(times)


def _timed_call(fn, *args) -> tuple[float, object]:
    """(seconds, result) of fn(*args)."""
    t0 = time.perf_counter()
    got = fn(*args)
    return time.perf_counter() - t0, got


def _bucket_host_times(bench: _Bench, b: int, kinds: set[str], repeats: int
                       ) -> dict[str, tuple[float, float]]:
    """Collective kind -> (seconds before the call, seconds after its wait) the worker's
    own host spends on bucket b: flattening gradients into the buffer it sends, and
    putting the result back (summed gradients as views, a gradient shard added, gathered
    parameters copied in or, for ZeRO-3, their storage refilled)."""
    st, lay = bench.w.store, bench.w.layouts[b]
    gen = torch.Generator().manual_seed(b)
    out: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeats):
        for kind in sorted(kinds):
            for n in lay.names:
                st.params[n].grad = torch.randn(st.params[n].shape, generator=gen) * 1e-3
            if kind == Op.ALL_REDUCE:
                pack, flat = _timed_call(st.flat_grads, b)
                unpack = _timed_call(st.set_grads, b, flat)[0]
            elif kind == Op.REDUCE_SCATTER:
                pack = _timed_call(st.flat_grads, b)[0] + _timed_call(st.clear_grads, b)[0]
                shard = torch.randn(lay.shard, generator=gen) * 1e-3
                st.grad_shards[b] = shard.clone()   # a later microbatch adds to the first
                unpack = _timed_call(st.add_grad_shard, b, shard)[0]
                st.grad_shards.pop(b, None)
            elif kind == Op.ALL_GATHER:
                full = torch.zeros(lay.padded, dtype=st.like(b).dtype)
                pack = 0.0
                if lay.zero == 3:
                    if st.gathered(b):
                        st.release(b)
                    st.refs[b] = 0
                    unpack = _timed_call(st.acquire, b, full)[0]
                    st.free(b)
                else:
                    unpack = _timed_call(st.write_params, b, full)[0]
            else:
                continue
            out.setdefault(kind, []).append((pack, unpack))
    for n in lay.names:
        st.params[n].grad = None
    return {k: (typical([x[0] for x in v]), typical([x[1] for x in v])) for k, v in out.items()}


def profile_packing(plan, repeats: int = 5, optimizer=None
                    ) -> dict[tuple[str, int], tuple[float, float]]:
    """(collective kind, bucket) -> (seconds before the call, seconds after the wait) that a
    worker's host spends packing the bucket and unpacking the result (see
    `_bucket_host_times`), timed on a worker of the bucket's first device."""
    from piper_nb.optim import SGD
    kinds: dict[int, set[str]] = {}
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind in _KINDS and ins.bucket >= 0:
                kinds.setdefault(ins.bucket, set()).add(ins.kind)
    if not kinds:
        return {}
    blob = make_bundle(plan)
    out = {}
    with torch.random.fork_rng(devices=[]), one_thread():
        for b, ks in sorted(kinds.items()):
            bench = _Bench(plan, plan.buckets[b].group[0], optimizer or SGD(0.1), blob)
            for kind, times in _bucket_host_times(bench, b, ks, repeats).items():
                out[(kind, b)] = times
    return out


def replace_kind(ins, kind: str):
    """`ins` as another pass of the same region and microbatch."""
    return dataclasses.replace(ins, kind=Op(kind))


def _devices_by_region(plan) -> dict[int, int]:
    """Region -> the first device that runs its forward."""
    out: dict[int, int] = {}
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == Op.F:
                out.setdefault(ins.region, dp.device)
    return out


def runnable_others() -> float | None:
    """Tasks runnable on this machine right now besides the caller (`/proc/loadavg`'s
    running count minus one); None where the system does not say."""
    try:
        with open("/proc/loadavg") as f:
            return max(int(f.read().split()[3].split("/")[0]) - 1, 0)
    except (OSError, ValueError, IndexError):
        return None


def profile_plan(plan, repeats: int = 7, optimizer=None, overhead_repeats: int = 200
                 ) -> tuple[dict[tuple[int, str], float], dict[int, float], float]:
    """Both of the above with one worker per device kind: (passes, overhead, background):
    background is the mean number of other tasks runnable on this machine meanwhile (the
    load the times were measured under)."""
    from piper_nb.optim import SGD
    if plan.capture is None:
        from piper_nb.errors import PlanError
        raise PlanError("this plan has no captured model (it was loaded from JSON); profile the "
                        "plan returned by pn.compile, or use CostModel.uniform / analytic")
    optimizer = optimizer if optimizer is not None else SGD(0.1)
    times: dict[tuple[int, str], list[float]] = {}
    overhead: dict[int, float] = {}
    benches: dict[int, _Bench] = {}

    blob = make_bundle(plan)   # what the driver ships: each bench unpickles its own copy

    def bench(d: int) -> _Bench:
        if d not in benches:
            benches[d] = _Bench(plan, d, optimizer, blob)
        return benches[d]
    updates = {}   # region -> a device that updates it
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == Op.U:
                updates.setdefault(ins.region, dp.device)
    with torch.random.fork_rng(devices=[]), one_thread():
        torch.manual_seed(0)
        regions = sorted(_devices_by_region(plan).items())
        # rounds over every pass of every region: a burst of other load on this machine
        # hits a few rounds of everything, not all rounds of one pass
        load: list[int] = []
        for k in range(max(repeats, 1) + 1):   # round 0 warms up
            for r, d in regions:
                others = runnable_others()
                if others is not None:
                    load.append(others)
                for kind, t in bench(d).passes(r, split_too=k == 0).items():
                    if k:
                        times.setdefault((r, kind), []).append(t)
            for r, d in sorted(updates.items()):
                t = bench(d).update(r)
                if k:
                    times.setdefault((r, Op.U), []).append(t)
        passes = {key: typical(v) for key, v in times.items()}
        for r, d in regions:   # BI and BW where the plan does not split (one round)
            if (r, Op.BI) not in passes:
                for kind, t in bench(d).passes(r, split_too=True).items():
                    passes.setdefault((r, kind), t)
        seen: dict[tuple, float] = {}
        for dp in plan.devices:   # devices with the same regions and buckets cost the same
            key = (tuple(sorted({(i.region, i.kind) for i in dp.instrs if i.is_compute})),
                   tuple(b.index for b in plan.buckets if dp.device in b.group))
            if key not in seen:
                seen[key] = bench(dp.device).bookkeeping(overhead_repeats)
            overhead[dp.device] = seen[key]
    return passes, overhead, (statistics.fmean(load) if load else 0.0)
