"""The precisions a plan may be compiled in, by name: the one table the compiler, the
runtime and the memory model read (`pn.compile(..., precision=)`; see `compiler.precision`
for what a bf16 plan does)."""

from __future__ import annotations

import torch

__all__ = ["PRECISIONS", "DTYPE_NAMES"]

PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}   # name -> the weights' dtype
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16"}          # name -> torch's dtype name
