"""Measure a Plan's costs on this machine, the way the workers run it.

- `profile_plan` (`profile_passes`, `profile_overhead`): a `runtime.worker.Worker` is built
  here for a device that runs each region (from a fresh copy of the plan's modules, no
  process group) and runs single passes exactly as a worker does, on one intra-op thread
  (workers call `torch.set_num_threads(1)`): F (stash bookkeeping and saved-bytes hooks
  included), B, or BI then BW where the plan splits backwards, and U with the optimizer;
  one microbatch each, a mean over repeats. The same worker times its bookkeeping
  after every instruction (the memory count over parameters, gradients, optimizer state
  and stashes, the clock, the recorder): the per-instruction host overhead.
- `profile_links`: gloo between worker processes on this machine, per kind: point-to-point
  (one way, from the sender's issue until the waiting receiver's WAIT returns) and
  ALL_REDUCE / REDUCE_SCATTER / ALL_GATHER (and ALL_TO_ALL for a plan that exchanges
  tokens) over every group size the plan uses, each fitted to latency + bytes / bandwidth,
  once per process and world size
  (`python -m piper_nb.sim.profile` workers, one thread each, issuing like
  `runtime/comm.py`: asynchronously, then waiting, pinned to cores as a `LocalCluster`
  pins its workers). Every timed message comes after half a millisecond of compute, and
  the processes not in it compute meanwhile, as in a step: woken from compute and sharing
  the cores, gloo is several times slower than in a tight loop of messages.
- `profile_packing`: what the worker's own host does around a collective on each bucket:
  flatten gradients into the buffer it sends, and put the result back.
- `region_flops`: forward FLOPs with `FlopCounterMode` (the analytic model).

Every figure is a mean over repeats spread over time, less the largest (`_typical`): a
step's median time is near the sum of its parts' means, their stalls included. Links are
fitted through the medians of each size's repeats plus the stalls' mean cost pooled over
all sizes (`fit_links`), and a WAIT costs its median call: gloo's rare, long stalls make
one size's mean too noisy, and they belong to the message, not to the WAIT.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

__all__ = ["profile_plan", "runnable_others", "profile_passes", "profile_overhead",
           "profile_links", "fit_links", "profile_comm", "profile_packing", "link_sizes",
           "region_flops", "region_inputs", "one_thread"]

_LINK_CACHE: dict[tuple, dict] = {}
_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
_MAX_SIZE = 1 << 26     # the largest message timed (64 MiB); larger ones extrapolate
_KINDS = ("ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER")


def link_sizes(largest: int = 0) -> tuple[int, ...]:
    """Message sizes (bytes) to time: 1 KiB to 1 MiB, then x4 until `largest` (the plan's
    largest message) is covered, up to 64 MiB; a bandwidth fitted below the sizes a plan
    sends is no bandwidth for it (latency noise dominates small messages)."""
    sizes = list(_SIZES)
    while sizes[-1] < min(largest, _MAX_SIZE):
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


@contextlib.contextmanager
def one_thread(threads: int = 1):
    """Run the block with `threads` intra-op threads, as a worker process does."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def region_inputs(plan, r: int, seed: int = 0) -> list[torch.Tensor]:
    """Random (float) or zero (integer) tensors shaped like region r's inputs."""
    gen = torch.Generator().manual_seed(seed)
    args = []
    for v in plan.regions[r].inputs:
        info = plan.values[v]
        dtype = getattr(torch, info.dtype)
        if dtype.is_floating_point:
            t = torch.randn(info.shape, generator=gen).to(dtype)
            t.requires_grad_(info.requires_grad)
        else:
            t = torch.zeros(info.shape, dtype=dtype)
        args.append(t)
    return args


def _typical(times: list[float]) -> float:
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

    def ensure_groups(self, groups, pairs=(), counted=()) -> None:
        pass

    def barrier(self) -> None:
        pass

    def recycle(self) -> None:
        pass


def _batch(plan) -> tuple[torch.Tensor, torch.Tensor]:
    """A full batch shaped like the one the plan was compiled for (random floats, zero ids)."""
    out = []
    for v in ("inputs", "targets"):
        info = plan.values[v]
        dtype = getattr(torch, info.dtype)
        shape = (plan.batch_size, *info.shape[1:])
        out.append(torch.randn(shape).to(dtype) if dtype.is_floating_point else
                   torch.zeros(shape, dtype=dtype))
    return out[0], out[1]


