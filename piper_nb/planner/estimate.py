"""A candidate's step time and peak memory per device, in closed form from its TP class's
probe (`planner.probe`), without compiling it: how a search explores thousands.

- Stage times are the sums of their units' probe times at the candidate's microbatch size
  (`Probe.at`: between the two sizes probed); a recomputed layer's backward runs its
  forward again. The schedule's own grid is timed at the stage level (`planner.pipeline`),
  a hop between ranks costing the cost model's point-to-point time for a stage's input.
- Data parallelism adds what the backward cannot hide of the gradient reduction (an
  all-reduce, or a reduce-scatter under ZeRO), ZeRO-1/2's all-gather of the updated
  shards after the update, and ZeRO-3's gathers (each microbatch's forward and backward
  when it reshards, once a step under PP); then the update, its shard under ZeRO.
- Memory, per pipeline rank: parameters, gradients and optimizer state by ZeRO level
  (ZeRO-3 adds two gathered units), plus the activations the rank's own order of the grid
  holds at once (`pipeline.peaks`): stashes, the gradients a backward makes, a recomputed
  layer made again (a full backward frees each unit's stash as it passes, so a unit's
  transient adds to the stashes of the units before it only). `bound` is the floor a
  search prunes by first: model states and one microbatch's stash.
- Context parallelism: the probe of a CP class ran each unit on a device's share of the
  sequence with its ring's all-gathers and reduce-scatters; the replicas' collectives and
  ZeRO's shards span the replicas and their context groups (`Knobs.shards`).
- Expert parallelism (a MoE model's experts spread over each stage's replicas): the
  experts' states are divided by EP and left out of the reductions, ZeRO's shards and
  gathers; each MoE layer's passes wait for their dispatch and combine all-to-alls.

Stages are cut once per (TP class, stage count) on the class's larger probe (`Probe.cut`);
a candidate's `layout` is made once for its bound and its estimate. The
estimate ranks and prunes; the candidates a search keeps are compiled and simulated in full
(`planner.engine`), and their rows carry the simulator's figures.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from piper_nb.ir.kinds import Op
from piper_nb.planner.build import recomputes
from piper_nb.planner.knobs import Knobs, Schedule
from piper_nb.planner.pipeline import peaks, steps_of, timing

__all__ = ["Context", "Estimate", "Layout", "layout", "estimate", "bound", "step_floor",
           "micro_size"]


@dataclass(frozen=True)
class Context:
    """What every estimate of one search shares."""

    batch: int              # samples a step trains on
    links: object           # a CostModel whose `link_time` prices messages
    param_bytes: float | None
    grad_bytes: float | None
    optim_bytes: float      # per parameter element, masters included
    reduce_bytes: float     # per gradient element reduced


@dataclass(frozen=True)
class Estimate:
    step: float             # seconds (or the cost model's unit)
    bubble: float
    peak: float             # bytes, the rank that holds most
    stage_of: tuple[int, ...]


def micro_size(k: Knobs, ctx: Context) -> float:
    """Samples in one microbatch of candidate `k`."""
    return ctx.batch / (k.dp * k.microbatches)


@dataclass(frozen=True)
class Layout:
    """What a candidate's bound and estimate both start from: its units at its microbatch
    size, each unit's stage, each rank's units and the model states each rank holds."""

    units: tuple
    stage_of: tuple[int, ...]
    on_rank: list[list[int]]
    states: list[float]


def layout(k: Knobs, probe, ctx: Context) -> Layout:
    """Candidate `k`'s `Layout` from its TP class's `probe`."""
    units = probe.at(micro_size(k, ctx))
    stage_of = probe.cut(k.stages)
    if k.ep > 1:
        units = _all_to_all(k, units, stage_of, ctx)
    on_rank = _units_on(k, stage_of)
    return Layout(units, stage_of, on_rank, _states(k, units, ctx, on_rank))


def _all_to_all(k: Knobs, units, stage_of, ctx: Context) -> tuple:
    """The units of an EP candidate: each MoE layer's forward waits for its dispatch and
    combine all-to-alls over its stage's replicas, its backward for their duals."""
    out = []
    for i, u in enumerate(units):
        if u.dispatch or u.combine:
            r = k.rank_of(stage_of[i])
            group = tuple((rep * k.pp + r) * k.tp for rep in range(k.dp))
            t = (ctx.links.link_time(Op.ALL_TO_ALL, group, u.dispatch)
                 + ctx.links.link_time(Op.ALL_TO_ALL, group, u.combine))
            u = replace(u, f=u.f + t, b=u.b + t)
        out.append(u)
    return tuple(out)


def _units_on(k: Knobs, stage_of) -> list[list[int]]:
    out = [[] for _ in range(k.pp)]
    for i, s in enumerate(stage_of):
        out[k.rank_of(s)].append(i)
    return out


