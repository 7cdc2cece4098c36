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

__all__ = ["profile_slicing", "slicing_slowdown"]

_WINDOW = 1.5   # seconds all processes run together


def slicing_slowdown(load: float, factor: float) -> float:
    """Slowdown of a pass at processor-sharing `load` (runnable tasks per core): its share,
    `max(1, load)`, times the time-slicing `factor`, which phases in as the load goes from
    one task per core (no slicing) to two (every core sliced)."""
    if load <= 1.0:
        return 1.0
    return load * (1.0 + (factor - 1.0) * min(load - 1.0, 1.0))


def profile_slicing(plan, optimizer=None, rounds: int = 10, timeout: float = 180.0,
                    cores: int | None = None) -> float:
    """The time-slicing factor for `plan` on local CPU workers (1.0 when every device gets
    a core of its own); `cores` (default: all this process may use) restricts the device
    processes to the first that many. On failure a warning names the reason and 1.0 is
    assumed."""
    from piper_nb.runtime.bundle import make_bundle
    from piper_nb.runtime.process import core_plan, usable_cores
    usable = usable_cores()
    cores = cores or len(usable)
    world = plan.world
    if world <= cores:
        return 1.0
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
        together = [float(_expect(p, "together", deadline)) for p in procs]
        fair = world / cores
        ratios = [t / (a * fair) for a, t in zip(alone, together, strict=True) if a > 0 and t > 0]
        factor = statistics.fmean(ratios) if ratios else 1.0
    except Exception as err:  # no result: no slicing cost, and say so
        warnings.warn(f"time-slicing profile failed ({err}); assuming none", stacklevel=2)
        factor = 1.0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for s in (p.stdin, p.stdout, p.stderr):
                s.close()
        os.remove(path)
    return max(factor, 1.0)


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


def _round(bench, regions, updates) -> float:
    t0 = time.perf_counter()
    for r in regions:
        bench.passes(r)
    for r in updates:
        bench.update(r)
    return time.perf_counter() - t0


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
            times = []
            while True:
                t = _round(bench, regions, updates)
                if time.perf_counter() > stop:
                    break
                times.append(t)
            print("together", statistics.median(times) if times else t, flush=True)
            return


if __name__ == "__main__":  # a device process: PATH DEVICE ROUNDS CORES
    from piper_nb.runtime.process import pin_threads
    pin_threads(tuple(int(x) for x in sys.argv[4].split(",") if x))
    _device_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
