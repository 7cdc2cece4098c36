"""Measure what time-slicing costs, the way `LocalCluster(plan.world)` will run a plan.

`profile_slicing(plan)` starts one process per device, placed as the cluster places its
workers, each with the device's own regions (a `runtime.worker.Worker` built from the
plan's shipped bundle, passes as in `profile.passes`). First each process times rounds of
its passes alone, the others waiting; then all run rounds at once for a fixed window. The
factor is the mean, over devices, of (time per round together) / (time per round alone x
processes / cores). On this 2-core machine it comes out at 1.05-1.12 for 4 processes. The
jitter is the quantiles of each pass's time over its own median while all run together
(`sim.time_slicing`, where the simulator uses both).
"""

from __future__ import annotations

import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from piper_nb.ir.kinds import Op
from piper_nb.sim.time_slicing import Slicing, jitter_quantiles, quantiles

__all__ = ["profile_slicing"]

_WINDOW = 1.5   # seconds all processes run together


def profile_slicing(plan, optimizer=None, rounds: int = 10, timeout: float = 180.0,
                    cores: int | None = None) -> Slicing:
    """Time-slicing for `plan` on local CPU workers (factor 1.0 and no jitter when every
    device gets a core of its own); `cores` (default: all this process may use) restricts
    the device processes to the first that many. On failure a warning names the reason and
    none is assumed."""
    from piper_nb.host import core_plan, usable_cores
    from piper_nb.runtime.bundle import make_bundle
    usable = usable_cores()
    cores = cores or len(usable)
    world = plan.world
    if world <= cores:
        return Slicing(1.0)
    import pickle
    fd, path = tempfile.mkstemp(prefix="piper_nb_slicing_", suffix=".pkl")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((make_bundle(plan), optimizer), f)
    # placed as LocalCluster(world) places its workers; on fewer cores, all on those
    placement = (core_plan(world) if cores >= len(usable) else [tuple(usable[:cores])] * world)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "piper_nb.profile.time_slicing", path, str(d),
                               str(rounds), ",".join(map(str, placement[d] or ()))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for d in range(world)]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            _expect(p, "ready", deadline)
        alone = []
        for p in procs:   # one at a time: the others wait on their stdin
            _say(p, "alone")
            alone.append(float(_expect(p, "alone", deadline)))
        start = time.perf_counter() + 0.2   # one clock for every process on the machine
        for p in procs:
            _say(p, f"together {start} {start + _WINDOW}")
        answers = [_expect(p, "together", deadline).split() for p in procs]
        together = [float(a[0]) for a in answers]
        fair = world / cores
        ratios = [t / (a * fair) for a, t in zip(alone, together, strict=True) if a > 0 and t > 0]
        factor = statistics.fmean(ratios) if ratios else 1.0
        jitter = quantiles([float(x) for a in answers if len(a) > 1 for x in a[1].split(",")])
    except Exception as err:  # no result: no slicing cost, and say so
        warnings.warn(f"time-slicing profile failed ({err}); assuming none", stacklevel=2)
        factor, jitter = 1.0, ()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for s in (p.stdin, p.stdout, p.stderr):
                s.close()
        os.remove(path)
    return Slicing(max(factor, 1.0), jitter)


def _say(p, line: str) -> None:
    p.stdin.write(line + "\n")
    p.stdin.flush()


def _expect(p, word: str, deadline: float) -> str:
    """The device process's next line, which must start with `word`; raises by `deadline`
    (each process answers one line per command, so none waits in Python's buffer)."""
    if not select.select([p.stdout], [], [], max(deadline - time.monotonic(), 0.0))[0]:
        raise TimeoutError(f"a device process did not say {word!r} in time")
    line = p.stdout.readline()
    if not line.startswith(word):
        err = p.stderr.read() if p.poll() is not None else ""
        raise RuntimeError(f"device process said {line.strip()!r} instead of {word!r}"
                           + (f": {err.strip().splitlines()[-1]}" if err.strip() else ""))
    return line.split(maxsplit=1)[1] if " " in line.strip() else ""


def _round(bench, regions, updates, passes: dict | None = None) -> float:
    """One round of the device's passes; `passes` collects each one's time by (region,
    kind)."""
    t0 = time.perf_counter()
    for r in regions:
        got = bench.passes(r)
        if passes is not None:
            for kind, t in got.items():
                passes.setdefault((r, kind), []).append(t)
    for r in updates:
        bench.update(r)
    return time.perf_counter() - t0


def _device_main(path: str, device: int, rounds: int) -> None:
    """One device's process: build its worker, then answer "alone" and "together"."""
    import pickle

    import torch

    from piper_nb.profile.passes import _Bench
    torch.set_num_threads(1)
    with open(path, "rb") as f:
        blob, optimizer = pickle.load(f)
    from piper_nb.optim import SGD
    from piper_nb.runtime.bundle import load_bundle
    plan = load_bundle(blob).plan
    bench = _Bench(plan, device, optimizer if optimizer is not None else SGD(0.1), blob)
    mine = plan.devices[device].instrs
    regions = sorted({i.region for i in mine if i.kind == Op.F})
    updates = sorted({i.region for i in mine if i.kind == Op.U})
    _round(bench, regions, updates)   # warm up
    print("ready", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "alone":
            times = [_round(bench, regions, updates) for _ in range(rounds)]
            print("alone", statistics.median(times), flush=True)
        elif cmd == "together":
            start, stop = (float(x) for x in args)
            while time.perf_counter() < start:
                time.sleep(0.001)
            times, passes = [], {}
            while True:
                t = _round(bench, regions, updates, passes)
                if time.perf_counter() > stop:
                    break
                times.append(t)
            print("together", statistics.median(times) if times else t,
                  ",".join(f"{x:.5f}" for x in jitter_quantiles(passes)), flush=True)
            return


if __name__ == "__main__":  # a device process: PATH DEVICE ROUNDS CORES
    from piper_nb.host import pin_threads
    pin_threads(tuple(int(x) for x in sys.argv[4].split(",") if x))
    _device_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
