"""Cost models: how long each pass and each message of a Plan takes.

Three ways to get one, all the same `CostModel` value:

- `CostModel.uniform(F=1, B=2, W=1)`: unit costs, the way DualPipe's table and the
  zero-bubble paper count (BI = B - W, BW = W, an overlapped F&B slot = FB);
- `CostModel.profile(plan)`: every region's F, B, BI, BW and U timed on this machine on
  one microbatch slice the way a worker runs them (one thread), the worker's bookkeeping per
  instruction, and latency + bytes/bandwidth fitted over gloo per kind of message and group
  size. Measuring starts processes, which the simulator never does, so this constructor
  lives one floor up: `pn.CostModel` is `piper_nb.profile.CostModel`, this class plus
  `profile`. Such a model has a `host`
  (`sim.host_model.HostModel`): host-synchronous (`sync`: a CPU worker waits for each
  pass), sharing `cores` among the devices computing at once, with what time-slicing costs
  on top where they outnumber the cores (`sim/time_slicing.py`);
- `CostModel.analytic(plan, "H100")`: each pass the sum of its aten operators' roofline
  times, counted by dispatch (`sim.roofline`, `sim.op_counts`), with one table of sourced
  constants per GPU (`sim.gpus`); collectives and messages as NCCL runs them over a
  `Topology` (`sim.collectives`: ring or tree by size, NVLink inside a node and the
  network across nodes), and compute slowed by the communication it overlaps
  (`contention`, `sim.contention`).

In every model the B or BI of a recomputed region (`pn.recompute`) costs one forward more:
it runs the forward again first (`CostModel.compute`). Under selective recompute the
attention cores run again inside B, BI and BW, which the analytic model counts as they run
(a profile times them so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import P2P, Op
from piper_nb.plan.sizes import message_bytes
from piper_nb.sim.collectives import collective_time, p2p_time
from piper_nb.sim.gpus import HARDWARE, HardwareSpec, spec_of
from piper_nb.sim.host_model import HostModel
from piper_nb.sim.topology import Topology

__all__ = ["CostModel", "HardwareSpec", "HARDWARE", "Topology"]



@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Durations of passes and messages. Times are in `unit` ("s" or "unit").

    `passes` maps (region, pass) to a duration, region -1 being the default for every
    region; `fb` is the cost of an overlapped F&B slot (None: F + B, the sum of its
    members); messages cost `comm` each when it is set, else the fit in `links` for their
    kind and group size ("p2p" for SEND/RECV; latency + full bytes / bandwidth), else
    NCCL's algorithms over `topology` (`sim.collectives`) when it is set, else the
    alpha-beta ring formula with `latency` and `bandwidth`. A compute pass runs `1 +
    contention` times slower while communication is in flight on its device.

    `host` is the CPU host's own costs around those (`HostModel`: per-instruction
    overhead, issue calls, host-synchronous passes, cores shared among the devices); only
    profiled CPU plans have one, None being no host effects.
    """

    name: str = "custom"
    unit: str = "s"
    passes: dict = field(default_factory=dict)     # (region, pass) -> duration
    fb: float | None = None                        # overlapped F&B slot (uniform models)
    comm: float | None = None                      # constant per message / collective
    latency: float = 0.0                           # alpha, inside a node
    bandwidth: float = math.inf                    # beta, bytes per unit, inside a node
    inter_latency: float | None = None             # across nodes (None: as inside)
    inter_bandwidth: float | None = None
    node_size: int = 1 << 30                       # devices per node
    links: dict = field(default_factory=dict)      # (kind | "p2p", group size) -> (lat, bw)
    topology: Topology | None = None               # NCCL's collectives over it (analytic)
    contention: float = 0.0                        # compute slowdown beside communication
    host: HostModel | None = None                  # CPU host costs (profiled plans)
    meta: dict = field(default_factory=dict)

    # ---- constructors ---------------------------------------------------------------
    @classmethod
    def uniform(cls, F: float = 1, B: float = 2, W: float = 1, FB: float | None = None,
                comm: float = 0, U: float = 0) -> CostModel:
        """Every region alike: F, full backward B, weight backward W (BI = B - W)."""
        if W > B:
            raise PlanError(f"CostModel.uniform: W={W} is part of B={B}; use W <= B")
        passes = {(-1, "F"): F, (-1, "B"): B, (-1, "BI"): B - W, (-1, "BW"): W, (-1, "U"): U}
        return cls(name=f"uniform(F={F}, B={B}, W={W}, FB={FB}, comm={comm})", unit="unit",
                   passes=passes, fb=FB, comm=comm)


    @classmethod
    def analytic(cls, plan, hardware: str | HardwareSpec = "H100",
                 compiled: bool = False, topology: Topology | None = None) -> CostModel:
        """Per-operator times on `hardware` (a name in HARDWARE or a spec): each pass the
        sum of its aten operators' roofline times, counted by dispatch (`sim.roofline`),
        eager or (`compiled`) with the element-wise work between matmuls fused as
        `torch.compile` does; collectives and messages as NCCL runs them over `topology`
        (default `Topology.of(hardware)`: the GPU's node of 8, its NVLink, one network
        adapter per GPU), and compute slowed by the communication it overlaps by the
        topology's `contention`."""
        from piper_nb.sim.roofline import passes_of
        hardware = spec_of(hardware)
        if topology is None:
            topology = Topology.of(hardware)
        elif not isinstance(topology, Topology):
            raise PlanError(f"CostModel.analytic: topology is a pn.Topology, not "
                            f"{type(topology).__name__}; e.g. pn.Topology.of('H100', "
                            "gpus_per_node=8)")
        mode = ", compiled" if compiled else ""
        return cls(name=f"analytic({hardware.name}{mode})", unit="s",
                   passes=passes_of(plan, hardware, compiled),
                   latency=topology.nvlink_latency,
                   bandwidth=topology.nvlink_rate, inter_latency=topology.network_latency,
                   inter_bandwidth=topology.network_rate,
                   node_size=topology.gpus_per_node, topology=topology,
                   contention=topology.contention,
                   meta={"hardware": hardware.name, "memory_capacity": hardware.memory,
                         "topology": topology.name})

    # ---- durations ----------------------------------------------------------------
    def compute(self, ins) -> float:
        """Duration of one F/B/BI/BW/U instruction; the B or BI of a recomputed region
        (`Pass.recompute`) runs its forward first, so costs one F more."""
        took = self._pass(ins.region, ins.kind)
        if ins.kind in (Op.B, Op.BI) and ins.data.recompute:
            took += self._pass(ins.region, "F")
        return took

    def _pass(self, region: int, kind: str) -> float:
        p = self.passes
        key = (region, kind)
        if key in p:
            return p[key]
        if (-1, kind) in p:
            return p[(-1, kind)]
        if kind == Op.B and (region, Op.BI) in p:   # a profile without a full B
            return p[(region, Op.BI)] + p.get((region, Op.BW), 0.0)
        return 0.0

    def overlapped(self, members) -> float:
        """Duration of one overlap slot (F&B): `fb` replaces F + B when set."""
        total = sum(self.compute(m) for m in members)
        kinds = sorted(m.kind for m in members)
        if self.fb is None or len(members) < 2 or Op.F not in kinds:
            return total
        f = self.passes.get((-1, "F"), 0.0)
        b = self.passes.get((-1, "B"), 0.0)
        return total - (f + b) + self.fb

    def message(self, plan, ins, device: int) -> float:
        """Duration of one SEND/RECV transfer or collective issued on `device`."""
        if self.comm is not None:
            return self.comm
        if ins.kind in P2P:
            return self.link_time("p2p", (device, ins.data.peer), message_bytes(plan, ins))
        return self.link_time(ins.kind, ins.data.group, message_bytes(plan, ins))

    def counts_time(self, ins) -> float:
        """The blocking all-gather of token counts a forward dispatch starts with
        (`runtime.exchange`): 8 bytes per value from each member, on the ALL_GATHER link."""
        if self.comm is not None:
            return self.comm
        c = ins.data
        return self.link_time(Op.ALL_GATHER, c.group, 8 * len(c.values) * len(c.group))

    def link_time(self, kind: str, members, nbytes: float) -> float:
        """Duration of `nbytes` moved by a `kind` op ("p2p" or a collective) over `members`."""
        group = members if kind != "p2p" else ()
        if self.links:
            n = max(len(group), 2)
            fit = self.links.get((kind, n))
            if fit is None:   # the nearest group size measured for this kind
                sizes = sorted(k[1] for k in self.links if k[0] == kind)
                fit = self.links[(kind, min(sizes, key=lambda g: abs(g - n)))] if sizes else None
            if fit is not None:
                return fit[0] + nbytes / fit[1]
        if self.topology is not None:
            if kind == "p2p":
                return p2p_time(members[0], members[1], nbytes, self.topology)
            return collective_time(kind, members, nbytes, self.topology).seconds
        lat, bw = self.latency, self.bandwidth
        if self.inter_bandwidth is not None and len({d // self.node_size for d in members}) > 1:
            lat = self.inter_latency if self.inter_latency is not None else lat
            bw = self.inter_bandwidth
        n = max(len(group), 2)
        if kind == Op.ALL_REDUCE:
            steps, factor = 2 * (n - 1), 2 * (n - 1) / n
        elif kind in (Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL):
            steps, factor = n - 1, (n - 1) / n
        else:
            steps, factor = 1, 1.0
        return steps * lat + factor * nbytes / bw
