"""A search's explore tier: every candidate bounded and estimated from its TP class's probe.

First each TP class the candidates need is probed (`planner.probe`, one compile per
class); then each candidate is bounded (model states and one microbatch's stash: over the
capacity, refused), estimated (`planner.estimate`), and refused when the estimated peak is
over the capacity by more than the estimate's margin. Under the analytic cost model the
probes, and the estimates of a large space in chunks, run on every core
(`planner.spread`); the rows come back in the candidates' order either way.

Ctrl-C, or the progress callable's stop, keeps what is done: while probing, the candidates
of the classes already probed are estimated; while estimating, the chunks already done.
"""

from __future__ import annotations

import time
from dataclasses import replace

from piper_nb.errors import PlanError
from piper_nb.planner.estimate import Context, bound, estimate, layout, step_floor
from piper_nb.planner.knobs import Knobs
from piper_nb.planner.probe import Probe, probe
from piper_nb.planner.progress import Stop, bar
from piper_nb.planner.result import GIB, Candidate, Status
from piper_nb.planner.spread import spread

__all__ = ["explore", "probe_sizes", "rate", "ESTIMATE_MARGIN"]

# the estimate's peak ran 0.82-1.38x the memory model's over 40 candidates of a 1 B-class
# Llama on 16 H100s, 0.98-1.86x over 12 EP candidates of a Mixtral-shaped MoE, 0.81-1.45x
# over 12 CP candidates at 32k tokens (benchmarks/bench_search.py, cases accuracy,
# accuracy-moe and accuracy-cp): a candidate is refused by estimate only beyond this, so
# none that fits is; the memory model decides the rest
ESTIMATE_MARGIN = 1.9
CHUNK = 256        # candidates a worker estimates per task
SPREAD_AT = 1024   # fewer candidates are estimated in the caller (a fork costs more)
SLOW_PROBE = 1.0   # seconds: a model probed faster has its other classes probed here too


def explore(setup, candidates: list[Knobs], ctx: Context, capacity: float, devices: int,
            progress, seconds: dict, jobs: int, top: int):
    """The kept (row, stage cut) pairs, the refused rows, and whether the user interrupted
    (`top`: how many the search verifies; see `_Front`). Adds the probing's wall seconds
    to `seconds["probe"]`."""
    t0 = time.perf_counter()
    probes, interrupted = _probe_all(setup, candidates, progress, jobs)
    seconds["probe"] += time.perf_counter() - t0
    links = next((p.links for p in probes.values() if p.error is None), None)
    ctx = replace(ctx, links=links) if ctx.links is None else ctx
    if interrupted:
        candidates = [k for k in candidates if _key(k) in probes]
    shared = (setup, candidates, probes, ctx, capacity, devices, top)
    progress_bar = bar(len(candidates), progress, "exploring")
    chunks = [(lo, min(lo + CHUNK, len(candidates))) for lo in range(0, len(candidates), CHUNK)]
    kept, refused = [], []
    try:
        if jobs > 1 and len(candidates) >= SPREAD_AT:
            with spread(_estimate_chunk, shared, chunks, jobs) as done:
                for (lo, hi), (k, r, stopped) in zip(chunks, done, strict=False):
                    kept += k
                    refused += r
                    progress_bar.update(hi - lo)
                    if stopped:
                        raise Stop
        else:   # chunk by chunk too, so that the same candidates are pruned
            for lo, hi in chunks:
                k, r, stopped = _estimate_all(shared, candidates[lo:hi], progress_bar)
                kept += k
                refused += r
                if stopped:
                    raise Stop
    except (KeyboardInterrupt, Stop):
        interrupted = True
    finally:
        progress_bar.close()
    return kept, refused, interrupted


