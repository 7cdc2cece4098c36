"""Simulation: cost models, discrete-event simulator, memory model, traces.

`simulate(plan, cost_model)` predicts a `Trace` (the type the runtime measures too);
`CostModel.uniform / profile / analytic` say how long passes and messages take (a
profiled one also what its CPU host spends around them: `HostModel`; an analytic one
prices collectives over a `Topology`);
`sim.memory` accounts bytes per device the way the ZeRO paper does.
"""

from piper_nb.sim.analysis import Comparison
from piper_nb.sim.cost import HARDWARE, CostModel, HardwareSpec, Topology
from piper_nb.sim.host_model import HostModel
from piper_nb.sim.memory import (
    MIXED_PRECISION_ADAM,
    MemorySettings,
    model_states,
    zero_model_states,
)
from piper_nb.sim.simulate import simulate
from piper_nb.sim.trace import Event, MemorySample, Trace

__all__ = ["simulate", "CostModel", "HostModel", "HardwareSpec", "HARDWARE", "Topology",
           "MemorySettings",
           "MIXED_PRECISION_ADAM", "model_states", "zero_model_states", "Trace", "Event",
           "MemorySample", "Comparison"]
