"""Measuring costs by running the runtime on this machine: the profiled cost model.

The floor above the runtime and the simulator: it builds workers in this process
(`passes`), starts processes that time gloo between them (`links`) and time-slicing
(`time_slicing`), and gives the simulator a `CostModel` of what it measured (what the CPU
host spends in its `HostModel`). `cost_model` holds `profile_cost_model`, the public
`CostModel` (the simulator's, plus `CostModel.profile`) and the public `simulate` (whose
default cost model is the profiled one), so the simulator itself never imports this
package and never starts a process.
"""

from piper_nb.profile.cost_model import CostModel, profile_cost_model, simulate
from piper_nb.profile.links import profile_links
from piper_nb.profile.passes import profile_packing, profile_plan
from piper_nb.profile.time_slicing import profile_slicing

__all__ = ["CostModel", "simulate", "profile_cost_model", "profile_plan", "profile_packing",
           "profile_links", "profile_slicing"]