def _states(k: Knobs, units, ctx: Context, on_rank) -> list[float]:
    """Parameter, gradient and optimizer bytes on one device of each rank."""
    out = []
    for mine in on_rank:
        n, pbytes = _replicated(k, units, mine)
        pb = ctx.param_bytes * n if ctx.param_bytes is not None else pbytes
        gb = ctx.grad_bytes * n if ctx.grad_bytes is not None else pbytes
        shards = k.shards   # ZeRO shards over the replicas and their context groups
        total = (pb / (shards if k.zero == 3 else 1) + gb / (shards if k.zero >= 2 else 1)
                 + ctx.optim_bytes * n / (shards if k.zero >= 1 else 1))
        if k.ep > 1:   # the experts, spread over the replicas, neither reduced nor sharded
            ne = sum(units[i].expert_params for i in mine)
            ebytes = sum(units[i].expert_param_bytes for i in mine)
            total += ((ctx.param_bytes * ne if ctx.param_bytes is not None else ebytes)
                      + (ctx.grad_bytes * ne if ctx.grad_bytes is not None else ebytes)
                      + ctx.optim_bytes * ne) / k.ep
        if k.zero == 3 and shards > 1 and mine:
            if k.pp > 1:   # gathered once a step and kept, gradients reduced once (build)
                total += pbytes + gb - gb / shards
            else:          # gathered, prefetched
                total += 2 * max(_replicated(k, units, [i])[1] for i in mine)
        out.append(total)
    return out


def _replicated(k: Knobs, units, mine) -> tuple[int, int]:
    """(elements, bytes) of the parameters on units `mine` that the replicas hold alike
    (all of them, but the experts under EP)."""
    if k.ep > 1:
        return (sum(units[i].params - units[i].expert_params for i in mine),
                sum(units[i].param_bytes - units[i].expert_param_bytes for i in mine))
    return sum(units[i].params for i in mine), sum(units[i].param_bytes for i in mine)


def _update(k: Knobs, units, mine) -> float:
    """The update's time on one device of a rank holding units `mine`: a ZeRO shard of the
    replicated parameters', an EP share of the experts'."""
    t = 0.0
    for i in mine:
        u = units[i]
        share = u.expert_params / u.params if k.ep > 1 and u.params else 0.0
        t += u.u * ((1 - share) / (k.shards if k.zero >= 1 else 1) + share / k.ep)
    return t


def bound(k: Knobs, lay: Layout) -> float:
    """A floor on the peak: model states plus one microbatch's stash, on the heaviest rank."""
    units, stage_of, n = lay.units, lay.stage_of, len(lay.units)
    return max(st + sum(units[i].inputs if recomputes(k, stage_of[i], i, n)
                        else units[i].saved for i in mine)
               for st, mine in zip(lay.states, lay.on_rank, strict=True))


def step_floor(k: Knobs, lay: Layout) -> float:
    """A floor on the estimated step, without timing the grid: the busiest rank's passes
    over every microbatch, or the last stage's after the first microbatch's forward has
    reached it (whichever is longer), then the slowest update. Bubbles and collectives only
    add to it (`tests/planner/test_search_spread.py` checks it against `estimate`)."""
    units, stage_of = lay.units, lay.stage_of
    n, last = len(units), k.stages - 1
    work = [0.0] * k.stages
    reach = 0.0
    for i, u in enumerate(units):
        s = stage_of[i]
        work[s] += u.f + u.b + (u.f if recomputes(k, s, i, n) else 0.0)
        if s < last:
            reach += u.f
    busy = [0.0] * k.pp
    for s, t in enumerate(work):
        busy[k.rank_of(s)] += t
    m = k.microbatches
    return (max(m * max(busy), reach + m * work[last])
            + max(_update(k, units, mine) for mine in lay.on_rank))


