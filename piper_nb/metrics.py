"""What a training step reports, and TensorBoard event files of it.

`StepMetrics` is one step's loss, global gradient norm (when the plan clips, see
`compiler.clip`; `clip_grad_norm=math.inf` reports it without clipping), learning rate (the
default parameter group's, as the step used it), throughput in samples and, for token
batches, tokens per second, the step time, and the metrics the loss function returned
(`(loss, {"accuracy": acc})`, averaged over the step's microbatches). `pn.train` passes one to `progress(step,
steps, metrics)` after every step and keeps them in `Result.metrics`; with `log_dir` it also
writes them with `torch.utils.tensorboard.SummaryWriter` under `train/...`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import torch

__all__ = ["StepMetrics", "TensorBoardLog", "batch_tokens"]


@dataclass(frozen=True)
class StepMetrics:
    """One training step's figures, as `pn.train` reports them (`Result.metrics`, the
    `progress` callback, TensorBoard)."""

    step: int
    loss: float
    step_time: float                  # seconds
    samples_per_s: float
    lr: float | None = None
    grad_norm: float | None = None    # before clipping, as clip_grad_norm_ returns it
    tokens_per_s: float | None = None  # batches of token ids only
    metrics: dict = field(default_factory=dict)   # the loss function's, averaged over the step

    def text(self) -> str:
        parts = [f"loss {self.loss:.4f}", *(f"{k} {v:.4g}" for k, v in self.metrics.items())]
        if self.grad_norm is not None:
            parts.append(f"grad norm {self.grad_norm:.3g}")
        if self.lr is not None:
            parts.append(f"lr {self.lr:.3g}")
        rate = (f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s is not None
                else f"{self.samples_per_s:,.1f} samples/s")
        return "  ".join([*parts, rate, f"{self.step_time * 1e3:.1f} ms/step"])


def batch_tokens(named: dict[str, torch.Tensor]) -> int | None:
    """Tokens in a batch whose first tensor holds token ids (integers), else None."""
    first = next(iter(named.values()), None)
    if first is None or first.is_floating_point() or first.dtype == torch.bool:
        return None
    return first.numel()


class TensorBoardLog:
    """`train/loss`, `train/grad_norm`, `train/lr`, `train/samples_per_s`,
    `train/tokens_per_s` and `train/step_time` per step, in `log_dir`."""

    def __init__(self, log_dir: str | os.PathLike):
        from piper_nb.extras import require
        require("tensorboard", "pn.train(log_dir=...)")
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=os.fspath(log_dir))

    def write(self, m: StepMetrics) -> None:
        values = {k: v for k, v in asdict(m).items() if k not in ("step", "metrics")}
        values.update({f"metric/{k}": v for k, v in m.metrics.items()})
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self.writer.add_scalar(f"train/{name}", value, m.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