def probe_sizes(candidates: list[Knobs], samples: int) -> dict[tuple, tuple[int, ...]]:
    """Per (TP, CP) degrees, the smallest and the largest microbatch their candidates use."""
    out: dict[tuple, set] = {}
    for k in candidates:
        out.setdefault((k.tp, k.cp), set()).add(samples // (k.dp * k.microbatches))
    return {tc: tuple(sorted({min(s), max(s)})) for tc, s in out.items()}


def rate(tokens: int, step: float, devices: int) -> float:
    """Tokens per second per device."""
    return tokens / step / devices if step > 0 else 0.0


def _key(k: Knobs) -> tuple:
    return (k.tp, k.sp, k.float8, k.cp)


def _probe_all(setup, candidates: list[Knobs], progress, jobs: int):
    """Each class's probe ({(tp, sp, float8, cp): Probe}), and whether the user interrupted.
    The model's own class (TP 1, no Float8) goes first, in this process: its failing is a
    PlanError (no candidate could compile), and its time says whether the other classes
    are worth spreading over processes (`SLOW_PROBE`)."""
    sizes = probe_sizes(candidates, setup.batch.size)
    own = (1, False, False, 1)
    classes = sorted({_key(k) for k in candidates}, key=lambda c: (c != own, -c[0], -c[1], c))
    shared = (setup, setup.unit_spec(), sizes)
    probes: dict[tuple, Probe] = {}
    progress_bar = bar(len(classes), progress, "probing")
    try:
        for c in classes:
            if jobs > 1 and len(classes) - len(probes) > 1 and probes and all(
                    p.seconds > SLOW_PROBE for p in probes.values()):
                break
            probes[c] = _probe_class(shared, c)
            progress_bar.update(1)
            _check_own(probes.get(own))
        rest = classes[len(probes):]
        if rest:
            with spread(_probe_class, shared, rest, min(jobs, len(rest))) as done:
                for c, p in zip(rest, done, strict=True):
                    probes[c] = p
                    progress_bar.update(1)
    except (KeyboardInterrupt, Stop):
        return probes, True
    finally:
        progress_bar.close()
    return probes, False


def _check_own(p: Probe | None) -> None:
    if p is not None and p.error is not None:
        raise PlanError(f"pn.search: the model does not compile on this batch (one device, "
                        f"{p.rows[0]} samples): {p.error}; check that the batch is what the "
                        "model's forward and loss take")


def _probe_class(shared, c: tuple) -> Probe:
    setup, unit_spec, sizes = shared
    tp, sp, float8, cp = c
    return probe(unit_spec, setup.units, setup.batch, sizes[tp, cp], tp, sp, setup.price,
                 precision=setup.precision, loss_fn=setup.loss_fn, capture=setup.capture,
                 float8=float8, cp=cp, loss_mean=setup.loss_mean)


def _estimate_chunk(shared, span: tuple[int, int]):
    return _estimate_all(shared, shared[1][span[0]:span[1]], None)


def _estimate_all(shared, candidates: list[Knobs], progress_bar):
    """Bound and estimate `candidates` (`progress_bar` updated per candidate, or None):
    kept, refused, and whether it stopped early (Ctrl-C, or the progress callable). A
    candidate dominated by `top` estimated ones that fit (`_Front`) is refused unestimated."""
    setup, _, probes, ctx, capacity, devices, top = shared
    kept, refused, front = [], [], _Front(top)
    try:
        for k in candidates:
            if progress_bar is not None:
                progress_bar.update(1)
            p = probes[_key(k)]
            if p.error is not None:
                refused.append(Candidate(k, Status.REFUSED, reason=f"compile: {p.error}"))
                continue
            lay = layout(k, p, ctx)
            floor = bound(k, lay)
            if floor > capacity:
                refused.append(Candidate(k, Status.REFUSED, peak=floor, reason=(
                    f"memory bound: {floor / GIB:.1f} GiB > {capacity / GIB:.1f} GiB")))
                continue
            least = step_floor(k, lay)
            better = front.beating(least, floor)
            if better is not None:
                refused.append(Candidate(k, Status.REFUSED, reason=(
                    f"dominated: at least {least:.4g} s a step and {floor / GIB:.1f} GiB; "
                    f"{front.top} that fit are estimated as fast and as light, "
                    f"{better.knobs.label()} at {better.step:.4g} s and "
                    f"{better.peak / GIB:.1f} GiB")))
                continue
            est = estimate(k, lay, ctx)   # timed even when refused: the frontier draws it
            if est.peak > capacity * ESTIMATE_MARGIN:
                refused.append(Candidate(k, Status.REFUSED, est.step, peak=est.peak, reason=(
                    f"memory estimate: {est.peak / GIB:.1f} GiB > {ESTIMATE_MARGIN} x "
                    f"{capacity / GIB:.1f} GiB")))
                continue
            row = Candidate(k, Status.ESTIMATED, est.step, rate(setup.tokens, est.step, devices),
                            est.bubble, est.peak)
            kept.append((row, est.stage_of))
            if est.peak <= capacity:
                front.add(row)
    except (KeyboardInterrupt, Stop):
        return kept, refused, True
    return kept, refused, False


class _Front:
    """The estimated candidates that fit, to prune by: a candidate is dominated when at
    least `top` of them are as fast as its step floor and as light as its memory floor
    (it can then be neither among the `top` fastest nor on the step-memory frontier)."""

    def __init__(self, top: int):
        self.top, self.rows = top, []

    def beating(self, step: float, peak: float) -> Candidate | None:
        """The fastest of `top` rows at least as fast and as light as (`step`, `peak`), or
        None when fewer are."""
        found = [c for c in self.rows if c.step <= step and c.peak <= peak]
        return min(found, key=lambda c: c.step) if len(found) >= self.top else None

    def add(self, row: Candidate) -> None:
        self.rows.append(row)
