"""Context parallelism, in one place: the directive, the rewrite of a captured model over
a context group and its passes in each phase of the compile (long sequences cut over
devices, attention as ring attention; Liu et al. 2023, Megatron's and torchtitan's
context parallelism).

| phase | entry | what it does |
|---|---|---|
| capture | `cut_context` | every region run on a device's tokens, attention ring attention (`rewrite`) |
| DAG | `place_context` | the regions' passes on the group |
| DAG | `insert_cp_collectives` | the all-gathers of keys and values between a region's parts |
| DAG | `insert_cp_ring` | or the point-to-point ring's exchanges between its steps (`ring_dag`) |

The arithmetic (which tokens a device holds, ring attention itself) is the capture's
(`capture.ring_attention`), which the region code calls on the workers; the runtime sets
each part's rank in its group (`CP_RANK`) and cuts the batch (`RegionInfo.context`).
"""

from piper_nb.cp.directive import (
    ContextParallel,
    context_degree,
    context_parallel,
    cut_context,
    insert_cp_collectives,
    place_context,
)
from piper_nb.cp.rewrite import CP_RANK, CPLayout, sequence_length, share_batch
from piper_nb.cp.ring_dag import insert_cp_ring

__all__ = ["ContextParallel", "context_parallel", "context_degree", "cut_context",
           "place_context", "insert_cp_collectives", "insert_cp_ring", "CP_RANK", "CPLayout",
           "share_batch", "sequence_length"]
