"""Tensor parallelism, in one place: the directive, the module rewrite, its passes in each
phase of the compile, the widening of the lowered plan and the shard arithmetic the runtime
reads (Megatron's tensor parallelism; Shoeybi et al. 2019).

One public entry per phase of the compile (`compiler.passes.PHASES`):

| phase | entry | what it does |
|---|---|---|
| capture | `shard_regions` | matched regions cut into parts between collectives, layers sharded (`rewrite`) |
| DAG | `place_tensor_parallel` | unplaced sharded passes on their group's first device |
| DAG | `insert_tp_collectives` | the all-reduces between a sharded region's parts |
| plan | `widen_plan` | every group member runs its first device's list (`widen`) |

The value `TensorParallel` and its constructor `pn.tensor_parallel` are in `directive`;
the styles a plan names (`colwise`, `rowwise`, `vocab`, ...) in `styles`; the analysis and
the rewrite of a sharded region in `rewrite` and the modules it calls (`parts`, `shapes`,
`fused`, `reductions`, `vocab`, `loss`, `dropout`, `checks`, `match`). The plan records the
groups and the sharded parameters as typed fields (`Plan.tp_groups`, `Plan.tp_params`);
the runtime cuts and joins parameters with `local_shard` and `join_shards`, and names a
part's graph (`PART`) and a device's rank in its group (`TP_RANK`) as they do. Context
parallelism (`cp`) cuts its regions into parts with the same `build_parts`.
"""

from piper_nb.tp.directive import (
    TensorParallel,
    insert_tp_collectives,
    place_tensor_parallel,
    shard_regions,
    tensor_parallel,
    tp_groups,
)
from piper_nb.tp.dropout import draws_random, dropout_of
from piper_nb.tp.parts import PART, Info, build_parts
from piper_nb.tp.parts import P as PARTIAL
from piper_nb.tp.parts import R as REPLICATED
from piper_nb.tp.reductions import reduced_dims
from piper_nb.tp.rewrite import TPLayout
from piper_nb.tp.shapes import localize, op_target
from piper_nb.tp.shards import join_shards, local_shard
from piper_nb.tp.styles import Style, model_tp_plan, style_of
from piper_nb.tp.vocab import TP_RANK
from piper_nb.tp.widen import widen_plan

__all__ = ["TensorParallel", "tensor_parallel", "tp_groups", "shard_regions",
           "place_tensor_parallel", "insert_tp_collectives", "widen_plan", "TPLayout",
           "local_shard", "join_shards", "Style", "model_tp_plan", "style_of", "PART", "TP_RANK",
           "Info", "build_parts", "PARTIAL", "REPLICATED", "localize",
           "op_target", "reduced_dims", "dropout_of", "draws_random"]
