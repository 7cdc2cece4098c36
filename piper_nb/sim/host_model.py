"""The host a device's instructions run on: what a CPU worker's own work costs.

A `CostModel` says how long passes and messages take on the devices; a `HostModel`, its
`host`, adds what the process driving a device spends around them. Only profiled CPU plans
have one (`CostModel.profile`: local gloo workers, whose host does the computing, the
copying and the bookkeeping); a uniform or analytic (GPU) model leaves `host` None, which
the simulator reads as `HostModel()`: no host effects at all.

`overhead` is the time a device's host spends after every instruction (a number, or
device -> number, -1 the default), `issue` the time the call that posts a message of a
kind (SEND, RECV, a collective) keeps the host (seconds, or (latency, bytes/s): gloo
writes a message into its socket inside the call), and under "WAIT" what a WAIT costs
once its op is done; with `sync` the host waits for each pass, as CPU workers do (an
overlap slot then runs its passes one after another); with `cores`, the devices
computing at once share that many cores with `background` other runnable tasks
(processor sharing, `sim.core_sharing`: a pass measured at a share of max(1, (1 + background)
/ cores) runs at max(1, (active + background) / cores), active being the devices
computing meanwhile; found by re-simulating until the timeline settles), times `slicing`
where tasks outnumber cores: what time-slicing costs beyond the fair share (caches
refilled after the others ran, migrations; `sim.time_slicing`), with `jitter` the shape of it:
quantiles of a pass's time over its median while every device runs (a pass mostly runs at
full speed and now and then waits out a slice; the simulator draws from it, keeping the
mean). `comm_cores` is what a collective in flight takes of the cores on each of its
members (a CPU transport such as gloo copies, sends and reduces on host threads, which
preempt compute): it counts among the active, and so does a point-to-point message on
its receiver, for the share of its span that reading it takes. A point-to-point
message's host work is its issue call; a collective's also `packing[(kind, bucket)]`:
host time before the call (flattening the bucket) and after its wait (putting the result
back). The links were timed with `link_world` processes up, those outside a message
computing: a collective stretches relative to that load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from piper_nb.plan.sizes import message_bytes

__all__ = ["HostModel", "NO_HOST"]


@dataclass(frozen=True, kw_only=True)
class HostModel:
    """A CPU host's costs around a device's instructions (see the module docstring)."""

    overhead: float | dict = 0.0                   # host time after each instruction
    issue: dict = field(default_factory=dict)      # kind | "WAIT" -> call's host time (fit)
    sync: bool = False                             # the host waits for every pass (CPU)
    cores: int | None = None                       # cores the devices share (None: own)
    background: float = 0.0                        # other runnable tasks when profiled
    comm_cores: float = 0.0                        # cores a collective in flight takes
    slicing: float = 1.0                           # time-slicing cost beyond the fair share
    jitter: tuple = ()                             # quantiles of pass time / median, sliced
    link_world: int = 0                            # processes up when `links` were timed
    packing: dict = field(default_factory=dict)    # (kind, bucket) -> (before call, after wait)

    def overhead_of(self, device: int) -> float:
        """Host time `device` spends after each instruction."""
        if isinstance(self.overhead, dict):
            return self.overhead.get(device, self.overhead.get(-1, 0.0))
        return self.overhead

    def issue_time(self, plan, ins) -> float:
        """Host time of the call that posts `ins` (or, for "WAIT", of a WAIT)."""
        fit = self.issue.get(ins if isinstance(ins, str) else ins.kind)
        if fit is None:
            return 0.0
        if not isinstance(fit, tuple):
            return fit
        return fit[0] + (0.0 if isinstance(ins, str) else message_bytes(plan, ins) / fit[1])

    def shares_cores(self, world: int) -> bool:
        """Whether `world` devices could ever load the cores past one task each: the most
        load there could be (every device computing, its collectives in flight, and the
        background); the sharing pass then finds whether it does."""
        return bool(self.cores) and world * (1 + self.comm_cores) + self.background > self.cores


NO_HOST = HostModel()   # what `CostModel.host=None` means: no host effects
