"""What one compile of each TP class tells a search about the model's pipeline units.

A search prices thousands of candidates without compiling them. It compiles the model once
per (TP degree, sequence parallelism, Float8, CP degree) class instead, on one device (and
its TP or context group), on
`rows` samples of the batch, one region per pipeline unit (`pn.cut_stages`' units: the
embedding, each layer, the head), and simulates that plan with the cost model the search
uses. Per unit it keeps (`UnitCost`): the forward and backward times with the unit's TP
and CP collectives (on the critical path as they run; under CP the unit runs on a device's
share of the sequence), the weight-gradient share of the backward,
the update, the parameters one TP rank holds, what autograd saves and what the unit reads
per microbatch; in a MoE model, which of the parameters are its experts' and what its
experts read and give back (what EP's all-to-all moves; the probe's experts are regions
of their own, tagged `EP`, on its one device). The estimate (`planner.estimate`) scales
those by the microbatch size.

A class whose compile fails (a model without a TP plan, heads that do not divide) is
refused as a whole with the compile's reason. A model captured by torch.export, which
captures no batch of one sample, is probed at 2 samples and more, and its line drawn on
to 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from piper_nb.capture.batch import Batch
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COMM, Op
from piper_nb.plan.sizes import element_size, value_bytes
from piper_nb.planner.build import cut
from piper_nb.planner.experts import EP
from piper_nb.sim.ledger_params import param_numel

__all__ = ["UnitCost", "Probe", "probe", "UNIT_TAG"]

UNIT_TAG = "U"     # the tag a probe gives each pipeline unit
SPECIALISED = "a batch of 1 is specialised"   # torch.export's refusal (`capture.export`)


@dataclass(frozen=True)
class UnitCost:
    """One pipeline unit's costs on one TP rank for a microbatch of the probe's rows."""

    name: str
    f: float          # forward, with its TP collectives
    b: float          # full backward (input and weight gradients), with its TP collectives
    w: float          # the weight-gradient share of b (what ZB1P and DualPipeV defer)
    u: float          # optimizer update
    params: int       # parameter elements on one TP rank
    param_bytes: int  # their bytes (the plan's dtypes)
    saved: float      # bytes autograd saves in the forward (the tensors it keeps included)
    inputs: float     # bytes of what the unit reads (kept when it is recomputed)
    expert_params: int = 0        # of `params`, those of its experts (EP-tagged regions)
    expert_param_bytes: int = 0
    dispatch: float = 0.0  # bytes its experts read from the rest, per microbatch (all-to-all)
    combine: float = 0.0   # bytes the rest reads from its experts


@dataclass(frozen=True)
class Probe:
    """A TP class's units at two microbatch sizes (`rows`: the smallest and the largest a
    candidate of the class uses), or why it cannot compile. `at(n)` interpolates times
    between the two sizes (a straight line: a kernel's fixed costs and the weights it
    reads do not grow with the rows) and scales bytes in proportion."""

    tp: int
    sp: bool
    rows: tuple[int, ...] = ()
    measured: tuple[tuple[UnitCost, ...], ...] = ()
    error: str | None = None
    seconds: float = 0.0
    links: object = field(default=None, compare=False, repr=False)   # its CostModel
    _at: dict = field(default_factory=dict, compare=False, repr=False)
    _cuts: dict = field(default_factory=dict, compare=False, repr=False)
    float8: bool = False   # the layers' linears in Float8 (`pn.float8` on the AC-tagged units)
    cp: int = 1            # devices sharing each sequence (`pn.context_parallel`)

    def at(self, n: float) -> tuple[UnitCost, ...]:
        got = self._at.get(n)
        if got is None:
            got = self._at[n] = self._interpolate(n)
        return got

    def cut(self, stages: int) -> tuple[int, ...]:
        """Each unit's stage among `stages`, balancing forward + backward time at the larger
        size probed (made once per stage count)."""
        got = self._cuts.get(stages)
        if got is None:
            got = self._cuts[stages] = tuple(cut([u.f + u.b for u in self.measured[-1]],
                                                 stages))
        return got

    def _interpolate(self, n: float) -> tuple[UnitCost, ...]:
        lo, hi = self.measured[0], self.measured[-1]
        r0, r1 = self.rows[0], self.rows[-1]
        x = (n - r0) / (r1 - r0) if r1 != r0 else 0.0
        line = lambda a, b: max(a + (b - a) * x, 0.0) if r1 != r0 else a * n / r0  # noqa: E731
        return tuple(replace(u, f=line(u.f, v.f), b=line(u.b, v.b), w=line(u.w, v.w),
                             saved=v.saved * n / r1, inputs=v.inputs * n / r1,
                             dispatch=v.dispatch * n / r1, combine=v.combine * n / r1)
                     for u, v in zip(lo, hi, strict=True))


def probe(spec, units: list[str], batch, rows: tuple[int, ...], tp: int, sp: bool, price, *,
          precision: str, loss_fn=None, capture: str = "auto", float8: bool = False,
          cp: int = 1, loss_mean: str = "microbatch") -> Probe:
    """Compile `spec` (the model, one region per unit tagged `UNIT_TAG`, its layers `AC`)
    on each of `rows` samples of `batch` with TP `tp` (and SP, and Float8 in the layers)
    or CP `cp`, price each with `price(plan)` (a CostModel), and read each unit's costs.
    The capture is the spec's, made once for every class."""
    import time

    from piper_nb.compiler.compile import compile, rebatch
    from piper_nb.cp import context_parallel
    from piper_nb.directives.float8 import float8 as float8_layers
    from piper_nb.directives.spec import place
    from piper_nb.profile import simulate
    from piper_nb.tp import tensor_parallel
    t0 = time.perf_counter()
    leads = [c * tp for c in range(cp)]   # the context over the TP groups' first devices
    program = [place({}, leads)]
    if cp > 1:
        program.append(context_parallel({}, leads))
    if tp > 1:
        program.append(tensor_parallel({}, [list(range(c, c + tp)) for c in leads],
                                       sequence_parallel=sp))
    if float8:
        program.append(float8_layers({"AC": "*"}))
    measured, cost = [], None
    whole = Batch.of(batch, "pn.search")
    try:
        plan = None
        for n in rows:
            part = whole.slice(slice(0, n))
            if plan is None and n == 1:
                try:
                    plan = compile(spec, program, part, loss_fn=loss_fn, precision=precision,
                                   capture=capture, loss_mean=loss_mean)
                except PlanError as e:
                    if SPECIALISED not in str(e) or whole.size < 2:
                        raise
                    # torch.export captures no batch of 1: a line through 2 and more
                    rows = _from_two(rows, whole.size)
                    return probe(spec, units, batch, rows, tp, sp, price, precision=precision,
                                 loss_fn=loss_fn, capture=capture, float8=float8, cp=cp,
                                 loss_mean=loss_mean)
            else:
                plan = (compile(spec, program, part, loss_fn=loss_fn, precision=precision,
                                capture=capture, loss_mean=loss_mean)
                        if plan is None else rebatch(plan, part))
            cost = price(plan)
            measured.append(_units(plan, cost, simulate(plan, cost), units))
    except PlanError as e:
        return Probe(tp, sp, tuple(rows), error=str(e).split("\n")[0],
                     seconds=time.perf_counter() - t0, float8=float8, cp=cp)
    return Probe(tp, sp, tuple(rows), tuple(measured), None, time.perf_counter() - t0, cost,
                 float8=float8, cp=cp)


