"""What time-slicing costs: how much slower than its fair share a pass runs when its core is
shared with other worker processes.

With more worker processes than cores (4 ranks on 2 cores), the OS time-slices: each
process gets its share of a core, and on top of that loses time refilling the caches the
others evicted and migrating between cores. The simulator's processor sharing gives a pass
running alongside k-1 others on one core k times its time; this factor is the rest.

`profile_slicing(plan)` measures it the way `LocalCluster(plan.world)` will run: one process
per device, placed as the cluster places its workers, each with the device's own regions
(a `runtime.worker.Worker` built from the plan's shipped bundle, passes as in `profile`).
First each process times rounds of its passes alone, the others waiting; then all run
rounds at once for a fixed window. The factor is the mean, over devices, of (time per round
together) / (time per round alone x processes / cores). On this 2-core machine it comes
out at 1.05-1.12 for 4 processes.

The mean hides the shape, which matters wherever devices wait for each other: together,
a pass mostly runs at full speed, and about one in six waits out other processes' slices,
2-25x its usual time (4 processes on 2 cores). `jitter` keeps that shape, as quantiles of
each pass's time over its own median; the simulator draws from it.
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
from typing import NamedTuple

__all__ = ["Slicing", "profile_slicing", "slicing_slowdown", "jitter_quantiles"]

_WINDOW = 1.5   # seconds all processes run together
JITTER_POINTS = 64   # quantiles kept of a pass's time over its median, all running together


def slicing_slowdown(load: float, factor: float) -> float:
    """Slowdown of a pass at processor-sharing `load` (runnable tasks per core): its share,
    `max(1, load)`, times the time-slicing `factor`, which phases in as the load goes from
    one task per core (no slicing) to two (every core sliced)."""
    if load <= 1.0:
        return 1.0
    return load * (1.0 + (factor - 1.0) * min(load - 1.0, 1.0))


class Slicing(NamedTuple):
    """What time-slicing costs: `factor` on the mean, and `jitter`, quantiles of a pass's
    time over its usual (median) time while all devices run."""

    factor: float
    jitter: tuple[float, ...] = ()


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
    procs = [subprocess.Popen([sys.executable, "-m", "piper_nb.sim.slicing", path, str(d),
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
        jitter = _quantiles([float(x) for a in answers if len(a) > 1 for x in a[1].split(",")])
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


def jitter_quantiles(samples: dict, n: int = JITTER_POINTS) -> tuple[float, ...]:
    """`n` evenly spaced quantiles (midpoints) of every sample over its own pass's median:
    how much longer than usual a pass runs when a slice of it went to another process."""
    return _quantiles([t / m for times in samples.values() if len(times) > 2
                       for m in [statistics.median(times)] if m > 0 for t in times], n)


def _quantiles(values: list[float], n: int = JITTER_POINTS) -> tuple[float, ...]:
    """`n` quantiles of `values` at the midpoints (k + 1/2) / n; () for none."""
    values = sorted(values)
    return tuple(values[min(int((k + 0.5) / n * len(values)), len(values) - 1)]
                 for k in range(n)) if values else ()


def _device_main(path: str, device: int, rounds: int) -> None:
    """One device's process: build its worker, then answer "alone" and "together"."""
    import pickle

    import torch

    from piper_nb.sim.profile import _Bench
    torch.set_num_threads(1)
    with open(path, "rb") as f:
        blob, optimizer = pickle.load(f)
    from piper_nb.optim import SGD
    from piper_nb.runtime.bundle import load_bundle
    plan = load_bundle(blob).plan
    bench = _Bench(plan, device, optimizer if optimizer is not None else SGD(0.1), blob)
    mine = plan.devices[device].instrs
    regions = sorted({i.region for i in mine if i.kind == "F"})
    updates = sorted({i.region for i in mine if i.kind == "U"})
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