class _Bench:
    """A `runtime.worker.Worker` for device d, built in this process from a fresh copy of
    the plan's modules, that runs single passes exactly as a worker does."""

    def __init__(self, plan, d: int, optimizer, blob: bytes):
        from piper_nb.runtime.bundle import load_bundle
        from piper_nb.runtime.timing import Clock, Recorder
        from piper_nb.runtime.worker import Worker
        self.plan = plan
        self.w = w = Worker(d, load_bundle(blob), _NoComm(), torch.device("cpu"))
        w.reset(optimizer)
        w.step_no = 1
        w.begin(_batch(plan))
        w.clock = Clock(torch.device("cpu"))
        w.clock.start()
        w.rec = Recorder(d, w.clock)
        self.first = {}
        for ins in w.instrs:
            if ins.is_compute:
                self.first.setdefault((ins.region, ins.kind), ins)

    def _gather(self, r: int) -> None:
        st = self.w.store
        for b in self.w.needs.get(r, ()):
            if not st.gathered(b):
                st.acquire(b, torch.zeros(self.w.layouts[b].padded, dtype=st.full[b].dtype))

    def _inputs(self, ins) -> None:
        for v in self.plan.regions[ins.region].inputs:
            if v not in ("inputs", "targets"):
                info = self.plan.values[v]
                dtype = getattr(torch, info.dtype)
                self.w.values.acts[(v, ins.mb)] = (torch.randn(info.shape).to(dtype)
                                                   if dtype.is_floating_point
                                                   else torch.zeros(info.shape, dtype=dtype))

    def _out_grads(self, ins) -> None:
        """Gradients for the outputs forward `ins` just made, shaped like them: an expert
        region's token count depends on the routing, not on the plan's captured shapes."""
        made = self.w.values.stash[(ins.region, ins.mb)].outputs
        for v in self.plan.regions[ins.region].outputs:
            info = self.plan.values.get(v)
            if v != "loss" and info is not None and info.requires_grad:
                out = made.get(v)
                self.w.values.grads[(v, ins.mb)] = (
                    torch.ones_like(out) if out is not None else
                    torch.ones(info.shape, dtype=getattr(torch, info.dtype)))

    def timed(self, ins) -> float:
        t0 = time.perf_counter()
        self.w._compute(ins)
        return time.perf_counter() - t0

    def passes(self, r: int, split_too: bool = False) -> dict[str, float]:
        """One round of region r's passes as this device's plan runs them: F, then B, and
        F then BI and BW where the plan splits backwards (DualPipe runs both kinds for one
        region; `split_too`: both whatever the plan runs)."""
        first, w = self.first, self.w
        f = first.get((r, "F"))
        if f is None:
            return {}
        got = {}
        modes = [m for m, kind in ((False, "B"), (True, "BI")) if (r, kind) in first]
        for split in ((False, True) if split_too or not modes else modes):
            self._gather(r)
            self._inputs(f)
            got["F"] = self.timed(f)
            self._out_grads(f)
            if split:
                got["BI"] = self.timed(replace_kind(f, "BI"))
                got["BW"] = self.timed(replace_kind(f, "BW"))
            else:
                got["B"] = self.timed(replace_kind(f, "B"))
            w.values.clear()
            w.losses.clear()
        return got

    def update(self, r: int) -> float:
        """One U of region r: gradients (or reduced shards) in place, the optimizer's step.
        The gradients are small random numbers, as in training: all-zero ones leave AdamW's
        second moments at zero, where its arithmetic runs about 3x slower on CPU."""
        ins = self.first.get((r, "U"))
        if ins is None:
            return 0.0
        st = self.w.store
        for n in ins.params:
            p = st.params.get(n)
            if p is not None:
                p.grad = torch.randn_like(p) * 1e-3
        for b in ins.buckets:
            lay = self.w.layouts[b]
            dtype = st.params[lay.names[0]].dtype
            st.grad_shards[b] = torch.randn(lay.shard).to(dtype) * 1e-3
        took = self.timed(ins)
        for b in ins.buckets:
            if self.w.layouts[b].zero != 3:
                st.shards.pop(b, None)
        return took

    def bookkeeping(self, repeats: int) -> float:
        """What the worker does after each instruction: poll, count memory, record; in a
        mid-step state (every gradient present, the optimizer's state made, a stash alive)."""
        w = self.w
        for r, kind in list(self.first):
            if kind == "U":
                self.update(r)
        for p in w.store.params.values():
            p.grad = torch.zeros_like(p)
        for (r, kind), ins in self.first.items():
            if kind == "F":
                self._gather(r)
                self._inputs(ins)
                w._compute(ins)
        clock, rec, times = w.clock, w.rec, []
        for _ in range(repeats):
            t0 = time.perf_counter()
            start = clock.mark()
            rec.event(next(iter(self.first.values())), start, clock.mark())
            for p in w.pending.values():
                w.comm.poll(p, clock)
            rec.memory(clock.mark(), *w._memory())
            times.append(time.perf_counter() - t0)
        w.values.clear()
        for p in w.store.params.values():
            p.grad = None
        return _typical(times)


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
            if kind == "ALL_REDUCE":
                pack, flat = _timed_call(st.flat_grads, b)
                unpack = _timed_call(st.set_grads, b, flat)[0]
            elif kind == "REDUCE_SCATTER":
                pack = _timed_call(st.flat_grads, b)[0] + _timed_call(st.clear_grads, b)[0]
                shard = torch.randn(lay.shard, generator=gen) * 1e-3
                st.grad_shards[b] = shard.clone()   # a later microbatch adds to the first
                unpack = _timed_call(st.add_grad_shard, b, shard)[0]
                st.grad_shards.pop(b, None)
            elif kind == "ALL_GATHER":
                full = torch.zeros(lay.padded, dtype=st._like(b).dtype)
                pack = 0.0
                if lay.zero == 3:
                    if st.gathered(b):
                        st._release(b)
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
    return {k: (_typical([x[0] for x in v]), _typical([x[1] for x in v])) for k, v in out.items()}


