"""What time-slicing costs, in the simulator: how much slower than its fair share a pass
runs when its core is shared with other worker processes.

With more worker processes than cores (4 ranks on 2 cores), the OS time-slices: each
process gets its share of a core, and on top of that loses time refilling the caches the
others evicted and migrating between cores. The simulator's processor sharing gives a pass
running alongside k-1 others on one core k times its time; `slicing_slowdown` adds the rest
from a measured `factor`. The mean hides the shape, which matters wherever devices wait
for each other: together, a pass mostly runs at full speed, and about one in six waits out
other processes' slices, 2-25x its usual time (4 processes on 2 cores). `jitter` keeps that
shape, as quantiles of each pass's time over its own median; the simulator draws from it.
`profile.time_slicing` measures both, by running one process per device.
"""

from __future__ import annotations

import statistics
from typing import NamedTuple

__all__ = ["Slicing", "slicing_slowdown", "jitter_quantiles", "quantiles", "JITTER_POINTS"]

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


def jitter_quantiles(samples: dict, n: int = JITTER_POINTS) -> tuple[float, ...]:
    """`n` evenly spaced quantiles (midpoints) of every sample over its own pass's median:
    how much longer than usual a pass runs when a slice of it went to another process."""
    return quantiles([t / m for times in samples.values() if len(times) > 2
                       for m in [statistics.median(times)] if m > 0 for t in times], n)


def quantiles(values: list[float], n: int = JITTER_POINTS) -> tuple[float, ...]:
    """`n` quantiles of `values` at the midpoints (k + 1/2) / n; () for none."""
    values = sorted(values)
    return tuple(values[min(int((k + 0.5) / n * len(values)), len(values) - 1)]
                 for k in range(n)) if values else ()
