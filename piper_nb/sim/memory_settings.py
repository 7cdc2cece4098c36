"""`MemorySettings`: what the memory model charges per element of parameters, gradients and
optimizer state, which routing sizes expert buffers, and the GPU allowances beyond the
tensors the runtime counts. A plain value that the memory model (`sim.memory`), its
ledger (`sim.ledger`) and the update's state sizes (`sim.update_state`) all read."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from piper_nb.errors import PlanError
from piper_nb.optim import OptimizerSpec, check_optimizer

__all__ = ["MemorySettings", "DEFAULT_SETTINGS", "MIXED_PRECISION_ADAM", "OPTIMIZER_BYTES"]

# bytes of optimizer state per parameter (fp32 state): SGD none, momentum 1x, Adam(W) 2x
OPTIMIZER_BYTES = {"sgd": 0, "momentum": 4, "sgd_momentum": 4, "adam": 8, "adamw": 8}


@dataclass(frozen=True, kw_only=True)
class MemorySettings:
    """Bytes per parameter element; None means the parameter's own dtype size."""

    param_bytes: float | None = None   # weights
    grad_bytes: float | None = None    # gradients
    optim_bytes: float | None = None   # optimizer state (None: from `optimizer`)
    optimizer: object = "sgd"          # a name in OPTIMIZER_BYTES, or as pn.train takes it
    first_step: bool = False           # optimizer state appears at the update (step 1)
    tokens: dict | None = None         # routing, "value@mb" -> rows per member (sim.tokens)
    # GPU allowances beyond the tensors the runtime counts, added to "buffers" throughout:
    # a fixed share per device (allocator rounding and slack, kernels' workspaces) and a
    # share per communicator the device uses (NCCL's buffers; 0 on CPU). `for_cuda` gives
    # typical figures. NCCL allocates its buffers itself, outside PyTorch's caching
    # allocator: they take device memory (count them against its capacity), but
    # torch.cuda.max_memory_allocated, which a GPU run reports, never sees them; compare
    # that figure with `for_cuda(nccl=False)`.
    reserve_bytes: float = 0.0
    per_communicator: float = 0.0

    @classmethod
    def for_cuda(cls, *, reserve_bytes: float = 64 * 2**20, channels: int = 2,
                 buffer_bytes: float = 4 * 2**20, nccl: bool = True, **kw) -> MemorySettings:
        """Settings with GPU allowances: `reserve_bytes` per device and, with `nccl`, per
        communicator NCCL's `channels` x `buffer_bytes` (NCCL_BUFFSIZE, 4 MiB by default):
        what the device holds. `nccl=False` leaves NCCL's buffers out, as
        torch.cuda.max_memory_allocated does (NCCL allocates them outside PyTorch's
        allocator): the figure to compare a measured step with."""
        return cls(reserve_bytes=reserve_bytes,
                   per_communicator=channels * buffer_bytes if nccl else 0.0, **kw)

    @functools.cached_property
    def spec(self) -> OptimizerSpec | None:
        """The optimizer as `pn.train` builds it (None: sized by name or `optim_bytes`)."""
        opt = self.optimizer
        if self.optim_bytes is not None or isinstance(opt, str):
            return None
        return check_optimizer(opt, "MemorySettings")

    def optim_per_param(self) -> float:
        """Optimizer state bytes per parameter element (the analytic figure)."""
        if self.optim_bytes is not None:
            return self.optim_bytes
        if self.spec is not None:
            return self.spec.per_element()
        key = self.optimizer.lower()
        if key not in OPTIMIZER_BYTES:
            raise PlanError(f"unknown optimizer {self.optimizer!r} for the memory model; use one "
                            f"of {', '.join(OPTIMIZER_BYTES)}, an optimizer factory as pn.train "
                            "takes it, or set optim_bytes=")
        return OPTIMIZER_BYTES[key]

    def optim_state(self, shape: tuple[int, ...], dtype: str, group: int = 0) -> float:
        """Bytes of state one updated tensor keeps: what the optimizer really allocates for
        that shape (its scalar `step` included), or the per-element figure."""
        if self.spec is not None:
            return self.spec.state_bytes(shape, dtype, group)
        return math.prod(shape) * self.optim_per_param()

    def group_of(self, name: str) -> int:
        return self.spec.group_of(name) if self.spec is not None else 0


# the ZeRO paper's mixed-precision Adam: fp16 weights and grads, 12 bytes of fp32 state
MIXED_PRECISION_ADAM = MemorySettings(param_bytes=2, grad_bytes=2, optim_bytes=12)

DEFAULT_SETTINGS = MemorySettings()   # each tensor's own dtype, SGD's (empty) state
