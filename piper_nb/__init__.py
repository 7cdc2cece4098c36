"""piper_nb: a programmable distributed training system for PyTorch that lives in Jupyter.

Tag regions of a model (`annotate`), write a program of directives (`place`, `replicate`,
`shard`, `split`, `order`, `recompute`, `float8`, `compile_regions`, `tensor_parallel`,
schedules), `compile` it into
checked per-device plans, `simulate` them, and `train` on real torch.distributed workers.
"""

from piper_nb import extras, models, optim, profile, schedules
from piper_nb.capture import annotate, cut_stages, expert_slices, pipeline_units, region
from piper_nb.cluster import IPyParallelCluster, JobRank, LocalCluster
from piper_nb.compiler.compile import compile
from piper_nb.cp import context_parallel
from piper_nb.directives.spec import (
    Program,
    compile_regions,
    float8,
    order,
    place,
    recompute,
    replicate,
    shard,
    split,
)
from piper_nb.errors import PlanError, RuntimeFailure, WorkerLost
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import Op, Purpose
from piper_nb.ir.node import Edge, Node
from piper_nb.ir.validate import validate
from piper_nb.metrics import StepMetrics
from piper_nb.plan.files import SavedPlan, load_plan
from piper_nb.plan.instr import Instr
from piper_nb.plan.plan import DevicePlan, Plan
from piper_nb.planner import SearchResult, search
from piper_nb.profile import CostModel, simulate
from piper_nb.sim import HardwareSpec, HostModel, MemorySettings, Topology, Trace
from piper_nb.sim.memory import MIXED_PRECISION_ADAM, device_model_states, zero_model_states
from piper_nb.tp import tensor_parallel
from piper_nb.train import Result, reference_train, train

__all__ = ["annotate", "cut_stages", "expert_slices", "region", "compile", "Plan", "DevicePlan",
           "Instr", "Program", "place", "replicate", "shard", "split", "order", "recompute",
           "float8", "compile_regions", "tensor_parallel", "context_parallel", "PlanError",
           "RuntimeFailure", "WorkerLost", "TrainingDAG", "Node", "Edge", "Op", "Purpose", "validate",
           "models", "schedules", "CostModel", "HostModel", "HardwareSpec", "Topology",
           "MemorySettings",
           "Trace", "simulate", "train", "reference_train", "LocalCluster", "IPyParallelCluster",
           "optim", "Result", "StepMetrics", "Designer", "profile", "extras",
           # the memory model's accounting, for tutorials that check it against the ZeRO paper
           "device_model_states", "zero_model_states", "MIXED_PRECISION_ADAM",
           "pipeline_units", "search", "SearchResult", "load_plan", "SavedPlan", "JobRank"]


def __getattr__(name: str):
    # the notebook UI loads ipywidgets and plotly: only when asked for
    if name == "Designer":
        from piper_nb.extras import require
        for module in ("ipywidgets", "anywidget", "plotly"):
            require(module, "pn.Designer")
        from piper_nb.ui import Designer
        return Designer
    raise AttributeError(f"module 'piper_nb' has no attribute {name!r}")
