"""A stage-level timing of one schedule: how long its grid takes when each stage's
forward, backward and weight-gradient times are known, and the activation bytes each rank
holds at its highest.

The grid is the schedule builder's own (`pn.schedules.*_grid`), so a search times the very
order it would compile. Each rank runs its slots in order; an action waits for its rank
and for what it reads: a forward for the previous stage's forward of its microbatch, a
backward (B or BI) for its own forward and the next stage's backward, a BW for its BI; a
message between two ranks adds `hop`. An overlapped slot runs its actions one after
another. A forward's stash is held from its start until the backward that ends it (B, or
BW when split); what a rank holds depends only on its own order, so `peaks` needs no
times and a search refuses on memory before it times anything.

`Steps` is a grid made ready once per (schedule, ranks, microbatches): actions numbered,
each with its stage, kind and the actions it waits for.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op
from piper_nb.planner.knobs import Schedule, stage_rank

__all__ = ["Steps", "steps_of", "grid_of", "peaks", "timing"]

F, B, BI, BW = 0, 1, 2, 3
_KIND = {Op.F: F, Op.B: B, Op.BI: BI, Op.BW: BW}


def grid_of(schedule: Schedule, pp: int, m: int):
    """The schedule's grid (one row of slots per rank); stage/pass/microbatch triples."""
    import piper_nb.schedules as s
    build = {Schedule.GPIPE: s.gpipe_grid, Schedule.ONE_F_ONE_B: s.one_f_one_b_grid,
             Schedule.ZB1P: s.zero_bubble_grid, Schedule.DUALPIPEV: s.dualpipev_grid,
             Schedule.INTERLEAVED: lambda p, n: s.interleaved_1f1b_grid(p, n, 2)}[schedule]
    return tuple(tuple(tuple((a.stage, a.pass_, a.mb) for a in slot) for slot in row)
                 for row in build(pp, m))


@dataclass(frozen=True)
class Steps:
    """A grid with numbered actions: per rank, its slots as tuples of action ids;
    per action its stage, kind, and (action, crosses ranks) pairs it waits for."""

    rows: tuple[tuple[tuple[int, ...], ...], ...]
    stage: tuple[int, ...]
    kind: tuple[int, ...]
    deps: tuple[tuple[tuple[int, bool], ...], ...]


@functools.lru_cache(maxsize=512)
def steps_of(schedule: Schedule, pp: int, m: int) -> Steps:
    grid = grid_of(schedule, pp, m)
    rank_of = functools.partial(stage_rank, schedule, pp)
    ids: dict = {}
    for row in grid:
        for slot in row:
            for a in slot:
                ids[a] = len(ids)
    stages = 1 + max(a[0] for a in ids)
    deps = []
    for s, p, mb in ids:
        want = []
        if p == Op.F and s > 0:
            want.append((s - 1, Op.F, mb))
        elif p in (Op.B, Op.BI):
            want.append((s, Op.F, mb))
            if s < stages - 1:
                want.append((s + 1, Op.B, mb) if (s + 1, Op.B, mb) in ids else (s + 1, Op.BI, mb))
        elif p == Op.BW:
            want.append((s, Op.BI, mb))
        deps.append(tuple((ids[d], rank_of(d[0]) != rank_of(s)) for d in want))
    return Steps(tuple(tuple(tuple(ids[a] for a in slot) for slot in row) for row in grid),
                 tuple(a[0] for a in ids), tuple(_KIND[a[1]] for a in ids), tuple(deps))


def peaks(steps: Steps, act, extra, again) -> tuple[float, ...]:
    """Highest bytes each rank holds: stashes `act[s]` from F to B (or BW), what a split
    backward's BI makes again (`again[s]`) until its BW, and `extra[s]` while a backward
    of stage s runs (its gradients, a recomputed layer's stash)."""
    out = []
    stage, kind = steps.stage, steps.kind
    for row in steps.rows:
        live = top = 0.0
        for slot in row:
            for a in slot:
                s, k = stage[a], kind[a]
                if k == F:
                    live += act[s]
                    top = max(top, live)
                elif k == B:
                    top = max(top, live + extra[s])
                    live -= act[s]
                elif k == BI:
                    live += again[s]
                    top = max(top, live + extra[s])
                else:
                    live -= act[s] + again[s]
        out.append(top)
    return tuple(out)


def timing(steps: Steps, f, b, w, hop: float) -> tuple[float, tuple[float, ...]]:
    """(step, compute time per rank) of the grid with per-stage forward `f`, full backward
    `b` (BI = b - w) and weight gradient `w`; a message between ranks costs `hop`."""
    stage, kind, deps = steps.stage, steps.kind, steps.deps
    took = [f[s] if k == F else b[s] if k == B else b[s] - w[s] if k == BI else w[s]
            for s, k in zip(stage, kind, strict=True)]
    end = [-1.0] * len(stage)
    rows = steps.rows
    ranks = len(rows)
    clock, busy, pos = [0.0] * ranks, [0.0] * ranks, [0] * ranks
    left = sum(len(r) for r in rows)
    while left:
        progressed = False
        for r in range(ranks):
            row, i, t = rows[r], pos[r], clock[r]
            while i < len(row):
                slot = row[i]
                start = t
                for a in slot:
                    for d, cross in deps[a]:
                        e = end[d]
                        if e < 0:
                            break
                        if cross:
                            e += hop
                        if e > start:
                            start = e
                    else:
                        continue
                    break
                else:
                    for a in slot:
                        start += took[a]
                        busy[r] += took[a]
                        end[a] = start
                    t = start
                    i += 1
                    continue
                break
            if i != pos[r]:
                left -= i - pos[r]
                pos[r], clock[r] = i, t
                progressed = True
        if not progressed:
            raise PlanError("pn.search: a schedule grid did not finish (a cycle in its order)")
    return max(clock), tuple(busy)
