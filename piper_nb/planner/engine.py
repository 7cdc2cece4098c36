"""`pn.search`: every plan that fits, ranked by predicted step time, checked and runnable.

The loop (see `search`):

1. The space (`planner.knobs.space`): PP x TP x DP = devices, ZeRO, schedule, microbatches,
   recompute (by rank, one layer in k), SP, Float8 when pinned, EP for a MoE model, less
   what the user pins.
   An empty space is a PlanError that says which rule emptied it.
2. Explore (`planner.explore`): each candidate is bounded (model states and one
   microbatch's stash; over the capacity: refused), then estimated from its TP class's
   probe (`planner.probe`, one compile per class), and refused when the estimated peak is
   over the capacity; one that `top` estimated candidates beat on its step and memory
   floors is refused before its estimate (dominated). Under the analytic cost model the
   probes and the estimates run on every core (`planner.spread`).
3. Verify: the fastest estimates are compiled (`pn.compile`: the static checks, deadlock
   and NCCL order among them) and simulated with the same cost model and the memory model,
   until `top` fit; a compile error or a simulated peak over the capacity refuses one.
   Those are the ranked rows, each with its annotation and program.

Progress is a tqdm bar (terminal or notebook), or a callable `progress(phase, done, total)`
(the Designer's Search tab) whose True return asks the search to stop; Ctrl-C
(KeyboardInterrupt) and that stop both return what the search has, marked interrupted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from piper_nb.capture.annotate import annotate
from piper_nb.capture.batch import Batch
from piper_nb.compiler.compile import compile
from piper_nb.cp import sequence_length
from piper_nb.directives.spec import Program
from piper_nb.errors import PlanError
from piper_nb.planner.build import annotation, is_layer, program, token_count
from piper_nb.planner.estimate import Context
from piper_nb.planner.experts import find_experts
from piper_nb.planner.explore import explore, rate
from piper_nb.planner.knobs import Knobs, check_pins, space
from piper_nb.planner.probe import UNIT_TAG
from piper_nb.planner.progress import Stop, bar
from piper_nb.planner.result import GIB, Candidate, SearchResult, Status
from piper_nb.planner.spread import workers
from piper_nb.profile import CostModel, simulate
from piper_nb.sim import MemorySettings, Topology

__all__ = ["search"]

COSTS = ("analytic", "profile")


@dataclass
class _Setup:
    model: object
    batch: Batch
    tokens: int             # what a step trains on (`build.token_count`)
    units: list
    hardware: object
    topology: object
    precision: str
    settings: object
    cost: str
    loss_fn: object
    capture: str
    experts: object = None      # planner.experts.Experts of a MoE model
    expert_units: tuple = ()    # the units holding them
    loss_mean: str = "microbatch"   # the compile's (`pn.compile`)

    def annotation(self, k: Knobs, stage_of) -> dict:
        tags = self.experts.tags(self.model, k.ep) if self.experts else None
        return annotation(self.units, list(stage_of), k.every, tags)

    def unit_spec(self):
        """The spec every probe compiles: each unit tagged `UNIT_TAG`, its layers `AC`, the
        experts as regions of their own."""
        n = len(self.units)
        return annotate(self.model, {
            **{u: {UNIT_TAG: i, **({"AC": 1} if is_layer(i, n) else {})}
               for i, u in enumerate(self.units)},
            **(self.experts.tags(self.model, 1) if self.experts else {})})

    def program(self, k: Knobs, stage_of) -> Program:
        return Program(program(k, list(stage_of), self.expert_units))

    def price(self, plan):
        if self.cost == "profile":
            return CostModel.profile(plan)
        return CostModel.analytic(plan, self.hardware, topology=self.topology)


def search(model, batch, devices: int, hardware="H100", *, topology=None, pin=None,
           precision: str | None = None, memory=None, capacity: float | None = None,
           cost: str = "analytic", top: int = 5, budget: float | None = None,
           loss_fn=None, capture: str = "auto", loss_mean: str = "microbatch",
           jobs: int | None = None,
           progress: bool | Callable[[str, int, int], bool | None] = True) -> SearchResult:
    """Search the plans of `model` on `batch` (a whole step's batch) over `devices` devices.

    `hardware` is a GPU in `pn.sim.HARDWARE` (or a spec) and `topology` a `pn.Topology`
    (default: the GPU's node of 8); `cost="analytic"` prices with `pn.CostModel.analytic`
    (a meta-device model is enough), `cost="profile"` with `pn.CostModel.profile` (times
    measured on this machine's CPU workers). `pin` fixes knobs: {"tp": 8, "schedule":
    "1f1b", "zero": [1, 3], "recompute": "all"} (the knobs: `planner.knobs.KNOBS`).
    `precision` is the compile's ("bf16" by default for analytic costs, "fp32" for
    profiled); `memory` the `pn.MemorySettings` the memory model charges (default AdamW's
    state); `capacity` the bytes a device holds (default the GPU's memory; unlimited when
    profiled); `loss_fn`, `capture` and `loss_mean` are the compile's (`pn.compile`; a
    Hugging Face model's own loss under context parallelism needs `loss_mean="global"`).
    `top` candidates are compiled and simulated in full (a compile at hundreds
    of devices takes tens of seconds); with `budget` seconds, none is started after that
    once one fits. `jobs` is how many processes probe and estimate (default: one per core;
    analytic costs on Linux only, `planner.spread`). `progress` is a tqdm bar (True),
    nothing (False), or a callable `progress(phase, done, total)`, phase "probing",
    "exploring" or "verifying", called as each TP class is probed and each candidate (a
    chunk of them, spread over processes) is estimated or verified; when it returns True
    the search stops and returns the best so far, as Ctrl-C does. Returns a
    `SearchResult`."""
    from piper_nb.sim.gpus import spec_of
    t0 = time.perf_counter()
    _check_args(devices, cost, top, jobs)
    spec = spec_of(hardware)
    topo = topology or Topology.of(spec)
    precision = precision or ("bf16" if cost == "analytic" else "fp32")
    settings = memory or MemorySettings(optimizer="adamw")
    if capacity is None:
        capacity = spec.memory if cost == "analytic" else float("inf")
    batch = Batch.of(batch, "pn.search")
    samples = batch.size
    units = unit_names(model, batch)
    pins = check_pins(pin)
    experts = find_experts(model)
    _check_combined(pins, pin, spec, cost, model, experts)
    candidates = list(space(devices, samples, len(units), gpus_per_node=topo.gpus_per_node,
                            pins=pins, experts=experts, sequence=sequence_length(batch)))
    if not candidates:
        raise PlanError(_empty(devices, samples, len(units), topo.gpus_per_node, pin))
    setup = _Setup(model, batch, token_count(batch), units, spec, topo, precision, settings,
                   cost, loss_fn, capture, experts, _holding(units, experts), loss_mean)
    ctx = Context(batch=samples, links=None, param_bytes=settings.param_bytes,
                  grad_bytes=settings.grad_bytes,
                  optim_bytes=settings.optim_per_param() + (4 if precision == "bf16" else 0),
                  reduce_bytes=4.0)
    seconds = {"probe": 0.0, "explore": 0.0, "verify": 0.0}
    kept, refused, interrupted = explore(setup, candidates, ctx, capacity, devices, progress,
                                         seconds, workers(jobs, cost), top)
    seconds["explore"] = time.perf_counter() - t0 - seconds["probe"]
    explored = len(kept) + len(refused)    # all of them, unless interrupted
    # those the estimate says fit first, fastest first; then the ones within its margin
    kept.sort(key=lambda x: (x[0].peak > capacity, x[0].step))
    ranked = []
    if not interrupted:
        t1 = time.perf_counter()
        ranked, interrupted = _verify(setup, kept, refused, top, capacity, devices, progress,
                                      budget)
        seconds["verify"] = time.perf_counter() - t1
    seconds["total"] = time.perf_counter() - t0
    seen = {c.knobs for c in ranked + refused}
    estimated = [_with_program(setup, row, cut) for row, cut in kept[:50]
                 if row.knobs not in seen]
    result = SearchResult(ranked, estimated, refused, samples, explored, seconds, capacity,
                          interrupted)
    if not result.fits:
        result.shortfall = _shortfall(refused, capacity)
    return result


def unit_names(model, batch: Batch) -> list[str]:
    """The pipeline units a search cuts stages over, in execution order: those holding
    parameters (all of them if none does)."""
    from piper_nb.capture.annotate import _execution_order, pipeline_units
    return _execution_order(model, [u for u in pipeline_units(model)
                                    if next(model.get_submodule(u).parameters(), None)
                                    is not None] or pipeline_units(model), batch)


def _check_combined(pins: dict, pin, spec, cost: str, model, experts) -> None:
    """Pins the hardware, the model or each other rule out."""
    if True in pins.get("float8", ()) and cost == "analytic" and not spec.fp8_flops:
        raise PlanError(f"pn.search: pin float8=True needs FP8 matmuls, which the "
                        f"{spec.name} has none of; search on a GPU with them (H100, H200) "
                        "or drop the pin")
    if experts is None and pins.get("ep", {1}) - {1}:
        raise PlanError(f"pn.search: pin ep={pin['ep']!r} spreads experts, and "
                        f"{type(model).__name__} has none (no stacked-experts module, no "
                        "ModuleList named experts); drop the pin")


def _check_args(devices, cost, top, jobs) -> None:
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise PlanError(f"pn.search: devices must be a positive int, got {devices!r}")
    if cost not in COSTS:
        raise PlanError(f"pn.search: cost must be one of {', '.join(COSTS)}, got {cost!r}")
    if not isinstance(top, int) or top < 1:
        raise PlanError(f"pn.search: top must be a positive int, got {top!r}")
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise PlanError(f"pn.search: jobs must be a positive int (processes), got {jobs!r}")


def _holding(units: list[str], experts) -> tuple[int, ...]:
    """The units (indices) whose modules hold experts."""
    if experts is None:
        return ()
    return tuple(i for i, u in enumerate(units)
                 if any(u == "" or p.startswith(u + ".") for p, _, _ in experts.modules))


def _with_program(setup: _Setup, row: Candidate, stage_of) -> Candidate:
    return replace(row, annotation=setup.annotation(row.knobs, stage_of),
                   program=setup.program(row.knobs, stage_of))


def _verify(setup: _Setup, kept, refused, top, capacity, devices, progress, budget):
    """Compile and simulate the fastest estimates until `top` fit (at most 3 x top tried,
    none started after `budget` seconds once one fits)."""
    ranked, interrupted = [], False
    progress_bar = bar(min(len(kept), 3 * top), progress, "verifying")
    t0 = time.perf_counter()
    try:
        for row, stage_of in kept[:3 * top]:
            if len(ranked) >= top or (ranked and budget is not None
                                      and time.perf_counter() - t0 > budget):
                break
            progress_bar.update(1)
            row = _with_program(setup, row, stage_of)
            try:
                plan = compile(annotate(setup.model, row.annotation), row.program,
                                  setup.batch, loss_fn=setup.loss_fn, precision=setup.precision,
                                  capture=setup.capture, loss_mean=setup.loss_mean)
                trace = simulate(plan, setup.price(plan), memory=setup.settings)
            except PlanError as e:
                refused.append(replace(row, status=Status.REFUSED,
                                       reason=f"compile: {str(e).splitlines()[0]}"))
                continue
            peak_dev, peak = max(trace.peak_memory.items(), key=lambda kv: kv[1])
            done = replace(row, status=Status.SIMULATED, step=trace.step_time,
                           tokens_per_s=rate(setup.tokens, trace.step_time, devices),
                           bubble=trace.bubble_fraction(), peak=float(peak), plan=plan,
                           trace=trace)
            if peak > capacity:
                refused.append(replace(done, status=Status.REFUSED, plan=None, trace=None, reason=(
                    f"memory model: device {peak_dev} peaks at {peak / GIB:.1f} GiB > "
                    f"{capacity / GIB:.1f} GiB")))
                continue
            ranked.append(done)
    except (KeyboardInterrupt, Stop):
        interrupted = True
    finally:
        progress_bar.close()
    ranked.sort(key=lambda c: c.step)
    return ranked, interrupted


def _shortfall(refused: list[Candidate], capacity: float) -> str:
    over = [c for c in refused if c.peak is not None and c.peak > capacity]
    if not over:
        reasons = sorted({c.reason for c in refused})[:3]
        return "every candidate was refused: " + "; ".join(reasons)
    c = min(over, key=lambda c: c.peak)
    return (f"the closest candidate, {c.knobs.label()}, needs {c.peak / GIB:.2f} GiB on its "
            f"heaviest device, {(c.peak - capacity) / GIB:.2f} GiB more than the "
            f"{capacity / GIB:.1f} GiB a device holds ({c.reason}); more devices, a "
            "higher ZeRO level, recompute or a smaller batch would close it")


def _empty(devices: int, samples: int, units: int, node: int, pin) -> str:
    return (f"pn.search: no PP x TP x CP x DP split of {devices} devices fits: DP must divide "
            f"the batch of {samples} samples, TP a node of {node} devices, CP the devices "
            f"left by TP, PP at most the model's {units} pipeline units"
            + (f", and the pins {dict(pin)} hold" if pin else "")
            + "; change the device count or the batch, or loosen the pins")
