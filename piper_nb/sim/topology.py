"""The machine a plan runs on, as the collectives see it (`Topology`): GPUs per node, the
NVLink inside a node and the network across nodes, their latencies per hop and the
fractions of their line rates NCCL's kernels reach, and how hard communication kernels
slow the compute they overlap.

Devices map to nodes as torchrun numbers ranks: device d sits on node d // gpus_per_node.
Every GPU has its own network adapter (rail-optimized, as DGX and Grand Teton nodes are),
so the network bandwidth is per GPU. `Topology.of(hardware)` gives a GPU's defaults
(`sim.gpus.HARDWARE`: its datasheet's NVLink, one InfiniBand adapter per GPU); any field
can be overridden, e.g. `pn.Topology.of("H100", gpus_per_node=4)`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from piper_nb.errors import PlanError

__all__ = ["Topology", "TOPOLOGY_SOURCES"]

# where each default comes from (docs/analytic_model.md prints them)
TOPOLOGY_SOURCES = (
    ("nvlink_latency", "NCCL's tuning model (src/graph/tuning.cc, NCCL 2.x): 3.4 us per "
                       "NVLink hop of its Simple ring (0.47 us LL, 1.9 us LL128), plus a base "
                       "of 6.6-14 us per collective; `sim.collectives` keeps its table"),
    ("network_latency", "NCCL's tuning model: 9.6 us per network hop of its Simple ring "
                        "(2.7 us LL, 4.0 us LL128)"),
    ("nvlink_efficiency", "nccl-tests all_reduce_perf on 8 A100 SXM4: 230-250 GB/s bus "
                          "bandwidth of NVLink-3's 300 GB/s; NCCL's own model caps an "
                          "A100's ring at 235 GB/s: 0.8"),
    ("network_efficiency", "an assumption (no multi-node measurement here): NCCL's Simple "
                           "protocol streams at 0.9 of the adapters' line rate, the fraction "
                           "NCCL's tuning model gives its trees"),
    ("contention", "Lee et al. 2025, 'Characterizing Compute-Communication Overlap in "
                   "GPU-Accelerated Distributed Deep Learning' (arXiv:2507.03114): compute "
                   "overlapped with NCCL collectives runs 18.9% slower on average on A100 and "
                   "H100 (40% at most): 0.19"),
)


@dataclass(frozen=True, kw_only=True)
class Topology:
    """GPUs per node and the links between them; bandwidths in bytes/s per direction per
    GPU, latencies in s per hop. `contention` is how much slower compute runs while a
    communication kernel runs beside it on the same GPU (communication kernels take SMs):
    a pass overlapped throughout takes (1 + contention) times as long."""

    gpus_per_node: int = 8
    nvlink_bandwidth: float          # inside a node
    network_bandwidth: float         # across nodes, per GPU (one adapter each)
    nvlink_latency: float = 3.4e-6   # one NVLink hop of NCCL's Simple ring
    network_latency: float = 9.6e-6  # one network hop of NCCL's Simple ring
    nvlink_efficiency: float = 0.8   # fraction of the line rate NCCL's Simple protocol reaches
    network_efficiency: float = 0.9
    contention: float = 0.19
    name: str = "custom"

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise PlanError(f"Topology: gpus_per_node={self.gpus_per_node}; a node holds at "
                            "least one GPU")
        if min(self.nvlink_latency, self.network_latency) < 0:
            raise PlanError("Topology: latencies are seconds per hop, at least 0")
        if min(self.nvlink_bandwidth, self.network_bandwidth) <= 0:
            raise PlanError("Topology: bandwidths must be positive bytes/s, e.g. "
                            "nvlink_bandwidth=450e9, network_bandwidth=50e9")
        for f in ("nvlink_efficiency", "network_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise PlanError(f"Topology: {f}={getattr(self, f)} must be in (0, 1]; it is "
                                "the fraction of the line rate a collective streams at")
        if not 0 <= self.contention < 1 or math.isnan(self.contention):
            raise PlanError(f"Topology: contention={self.contention} must be in [0, 1); it is "
                            "how much slower compute runs beside communication")

    @classmethod
    def of(cls, hardware, **overrides) -> Topology:
        """The default topology of `hardware` (a name in HARDWARE or a `HardwareSpec`):
        its node size, NVLink and network bandwidths and hop latencies, with `overrides`
        on top."""
        from piper_nb.sim.gpus import spec_of
        hw = spec_of(hardware)
        base = cls(gpus_per_node=hw.node_size, nvlink_bandwidth=hw.nvlink_bandwidth,
                   network_bandwidth=hw.ib_bandwidth, nvlink_latency=hw.nvlink_latency,
                   network_latency=hw.ib_latency, name=hw.name)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise PlanError(f"Topology.of: unknown field(s) {sorted(unknown)}; use "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        return dataclasses.replace(base, **overrides)

    @property
    def nvlink_rate(self) -> float:
        """Bytes/s a collective streams at over NVLink: the line rate x its efficiency."""
        return self.nvlink_bandwidth * self.nvlink_efficiency

    @property
    def network_rate(self) -> float:
        """Bytes/s a collective streams at over one GPU's adapter."""
        return self.network_bandwidth * self.network_efficiency

    def node(self, device: int) -> int:
        """The node device `device` sits on (torchrun's numbering: consecutive ranks)."""
        return device // self.gpus_per_node

    def spread(self, members) -> tuple[int, int]:
        """(nodes, most members on one node) of a group of devices."""
        count: dict[int, int] = {}
        for d in members:
            n = d // self.gpus_per_node
            count[n] = count.get(n, 0) + 1
        return len(count), max(count.values(), default=0)
