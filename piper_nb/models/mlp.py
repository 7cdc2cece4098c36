"""MLP: the smallest example model, a stack of `depth` Linear+tanh blocks doing regression.

It is the "hello world" of pipeline parallelism (each `layers.i` is a natural stage), in the
spirit of the toy models in GPipe/PipeDream tutorials. The targets come from a fixed random
teacher network, so the model has something real to learn.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import seeded

__all__ = ["MLP"]

_TEACHER_SEED = 1234  # the teacher is the same for every batch seed: one task, many samples


class MLP(nn.Module):
    """`depth` blocks of Linear(+Linear)+tanh mapping [B, dim] -> [B, dim].

    Each block is dim->dim (hidden=None) or dim->hidden->dim. Trained with MSE against a
    fixed random teacher `tanh(x @ W)`.
    """

    def __init__(self, dim: int = 16, depth: int = 4, hidden: int | None = None, seed: int = 0):
        super().__init__()
        self.config = dict(dim=dim, depth=depth, hidden=hidden, seed=seed)
        self.name = f"MLP-{depth}x{dim}"
        self.dim = dim
        with seeded(seed):
            self.layers = nn.ModuleList([self._block(dim, hidden) for _ in range(depth)])

    @staticmethod
    def _block(dim: int, hidden: int | None) -> nn.Module:
        if hidden is None:
            return nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        return nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def loss_fn(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean squared error, averaged over every element of the batch."""
        return F.mse_loss(output, targets, reduction="mean")

    def example_batch(
        self, batch_size: int, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [B, dim] float32, targets [B, dim] float32); targets = tanh(x @ W)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(batch_size, self.dim, generator=g)
        teacher = torch.Generator().manual_seed(_TEACHER_SEED)
        w = torch.randn(self.dim, self.dim, generator=teacher) / self.dim**0.5
        return x, torch.tanh(x @ w)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config.items())
