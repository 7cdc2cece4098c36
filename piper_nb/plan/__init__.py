"""The plan floor: what the compiler produces and the runtime and the simulator read.

`Plan` holds one `DevicePlan` (a tuple of `Instr`) per device plus the tables both
interpreters share: values and their sizes (`sizes`), the precision table (`precision`),
what clipping asks at run time (`clipping`) and routed token rows (`token_rows`). Nothing here
compiles anything: `runtime/` and `sim/` import this floor, never `compiler/`.
"""

from piper_nb.ir.kinds import Op, Purpose
from piper_nb.plan.instr import Instr
from piper_nb.plan.plan import DevicePlan, Plan, StampedDevicePlan

__all__ = ["Plan", "DevicePlan", "StampedDevicePlan", "Instr", "Op", "Purpose"]