def profile_packing(plan, repeats: int = 5, optimizer=None
                    ) -> dict[tuple[str, int], tuple[float, float]]:
    """(collective kind, bucket) -> (seconds before the call, seconds after the wait) that a
    worker's host spends packing the bucket and unpacking the result (see
    `_bucket_host_times`), timed on a worker of the bucket's first device."""
    from piper_nb.optim import SGD
    from piper_nb.runtime.bundle import make_bundle
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
    import dataclasses
    return dataclasses.replace(ins, kind=kind)


def _devices_by_region(plan) -> dict[int, int]:
    """Region -> the first device that runs its forward."""
    out: dict[int, int] = {}
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == "F":
                out.setdefault(ins.region, dp.device)
    return out


def profile_passes(plan, repeats: int = 5, optimizer=None) -> dict[tuple[int, str], float]:
    """(region, pass) -> seconds for every region of the plan, timed here on one thread by a
    worker built like the one that runs it (F, B, BI, BW, and U with `optimizer`)."""
    return profile_plan(plan, repeats, optimizer)[0]


def profile_overhead(plan, optimizer=None, repeats: int = 200) -> dict[int, float]:
    """Device -> seconds of the worker's bookkeeping after each instruction (the memory
    count over its parameters, gradients, optimizer state and stashes; the clock; the
    recorder), timed on a worker built like that device's."""
    return profile_plan(plan, 1, optimizer, overhead_repeats=repeats)[1]


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

    from piper_nb.runtime.bundle import make_bundle
    blob = make_bundle(plan)   # what the driver ships: each bench unpickles its own copy

    def bench(d: int) -> _Bench:
        if d not in benches:
            benches[d] = _Bench(plan, d, optimizer, blob)
        return benches[d]
    updates = {}   # region -> a device that updates it
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == "U":
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
                    times.setdefault((r, "U"), []).append(t)
        passes = {key: _typical(v) for key, v in times.items()}
        for r, d in regions:   # BI and BW where the plan does not split (one round)
            if (r, "BI") not in passes:
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