def _from_two(rows: tuple[int, ...], samples: int) -> tuple[int, ...]:
    """`rows` without a batch of 1: 2, and the largest (at least 4, if the batch has it)."""
    return tuple(sorted({2, max(*rows, min(4, samples))}))


def _units(plan, cost, trace, names: list[str]) -> tuple[UnitCost, ...]:
    unit_of = {r: dict(info.tags).get(UNIT_TAG) for r, info in enumerate(plan.regions)}
    f = [0.0] * len(names)
    b = [0.0] * len(names)
    u = [0.0] * len(names)
    for e in trace.events:
        k = unit_of.get(e.region)
        if e.device != 0 or k is None:
            continue
        if e.kind == Op.U:
            u[k] += e.duration
        elif e.kind == Op.F or (e.kind in COMM and ("#tpF" in e.node or "#cpF" in e.node)
                                and "#regather" not in e.node):
            f[k] += e.duration
        else:
            b[k] += e.duration
    by_unit: dict[int, list[int]] = {}
    for r, k in unit_of.items():
        by_unit.setdefault(k, []).append(r)
    out = []
    for k, name in enumerate(names):
        regions = by_unit.get(k, [])
        params = {p for r in regions for p in plan.regions[r].params if p in plan.params}
        reads = {v for r in regions for v in plan.regions[r].inputs if v in plan.values}
        kept = {v for r in regions for side in plan.kept.get(r, ((), ())) for v in side
                if v in plan.values}
        made = {v for r in regions for v in plan.regions[r].outputs}
        experts = [r for r in regions if EP in dict(plan.regions[r].tags)]
        rest = set(regions) - set(experts)
        mine = {p for r in experts for p in plan.regions[r].params if p in plan.params}
        into = {v for r in experts for v in plan.regions[r].inputs if v in plan.values}
        out_of = {v for r in experts for v in plan.regions[r].outputs if v in plan.values}
        made_rest = {v for r in rest for v in plan.regions[r].outputs}
        read_rest = {v for r in rest for v in plan.regions[r].inputs}
        out.append(UnitCost(
            name=name, f=f[k], b=b[k],
            w=sum(cost.passes.get((r, Op.BW), 0.0) for r in regions),
            u=u[k],
            params=sum(param_numel(plan, p) for p in params),
            param_bytes=sum(param_numel(plan, p) * element_size(plan.params[p][1])
                            for p in params),
            saved=float(sum(plan.saved.get(r, 0) for r in regions)
                        + sum(value_bytes(plan.values[v]) for v in kept)),
            inputs=float(sum(value_bytes(plan.values[v]) for v in reads - made)),
            expert_params=sum(param_numel(plan, p) for p in mine),
            expert_param_bytes=sum(param_numel(plan, p) * element_size(plan.params[p][1])
                                   for p in mine),
            dispatch=float(sum(value_bytes(plan.values[v]) for v in into & made_rest)),
            combine=float(sum(value_bytes(plan.values[v]) for v in out_of & read_rest))))
    return tuple(out)
