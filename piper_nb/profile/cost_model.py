"""The profiled cost model and the public prediction entry points that default to it.

`profile_cost_model(plan)` measures a plan's costs on this machine (it runs the runtime in
this process and starts processes to time gloo). `pn.CostModel` is the simulator's
`sim.cost.CostModel` with its third constructor, `CostModel.profile`, which can only live on
this floor: the simulator never starts a process, so it cannot measure. `pn.simulate` is
`sim.simulate` with the profiled model as its default.
"""

from __future__ import annotations

import math

from piper_nb import host
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import COLLECTIVES, Op
from piper_nb.optim import SGD, check_optimizer
from piper_nb.plan.plan import Plan
from piper_nb.plan.sizes import message_bytes
from piper_nb.profile.links import profile_links
from piper_nb.profile.passes import profile_packing, profile_plan
from piper_nb.profile.time_slicing import profile_slicing
from piper_nb.sim import simulate as sim_simulate
from piper_nb.sim.cost import CostModel as SimCostModel
from piper_nb.sim.host_model import HostModel
from piper_nb.sim.tokens import scale_experts
from piper_nb.sim.trace import Trace

__all__ = ["CostModel", "profile_cost_model", "simulate"]


class CostModel(SimCostModel):
    """Durations of passes and messages (see `sim.cost.CostModel`), made by one of
    `CostModel.uniform(...)` (fixed costs per pass), `CostModel.analytic(plan, hardware)`
    (FLOPs and bytes over a GPU's rates, from the meta device) or `CostModel.profile(plan)`
    (timed on this machine)."""

    @classmethod
    def profile(cls, plan, repeats: int = 5, comm: bool = True, optimizer=None,
                cores: int | None = None) -> CostModel:
        """`plan`'s costs measured here, as local CPU workers will see them (see
        `profile_cost_model`)."""
        return profile_cost_model(plan, repeats=repeats, comm=comm, optimizer=optimizer,
                                  cores=cores, cls=cls)


def simulate(plan: Plan, cost_model: SimCostModel | None = None, *, memory=None) -> Trace:
    """Predict the timeline and memory of one training step of `plan`.

    `cost_model` defaults to `CostModel.profile(plan)` (timed on this machine); `memory`
    is a `MemorySettings` (bytes per parameter, gradient and optimizer state; for an expert
    plan, the routing that sizes its token buffers). See `sim.simulate`."""
    if isinstance(plan, Plan) and cost_model is None:
        cost_model = CostModel.profile(plan)
    return sim_simulate(plan, cost_model, memory=memory)


def profile_cost_model(plan, repeats: int = 5, comm: bool = True, optimizer=None,
                       cores: int | None = None, cls: type | None = None) -> CostModel:
    """Measure `plan`'s costs here, as local CPU workers will see them.

    Passes and the update (with `optimizer`, default SGD) are timed on one thread like a
    worker runs them, plus the worker's bookkeeping per instruction; with `comm`, gloo
    is fitted per message kind and group size between `plan.world` processes (cached
    per process), with more repeats when there are more processes than cores (their
    messages then wait on the scheduler, a heavy-tailed delay whose mean needs more
    samples). `cores` (default: those this process may run on) are shared by the
    devices computing at once; with more devices than cores (and `comm`), one process
    per device also measures what time-slicing costs on top (`profile.time_slicing`).
    """
    if plan.capture is not None and any(p.is_meta for p in plan.capture.model.parameters()):
        raise PlanError("this model is on the meta device (no weights): profiling runs its "
                        "passes, so give simulate a cost model that does not, "
                        "pn.CostModel.analytic(plan, 'H100') or pn.CostModel.uniform()")
    optimizer = check_optimizer(optimizer if optimizer is not None else SGD(0.1), "profile")
    passes, overhead, background = profile_plan(plan, repeats, optimizer)
    passes = scale_experts(plan, passes)   # an expert runs on its group's rows
    packing = profile_packing(plan, repeats, optimizer)
    links: dict = {}
    issue: dict = {}
    lat, bw, world, slicing, jitter = 0.0, math.inf, 0, 1.0, ()
    if cores is None:   # the cores this process (and the workers it starts) may use
        cores = len(host.usable_cores())
    if comm:   # at most 8 processes; larger groups use the largest size measured
        world = min(max(plan.world, 2), 8)
        groups = {len(i.data.group) for dp in plan.devices for i in dp.instrs
                  if i.kind in COLLECTIVES}
        largest = max((message_bytes(plan, i) for dp in plan.devices for i in dp.instrs
                       if i.is_issue), default=0)
        a2a = (Op.ALL_TO_ALL,) if any(i.kind == Op.ALL_TO_ALL for dp in plan.devices
                                     for i in dp.instrs) else ()
        fitted = profile_links(world, {g for g in groups if g <= world}, largest=largest,
                               repeats=21 * -(-world // cores), kinds=a2a)
        issue = {k[1]: v for k, v in fitted.items() if k[0] == "issue"}
        links = {k: v for k, v in fitted.items() if k[0] != "issue"}
        lat, bw = links[("p2p", 2)]
        slicing, jitter = profile_slicing(plan, optimizer, cores=cores)
    cpu = HostModel(issue=issue, overhead=overhead, sync=True, cores=cores,
                    background=background, comm_cores=1.0 if comm else 0.0, link_world=world,
                    slicing=slicing, jitter=jitter, packing=packing)
    return (cls or CostModel)(name="profiled", unit="s", passes=passes, latency=lat, bandwidth=bw,
                     links=links, host=cpu, meta={"repeats": repeats})