def estimate(k: Knobs, lay: Layout, ctx: Context) -> Estimate:
    """Candidate `k`'s step, bubble and peak from its `Layout` (timed whatever the peak:
    the search draws refused candidates too)."""
    units, stage_of, on_rank = lay.units, lay.stage_of, lay.on_rank
    n = len(units)
    f, b, w = [0.0] * k.stages, [0.0] * k.stages, [0.0] * k.stages
    act, extra, again = [0.0] * k.stages, [0.0] * k.stages, [0.0] * k.stages
    freed = k.schedule not in (Schedule.ZB1P, Schedule.DUALPIPEV)
    for i, u in enumerate(units):
        s = stage_of[i]
        f[s] += u.f
        b[s] += u.b
        w[s] += u.w
        # a backward's transient: the gradients of what it saved, about as large, and a
        # recomputed layer's stash made again besides; a full backward runs the stage's
        # units last first, each freeing its stash as it goes, so a unit's transient adds
        # to the stashes of the units before it only (a split one keeps them for BW)
        if recomputes(k, s, i, n):
            b[s] += u.f
            act[s] += u.inputs
            extra[s] = max(extra[s] - freed * u.inputs, 2 * u.saved)
            again[s] += u.saved
        else:
            act[s] += u.saved
            extra[s] = max(extra[s] - freed * u.saved, u.saved)
    if k.schedule is Schedule.NONE:   # one microbatch at a time; with EP's all-to-alls
        # the compile runs every forward before the backwards (GPipe's order)
        held = ((k.microbatches if k.ep > 1 else 1) * act[0] + extra[0],)
    else:
        held = _peaks(k.schedule, k.pp, k.microbatches, tuple(act), tuple(extra), tuple(again))
    peak = max(st + h for st, h in zip(lay.states, held, strict=True))
    if k.schedule is Schedule.NONE:
        step = (f[0] + b[0]) * k.microbatches
        busy = (step,)
    else:
        first = _firsts(stage_of, k.stages)
        hop_bytes = max((units[first[s]].inputs for s in range(1, k.stages)), default=0.0)
        hop = ctx.links.link_time("p2p", (0, k.tp * k.cp if k.pp > 1 else 0), hop_bytes)
        step, busy = _timing(k.schedule, k.pp, k.microbatches, tuple(f), tuple(b), tuple(w),
                             hop)
    step += _data_parallel(k, units, ctx, on_rank, b, stage_of)
    step += max(_update(k, units, mine) for mine in on_rank)
    bubble = 1 - sum(busy) / len(busy) / step if step > 0 else 0.0
    return Estimate(step, bubble, peak, stage_of)


# the grid's timing and peaks do not depend on the ZeRO level: candidates that differ only
# there (neighbours in the space's order) share them
@functools.lru_cache(maxsize=1 << 12)
def _timing(schedule: Schedule, pp: int, m: int, f, b, w, hop: float):
    return timing(steps_of(schedule, pp, m), f, b, w, hop)


@functools.lru_cache(maxsize=1 << 12)
def _peaks(schedule: Schedule, pp: int, m: int, act, extra, again):
    return peaks(steps_of(schedule, pp, m), act, extra, again)


@functools.lru_cache(maxsize=1 << 12)
def _firsts(stage_of: tuple[int, ...], stages: int) -> tuple[int, ...]:
    """Each stage's first unit."""
    return tuple(stage_of.index(s) for s in range(stages))


def _data_parallel(k: Knobs, units, ctx: Context, on_rank, b, stage_of) -> float:
    """What a step waits for of the replicas' collectives, on the slowest rank.

    Reductions once a step (ZeRO 0-1) hide behind the last backward but for the last
    unit's share; ZeRO-2's, one after each microbatch's backward, behind that backward.
    ZeRO-3 gathers behind half a backward: once a step under PP, before every forward and
    backward without it. Under TP as well, ZeRO-3 without PP
    hides next to nothing: each TP part of a layer (a norm, the attention, the MLP) is
    gathered when it is next, behind the short part before it, a recomputed layer's parts
    again before their second forward, and each reduction is waited for before the next
    is issued, so every gather and reduction is charged whole (Llama 70B's shape, TP 2 x
    DP 64 on 128 H100s, simulated: within 2%; hidden as without TP, 0.54). Under CP, whose
    layers are cut into parts at their attentions, alike. The replica group is a stage's
    replicas and their context groups (`Knobs.shards`)."""
    if k.shards == 1:
        return 0.0
    worst = 0.0
    link = ctx.links.link_time
    n_units = len(units)
    for r, mine in enumerate(on_rank):
        if not mine:
            continue
        group = tuple(((rep * k.pp + r) * k.cp + c) * k.tp for rep in range(k.dp)
                      for c in range(k.cp))
        n, pbytes = _replicated(k, units, mine)
        backward = sum(b[s] for s in {stage_of[i] for i in mine})
        last = 1 / len(mine)
        kind = Op.ALL_REDUCE if k.zero == 0 else Op.REDUCE_SCATTER
        sync = link(kind, group, n * ctx.reduce_bytes)
        each = link(Op.ALL_GATHER, group, pbytes)
        if k.zero == 3 and k.pp == 1 and (k.tp > 1 or k.cp > 1):
            again = sum(_replicated(k, units, [i])[1] for i in mine
                    if recomputes(k, stage_of[i], i, n_units)) / max(pbytes, 1)
            worst = max(worst, k.microbatches * (sync + each * (2 + again)))
            continue
        syncs = k.microbatches if k.zero == 2 else 1   # ZeRO-2: one after each backward
        waited = max(syncs * (sync - backward), sync * last)
        if k.zero in (1, 2):
            waited += each
        elif k.zero == 3:
            gathers = 2 * k.microbatches if k.pp == 1 else 1
            waited += max((each - backward / 2) * gathers, each * last)
        worst = max(worst, waited)
    return worst
