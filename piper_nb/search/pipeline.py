"""A stage-level timing of one schedule: how long its grid takes when each stage's
forward, backward and weight-gradient times are known, and the activation bytes each rank
holds at its highest.

The grid is the schedule builder's own (`pn.schedules.*_grid`), so a search times the very
order it would compile. Each rank runs its slots in order; an action waits for its rank
and for what it reads: a forward for the previous stage's forward of its microbatch, a
backward (B or BI) for its own forward and the next stage's backward, a BW for its BI; a
message between two ranks adds `hop`. An overlapped slot runs its actions one after
another. A forward's stash is held from its start until the backward that ends it (B, or
BW when split).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.search.knobs import Schedule

__all__ = ["Timing", "grid_of", "time_grid"]


@dataclass(frozen=True)
class Timing:
    step: float                  # the last action's end
    busy: tuple[float, ...]      # compute time per rank
    peak: tuple[float, ...]      # highest activation bytes held per rank


@functools.lru_cache(maxsize=512)
def grid_of(schedule: Schedule, pp: int, m: int):
    """The schedule's grid (one row of slots per rank); stage/pass/microbatch triples."""
    import piper_nb.schedules as s
    build = {Schedule.GPIPE: s.gpipe_grid, Schedule.ONE_F_ONE_B: s.one_f_one_b_grid,
             Schedule.ZB1P: s.zero_bubble_grid, Schedule.DUALPIPEV: s.dualpipev_grid,
             Schedule.INTERLEAVED: lambda p, n: s.interleaved_1f1b_grid(p, n, 2)}[schedule]
    return tuple(tuple(tuple((a.stage, a.pass_, a.mb) for a in slot) for slot in row)
                 for row in build(pp, m))


def time_grid(grid, rank_of, f, b, w, act, hop: float, extra=None, again=None) -> Timing:
    """Time `grid` with per-stage forward `f`, full backward `b` (BI = b - w), weight
    gradient `w`, and stash bytes `act`; `extra[s]` is a transient held while stage s runs
    a backward (gradients, a recomputed layer's stash), `again[s]` what a split backward's BI
    makes again and holds until its BW (every recomputed layer's stash)."""
    stages = len(f)
    done: dict = {}
    ranks = len(grid)
    clock = [0.0] * ranks
    busy = [0.0] * ranks
    live = [0.0] * ranks
    peak = [0.0] * ranks
    pos = [0] * ranks
    left = sum(len(r) for r in grid)
    extra = extra or [0.0] * stages
    again = again or [0.0] * stages

    def ready(r: int, a) -> float | None:
        s, p, mb = a
        deps = []
        if p == "F":
            if s > 0:
                deps.append((s - 1, "F", mb))
        elif p in ("B", "BI"):
            deps.append((s, "F", mb))
            if s < stages - 1:
                nxt = (s + 1, "B", mb) if (s + 1, "B", mb) in done else (s + 1, "BI", mb)
                deps.append(nxt)
        else:
            deps.append((s, "BI", mb))
        t = clock[r]
        for d in deps:
            if d not in done:
                return None
            at = done[d]
            if d[0] != s and rank_of(d[0]) != r:
                at += hop
            t = max(t, at)
        return t

    while left:
        progressed = False
        for r in range(ranks):
            row = grid[r]
            while pos[r] < len(row):
                slot = row[pos[r]]
                starts = [ready(r, a) for a in slot]
                if any(x is None for x in starts):
                    break
                t = max(starts)
                for s, p, mb in slot:
                    took = f[s] if p == "F" else w[s] if p == "BW" else (
                        b[s] - w[s] if p == "BI" else b[s])
                    if p == "F":
                        live[r] += act[s]
                        peak[r] = max(peak[r], live[r])
                    elif p == "B":
                        peak[r] = max(peak[r], live[r] + extra[s])
                    elif p == "BI":
                        live[r] += again[s]
                        peak[r] = max(peak[r], live[r] + extra[s])
                    if p == "B":
                        live[r] -= act[s]
                    elif p == "BW":
                        live[r] -= act[s] + again[s]
                    t += took
                    busy[r] += took
                    done[(s, p, mb)] = t
                clock[r] = t
                pos[r] += 1
                left -= 1
                progressed = True
        if not progressed:
            raise PlanError("pn.search: a schedule grid did not finish (a cycle in its order)")
    return Timing(max(clock), tuple(busy), tuple(peak))
