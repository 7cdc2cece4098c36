"""Measure a Plan's costs on this machine: pass timings, FLOPs and a gloo link fit.

`profile_passes` runs each region's traced module (`plan.capture.modules[r]`) on inputs
of the microbatch-slice shapes recorded in `plan.values` and times F, the full B, BI
(gradients of the inputs only) and BW (of the parameters only) with `torch.autograd.grad`,
so the model's `.grad` fields are never touched. `region_flops` counts forward FLOPs with
`FlopCounterMode`. `profile_comm` starts a 2-process gloo group, ping-pongs a few message
sizes and fits latency + bytes/bandwidth (least squares), once per process.
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings

import torch

__all__ = ["profile_passes", "region_flops", "profile_comm", "region_inputs"]

_COMM_CACHE: dict[str, tuple[float, float]] = {}
_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22)


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


def _median_time(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(max(repeats, 1)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _region_passes(plan, r: int, repeats: int) -> dict[tuple[int, str], float]:
    mod = plan.capture.modules[r]
    args = region_inputs(plan, r)
    inputs = [a for a in args if a.requires_grad]
    params = [p for p in mod.parameters() if p.requires_grad]

    def forward():
        outs = mod(*args)
        outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
        return outs, [torch.ones_like(o) for o in outs]

    def backward(wrt):
        outs, grads = forward()
        if not outs or not wrt:
            return lambda: None
        return lambda: torch.autograd.grad(outs, wrt, grads, allow_unused=True)

    def timed_backward(wrt) -> float:
        times = []
        for _ in range(max(repeats, 1) + 1):
            run = backward(wrt)
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    out = {(r, "F"): _median_time(forward, repeats)}
    out[(r, "B")] = timed_backward(inputs + params)
    out[(r, "BI")] = timed_backward(inputs)
    out[(r, "BW")] = timed_backward(params)
    with torch.no_grad():
        shadow = [p.detach().clone() for p in params]
        grads = [torch.ones_like(p) for p in shadow]
        out[(r, "U")] = _median_time(lambda: torch._foreach_add_(shadow, grads, alpha=-1e-3),
                                     repeats) if shadow else 0.0
    return out


def profile_passes(plan, repeats: int = 3) -> dict[tuple[int, str], float]:
    """(region, pass) -> seconds for every region of the plan, measured here."""
    if plan.capture is None:
        from piper_nb.errors import PlanError
        raise PlanError("this plan has no captured model (it was loaded from JSON); profile the "
                        "plan returned by pn.compile, or use CostModel.uniform / analytic")
    out: dict[tuple[int, str], float] = {}
    with torch.random.fork_rng(devices=[]):
        for r in range(len(plan.regions)):
            out.update(_region_passes(plan, r, repeats))
    return out


def region_flops(plan) -> dict[int, float]:
    """Region -> forward FLOPs on one microbatch slice (FlopCounterMode)."""
    from torch.utils.flop_counter import FlopCounterMode
    out = {}
    for r in range(len(plan.regions)):
        args = region_inputs(plan, r)
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            plan.capture.modules[r](*args)
        out[r] = float(counter.get_total_flops())
    return out


def _pingpong(rank: int, port: int, sizes, repeats: int) -> list[tuple[int, float]]:
    import torch.distributed as dist  # only in the worker processes this module starts
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    result = []
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            times.append((time.perf_counter() - t0) / 2)
        result.append((size, statistics.median(times[1:])))
    dist.destroy_process_group()
    return result


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    latency = max(my - slope * mx, 0.0)
    return latency, (1.0 / slope if slope > 0 else math.inf)


def profile_comm(repeats: int = 5, timeout: float = 120.0) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a gloo link on this machine, cached per process.

    Two worker processes (`python -m piper_nb.sim.profile RANK PORT`) ping-pong messages of
    a few sizes; on failure a warning names the reason and 50 us + 1 GB/s is assumed.
    """
    if "gloo" in _COMM_CACHE:
        return _COMM_CACHE["gloo"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "piper_nb.sim.profile"]
    procs = [subprocess.Popen([*cmd, str(r), str(port), str(repeats)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
        if procs[0].returncode:
            raise RuntimeError(outs[0][1].strip().splitlines()[-1:] or procs[0].returncode)
        fitted = _fit([tuple(x) for x in json.loads(outs[0][0])])
    except Exception as err:  # no result: fall back, and say so
        warnings.warn(f"gloo link profile failed ({err}); assuming 50 us + 1 GB/s", stacklevel=2)
        fitted = (50e-6, 1e9)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    _COMM_CACHE["gloo"] = fitted
    return fitted


if __name__ == "__main__":  # a ping-pong worker: RANK PORT REPEATS; rank 0 prints the times
    _rank, _port, _repeats = (int(x) for x in sys.argv[1:4])
    _times = _pingpong(_rank, _port, _SIZES, _repeats)
    if _rank == 0:
        print(json.dumps(_times))
