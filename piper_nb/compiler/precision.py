"""Mixed precision: `pn.compile(..., precision="bf16")`.

The plan is compiled on a bf16 copy of the model (its parameters and buffers cast, as
Megatron-LM's `Float16Module` and FSDP's `param_dtype` do) with the batch's floating
tensors cast too, so every value, saved activation and gradient the plan knows of is bf16,
and the memory model and the simulator size them so. The optimizer keeps fp32 master
weights (copied from the bf16 parameters at the first update, as Megatron's optimizer
does) and fp32 state: the update converts the gradients to fp32, steps the masters and
copies them back into the bf16 parameters (`runtime.update`).

Gradients are reduced (data-parallel all-reduce, ZeRO reduce-scatter, tied weights) in
`reduce_dtype`: "fp32" by default, as Megatron-LM (`--accumulate-allreduce-grads-in-fp32`,
forced on for bf16) and DeepSpeed's bf16 mode do; "bf16" halves the traffic, as FSDP's
`MixedPrecisionPolicy(reduce_dtype=None)` does.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from piper_nb.capture.annotate import derived
from piper_nb.capture.batch import Batch
from piper_nb.errors import PlanError
from piper_nb.plan.precision import DTYPE_NAMES, PRECISIONS

__all__ = ["check_precision", "cast_spec", "cast_batch"]


def check_precision(precision: str, reduce_dtype: str | None) -> tuple[str, str | None]:
    """(precision, the reduction's dtype name or None for the gradients' own)."""
    if precision not in PRECISIONS:
        raise PlanError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        if reduce_dtype not in (None, "fp32"):
            raise PlanError("reduce_dtype applies to precision='bf16' only; fp32 plans reduce "
                            "in fp32")
        return precision, None
    reduce_dtype = "fp32" if reduce_dtype is None else reduce_dtype
    if reduce_dtype not in PRECISIONS:
        raise PlanError(f"reduce_dtype must be 'fp32' or 'bf16', got {reduce_dtype!r}")
    return precision, DTYPE_NAMES[reduce_dtype]


def cast_spec(spec, precision: str):
    """`spec` for a model in `precision`: a cast copy (made once per spec), or `spec`."""
    if precision == "fp32":
        return spec
    cache = derived(spec)
    key = ("precision", precision)
    if key not in cache:
        model = copy.deepcopy(spec.model).to(PRECISIONS[precision])
        cache[key] = dataclasses.replace(spec, model=model)
    return cache[key]


def cast_batch(batch: Batch, precision: str) -> Batch:
    """The batch with its floating tensors in `precision` (token ids stay integers)."""
    dtype = PRECISIONS.get(precision, torch.float32)
    return batch if dtype == torch.float32 else batch.cast(dtype)
