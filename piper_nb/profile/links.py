"""Measure gloo between worker processes on this machine, per kind of message.

Point-to-point (one way, from the sender's issue until the waiting receiver's WAIT
returns) and ALL_REDUCE / REDUCE_SCATTER / ALL_GATHER (and ALL_TO_ALL for a plan that
exchanges tokens) over every group size the plan uses, each fitted to latency + bytes /
bandwidth, once per process and world size (`python -m piper_nb.profile.links` workers,
one thread each, issuing like `runtime/comm.py`: asynchronously, then waiting, pinned to
cores as a `LocalCluster` pins its workers). Every timed message comes after half a
millisecond of compute, and the processes not in it compute meanwhile, as in a step: woken
from compute and sharing the cores, gloo is several times slower than in a tight loop of
messages.

Links are fitted through the medians of each size's repeats plus the stalls' mean cost
pooled over all sizes (`fit_links`), and a WAIT costs its median call: gloo's rare, long
stalls make one size's mean too noisy, and they belong to the message, not to the WAIT.
"""

from __future__ import annotations

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

from piper_nb.ir.kinds import BUCKET_COLLECTIVES, Op
from piper_nb.profile.passes import typical

__all__ = ["profile_links", "fit_links", "link_sizes"]

_LINK_CACHE: dict[tuple, dict] = {}
_SIZES = (1 << 10, 1 << 14, 1 << 17, 1 << 20)
_MAX_SIZE = 1 << 26     # the largest message timed (64 MiB); larger ones extrapolate
_KINDS = tuple(k.value for k in BUCKET_COLLECTIVES)


def link_sizes(largest: int = 0) -> tuple[int, ...]:
    """Message sizes (bytes) to time: 1 KiB to 1 MiB, then x4 until `largest` (the plan's
    largest message) is covered, up to 64 MiB; a bandwidth fitted below the sizes a plan
    sends is no bandwidth for it (latency noise dominates small messages)."""
    sizes = list(_SIZES)
    while sizes[-1] < min(largest, _MAX_SIZE):
        sizes.append(sizes[-1] * 4)
    return tuple(sizes)


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
    """Run inside `python -m piper_nb.profile.links`: time p2p and collectives like
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
            ops = {Op.ALL_REDUCE: (lambda numel=numel: (torch.zeros(numel),),
                                  lambda t, g=g: dist.all_reduce(t, group=g, async_op=True)),
                   Op.REDUCE_SCATTER: (lambda numel=numel, n=n: (torch.empty(numel // n),
                                                                torch.zeros(numel)),
                                      lambda o, t, g=g: rs(o, t, group=g, async_op=True)),
                   Op.ALL_GATHER: (lambda numel=numel, n=n: (torch.empty(numel),
                                                            torch.zeros(numel // n)),
                                  lambda o, t, g=g: ag(o, t, group=g, async_op=True)),
                   Op.ALL_TO_ALL: (lambda numel=numel: (torch.empty(numel), torch.zeros(numel)),
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
    """(`typical`, median) of one size's times: what `_fit_stalls` fits."""
    return typical(times), statistics.median(times)


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
        if kind == "issue" and n == Op.WAIT:   # host time of a WAIT: (seconds, inf)
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
    cmd = [sys.executable, "-m", "piper_nb.profile.links", str(world), str(port), str(repeats),
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
