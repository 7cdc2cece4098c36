"""Running a user's model without changing it.

`pn.compile` runs every region once to learn shapes and saved bytes, and the profiler
times them; a training-mode forward moves BatchNorm's running statistics and its batch
counter, and random operations draw from torch's generator. Inside `untouched(model)` both
are undone on the way out: every buffer gets its values back (in place, so the user's
tensors stay the ones they hold) and the CPU random state is restored.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["untouched"]


@contextlib.contextmanager
def untouched(model: nn.Module) -> Iterator[None]:
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, value in saved:
                    if buf.shape == value.shape:
                        buf.copy_(value)