def region_flops(plan) -> dict[int, float]:
    """Region -> forward FLOPs on one microbatch slice (FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode

    from piper_nb.capture.untouched import untouched
    out = {}
    for r in range(len(plan.regions)):
        args = region_inputs(plan, r)
        with untouched(plan.capture.model), FlopCounterMode(display=False) as counter, \
                torch.no_grad():
            plan.capture.modules[r](*args)
        out[r] = float(counter.get_total_flops())
    return out


# ---- links: gloo between processes ------------------------------------------------------

_BUSY = 5e-4   # seconds of compute before each timed message, as a pass comes before it


def _busy(seconds: float) -> None:
    """Compute for `seconds` (small matmuls), the way a worker reaches its next message:
    busy, with gloo's threads idle, rather than in a tight loop of messages."""
    a, t0 = torch.full((32, 32), 0.01), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = (a @ a).tanh_()


def _collective(make, call, repeats: int) -> tuple[tuple[float, float], list[float]]:
    """(`_both` of the times from issue to completion, the issue calls' times) of a collective
    issued after some compute, as a worker issues it: fresh buffers each time, made
    before the clock starts (the worker's own packing is `profile_packing`'s)."""
    call(*make()).wait()   # warm up
    total, posting = [], []
    for _ in range(repeats):
        bufs = make()
        _busy(_BUSY)
        t0 = time.perf_counter()
        work = call(*bufs)
        posting.append(time.perf_counter() - t0)
        work.wait()
        total.append(time.perf_counter() - t0)
    return _both(total), posting


