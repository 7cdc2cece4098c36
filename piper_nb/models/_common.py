"""Small helpers shared by the example models: seeded construction and weight init.

Every example model builds its parameters inside `seeded(seed)`, so two models made with
the same arguments have bit-identical weights without disturbing the caller's global RNG
(the same trick nanoGPT-style notebooks use to make runs reproducible).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["seeded", "init_small"]


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the body with torch's CPU RNG seeded to `seed`, restoring the old state after."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def init_small(module: nn.Module, std: float = 0.02) -> None:
    """nanoGPT's init: N(0, std) for Linear/Embedding weights, zeros for biases."""
    for m in module.modules():
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
