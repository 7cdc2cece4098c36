"""`Result`: what `pn.train` and `pn.reference_train` return (losses, step times, metrics,
the measured trace, the trained model and optimizer state), and the checks and copies of a
model both make."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from piper_nb.errors import PlanError
from piper_nb.metrics import StepMetrics
from piper_nb.sim.trace import Trace

__all__ = ["Result", "model_template", "check_materialized"]




@dataclass
class Result:
    """Losses and step times per step, the metrics of every step (`StepMetrics`: gradient
    norm, learning rate, throughput), the measured trace of the last step, the model.

    `trace.meta` holds the step number, the world and, for an expert plan, `"tokens"`: the
    routing that step made (`"value@mb"` -> rows per group member), which
    `MemorySettings(tokens=...)` takes to size the simulated token buffers the same way. On
    GPUs, `"cuda_max_allocated"`: device -> `torch.cuda.max_memory_allocated` over the step
    (compare with a simulation under `MemorySettings.for_cuda(nccl=False)`: NCCL's own
    buffers are outside PyTorch's allocator, and so outside that figure)."""

    losses: list[float]
    step_times: list[float]                 # seconds, step start to the last device's end
    trace: Trace | None
    # canonical parameter name -> tensor, and buffer name -> tensor for trained buffers
    params: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    template: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    aliases: dict[str, str] = field(repr=False, default_factory=dict)
    leftover: list[str] = field(default_factory=list)  # buffers a plan never freed
    skipped: list[int] = field(default_factory=list)   # steps whose batch drop_last skipped
    metrics: list[StepMetrics] = field(default_factory=list)   # one per step trained
    optimizer_state: dict = field(repr=False, default_factory=dict)
    # per step, the seconds the slowest worker spent compiling regions (`compile_regions`:
    # the first step's, included in its step time; 0 after)
    compile_s: list[float] = field(default_factory=list)

    def optimizer_state_dict(self) -> dict:
        """The optimizer's state after the last step, for the whole model: `{"state":
        {parameter name: {"exp_avg": ..., "step": ...}}, "param_groups": [{settings...,
        "params": [names]}]}`, keyed by canonical parameter names as FSDP's full
        `optim_state_dict` is; ZeRO shards are gathered back into full tensors."""
        return {"state": {n: {k: v.clone() if isinstance(v, torch.Tensor) else v
                              for k, v in st.items()}
                          for n, st in self.optimizer_state.get("state", {}).items()},
                "param_groups": [dict(g, params=list(g["params"]))
                                 for g in self.optimizer_state.get("param_groups", [])]}

    @property
    def grad_norms(self) -> list[float | None]:
        """The global gradient norm of every step (None where the plan does not clip)."""
        return [m.grad_norm for m in self.metrics]

    @property
    def lrs(self) -> list[float | None]:
        """The learning rate every step used (the default parameter group's)."""
        return [m.lr for m in self.metrics]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full trained model, keyed like `model.state_dict()` (tied names included),
        buffers as trained (BatchNorm's running statistics)."""
        out = {}
        for name, value in self.template.items():
            key = self.aliases.get(name, name)
            out[name] = self.params[key].clone() if key in self.params else value.clone()
        return out


def check_materialized(model: nn.Module, where: str) -> None:
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise PlanError(f"{where}: the model is on the meta device (parameter {meta} has no "
                        "data): plan and simulate it as it is, but to train, build it on a real "
                        "device (or load weights into it: model.to_empty(device='cpu') then "
                        "load_state_dict) and compile again")



def model_template(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