def _link_worker(rank: int, world: int, port: int, groups: list[int], repeats: int,
                 sizes: tuple[int, ...] = _SIZES, kinds: tuple[str, ...] = _KINDS) -> dict:
    """Run inside `python -m piper_nb.sim.profile`: time p2p and collectives like
    `runtime/comm.py` issues them (async, then wait); rank 0 returns the times."""
    import datetime

    import torch.distributed as dist  # only in the processes this module starts
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    pgs = {n: dist.new_group(list(range(n))) for n in groups}
    pair = pgs[2] if 2 in pgs else dist.new_group([0, 1])   # every rank makes each group
    out: dict[str, list] = {}
    for size in sizes:
        dist.barrier()
        if rank < 2:
            one_way, sends, recvs = _one_way(dist, rank, size, 3 * repeats)   # cheap
            out.setdefault("p2p/2", []).append((size, *one_way))
            out.setdefault("issue/SEND", []).append((size, *_both(sends)))
            out.setdefault("issue/RECV", []).append((size, *_both(recvs)))
        _stop_or_spin(dist, rank, world, 2, f"p2p_{size}")
        for n in groups:
            dist.barrier()
            if rank >= n:
                _stop_or_spin(dist, rank, world, n, f"{n}_{size}")
                continue
            numel = -(-size // (4 * n)) * n
            g = pgs[n]
            # (buffers, as the worker holds them before the call; the call)
            ops = {"ALL_REDUCE": (lambda numel=numel: (torch.zeros(numel),),
                                  lambda t, g=g: dist.all_reduce(t, group=g, async_op=True)),
                   "REDUCE_SCATTER": (lambda numel=numel, n=n: (torch.empty(numel // n),
                                                                torch.zeros(numel)),
                                      lambda o, t, g=g: rs(o, t, group=g, async_op=True)),
                   "ALL_GATHER": (lambda numel=numel, n=n: (torch.empty(numel),
                                                            torch.zeros(numel // n)),
                                  lambda o, t, g=g: ag(o, t, group=g, async_op=True)),
                   "ALL_TO_ALL": (lambda numel=numel: (torch.empty(numel), torch.zeros(numel)),
                                  lambda o, t, g=g: dist.all_to_all_single(o, t, group=g,
                                                                           async_op=True))}
            for kind in kinds:
                total, posting = _collective(*ops[kind], repeats)
                out.setdefault(f"{kind}/{n}", []).append((size, *total))
                out.setdefault(f"issue/{kind}", []).append((size, *_both(posting)))
            _stop_or_spin(dist, rank, world, n, f"{n}_{size}")
    dist.barrier()
    if rank < 2:
        out["issue/WAIT"] = _wait_calls(dist, rank, repeats, pair)
    _stop_or_spin(dist, rank, world, 2, "wait")
    dist.barrier()
    dist.destroy_process_group()
    return out


def _wait_calls(dist, rank: int, repeats: int, pair=None) -> list[float]:
    """Times of WAIT calls on messages already complete (a receive, then a send): what a
    WAIT costs the host when nothing is left to wait for. The two ranks meet at a barrier
    (`pair`) each time first: a rank that starts late would make its peer's WAIT wait for
    its message, and the two could stay out of step, so that every WAIT timed a wait."""
    times = []
    for k in range(repeats):
        dist.barrier(group=pair)
        recv = dist.irecv(torch.empty(256), 1 - rank, tag=5000 + k)
        send = dist.isend(torch.zeros(256), 1 - rank, tag=5000 + k)
        _busy(4 * _BUSY)   # long enough for both to be done
        t0 = time.perf_counter()
        recv.wait()
        t1 = time.perf_counter()
        send.wait()
        times += [t1 - t0, time.perf_counter() - t1]
    return times


def _stop_or_spin(dist, rank: int, world: int, members: int, tag: str) -> None:
    """Ranks past the first `members` compute until rank 0 says the measurement is over
    (a marker file: gloo's point-to-point work cannot be polled), so that every worker
    process is busy, as in a step."""
    if world <= members:
        return
    marker = os.path.join(tempfile.gettempdir(), f"piper_nb_link_{os.getppid()}_{tag}")
    if rank == 0:
        with open(marker, "w"):
            pass
    elif rank >= members:
        while not os.path.exists(marker):
            _busy(2e-3)
    dist.barrier()
    if rank == 0:
        os.remove(marker)


def _one_way(dist, rank: int, size: int, repeats: int) -> tuple[tuple[float, float], list, list]:
    """One-way time of a `size`-byte message between ranks 0 and 1, in both directions in
    turn, as a pipeline sends: the receive posted ahead, the sender computing first, each
    message a fresh tensor into a fresh buffer, sends left in flight and waited for in
    batches. Timed from the sender's issue (stamped into the message: `perf_counter` is
    one monotonic clock for every process on the machine) until the receiver's WAIT
    returns. Also the times the send and receive calls themselves took on this rank."""
    numel = max(size // 8, 1)
    times, sends, recvs, pending = [], [], [], []
    for k in range(repeats + 1):
        for src in (0, 1):
            if rank == src:
                _busy(_BUSY)   # the receiver waits meanwhile, as a pipeline stage does
                buf = torch.zeros(numel, dtype=torch.float64)
                t0 = time.perf_counter()
                buf[0] = t0
                pending.append(dist.isend(buf, 1 - src, tag=2 * k + src))
                if k:
                    sends.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                work = dist.irecv(got := torch.empty(numel, dtype=torch.float64), src,
                                  tag=2 * k + src)
                if k:
                    recvs.append(time.perf_counter() - t0)
                work.wait()
                if k:
                    times.append(time.perf_counter() - float(got[0]))
        if k % 4 == 3 or k == repeats:
            for w in pending:
                w.wait()
            pending = []
    return _both(times), sends, recvs   # rank 0 received in one direction: its times


def _both(times: list[float]) -> tuple[float, float]:
    """(`_typical`, median) of one size's times: what `_fit_stalls` fits."""
    return _typical(times), statistics.median(times)


def _fit_stalls(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """`_fit` of (size, typical, median) points: the line through the medians, its latency
    raised by the stalls' mean cost (typical - median), pooled over all sizes. Gloo's
    stalls (and, with more processes than cores, waits for a core) do not grow with the
    message, and are rare and long: the mean of one size's repeats moves by tens of percent
    between profiles, the pooled excess over all sizes much less."""
    lat, bw = _fit([(p[0], p[2]) for p in points])
    excess = statistics.fmean(max(p[1] - p[2], 0.0) for p in points)
    return lat + excess, bw


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of time = latency + bytes / bandwidth: the latency is
    the smallest message's time, the bandwidth the median slope to the largest messages
    (those of at least 1/16 of the largest size: below that the latency's noise is larger
    than the transfer), robust to one noisy point, which a least-squares line on this
    loaded machine is not."""
    points = sorted(points)
    s0, t0 = points[0]
    big = points[-1][0] / 16
    slopes = [(t - t0) / (s - s0) for s, t in points[1:] if s > s0 and s >= big]
    slope = statistics.median(slopes) if slopes else 0.0
    return max(t0, 0.0), (1.0 / slope if slope > 0 else math.inf)


def fit_links(raw: dict) -> dict[tuple[str, int | str], tuple[float, float]]:
    """The link workers' times ("p2p/2", "ALL_REDUCE/2", "issue/SEND": (size, typical,
    median) per size; "issue/WAIT": seconds) -> (kind, n) -> (latency s, bandwidth B/s)."""
    fitted: dict = {}
    for name, points in raw.items():
        kind, n = name.split("/")
        if kind == "issue" and n == "WAIT":   # host time of a WAIT: (seconds, inf)
            # the median: in a tenth of the calls gloo had not delivered the message yet
            # (its stalls, 1-5 ms), which the link's own time already counts
            fitted[("issue", n)] = (statistics.median(points), math.inf)
        elif kind == "issue":   # host time of the call, fitted like a link
            fitted[("issue", n)] = _fit_stalls([tuple(x) for x in points])
        else:
            fitted[(kind, int(n))] = _fit_stalls([tuple(x) for x in points])
    return fitted


def profile_links(world: int = 2, groups=(2,), repeats: int = 21,
                  timeout: float = 180.0, largest: int = 0, kinds: tuple[str, ...] = _KINDS
                  ) -> dict[tuple[str, int], tuple[float, float]]:
    """(kind, group size) -> (latency s, bandwidth bytes/s) of gloo here; kind is "p2p" or a
    collective (the three of `_KINDS`, and those in `kinds`: ALL_TO_ALL). `world` processes
    (each one thread) run them over `link_sizes(largest)`; cached per process. On failure a
    warning names the reason and 50 us + 1 GB/s is assumed for every kind."""
    groups = tuple(sorted({g for g in groups if 2 <= g <= world}))
    sizes = link_sizes(largest)
    kinds = tuple(dict.fromkeys((*_KINDS, *kinds)))   # the usual three, and ALL_TO_ALL if asked
    key = (world, groups, sizes, kinds)
    if key in _LINK_CACHE:
        return _LINK_CACHE[key]
    from piper_nb.host import core_plan, free_port
    port = free_port()
    cmd = [sys.executable, "-m", "piper_nb.sim.profile", str(world), str(port), str(repeats),
           ",".join(map(str, groups)), ",".join(map(str, sizes))]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cores = core_plan(world)   # placed as a LocalCluster of `world` places its workers
    procs = [subprocess.Popen([*cmd, str(r), ",".join(map(str, cores[r] or ())), ",".join(kinds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        if procs[0].returncode:
            raise RuntimeError(outs[0][1].strip().splitlines()[-1:] or procs[0].returncode)
        fitted = fit_links(json.loads(outs[0][0]))
    except Exception as err:  # no result: fall back, and say so
        warnings.warn(f"gloo link profile failed ({err}); assuming 50 us + 1 GB/s", stacklevel=2)
        fitted = {(k, n): (50e-6, 1e9) for k in ("p2p", *kinds) for n in (2, *groups)}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _LINK_CACHE[key] = fitted
    return fitted


def profile_comm(repeats: int = 21, timeout: float = 180.0) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a point-to-point gloo link here (cached)."""
    return profile_links(2, (), repeats, timeout)[("p2p", 2)]


if __name__ == "__main__":  # a link worker: WORLD PORT REPEATS GROUPS SIZES RANK CORES KINDS
    from piper_nb.host import pin_threads
    pin_threads(tuple(int(x) for x in sys.argv[7].split(",") if x))
    _world, _port, _repeats = (int(x) for x in sys.argv[1:4])
    _groups = [int(x) for x in sys.argv[4].split(",") if x]
    _sizes = tuple(int(x) for x in sys.argv[5].split(","))
    _rank = int(sys.argv[6])
    _kinds = tuple(sys.argv[8].split(",")) if len(sys.argv) > 8 and sys.argv[8] else _KINDS
    _times = _link_worker(_rank, _world, _port, _groups, _repeats, _sizes, _kinds)
    if _rank == 0:
        print(json.dumps(_times))
