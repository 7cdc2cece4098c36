"""Sizes: what flows between regions (`ValueInfo`), how many bytes a value, a bucket or a
message holds, and how saved activations are counted (`SavedBytes`), the same way by the
compiler's shape propagation, the runtime and the memory model, so that predicted and
measured memory agree byte for byte."""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from piper_nb.ir.kinds import Purpose

__all__ = ["ValueInfo", "random_value", "storage_key", "SavedBytes", "value_bytes",
           "bucket_bytes", "message_bytes", "element_size", "NORM_BYTES"]

NORM_BYTES = 8         # clipping's all-reduce: one float64, a device's share of the squared norm


@dataclass(frozen=True)
class ValueInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool


def random_value(info: ValueInfo, shape: tuple[int, ...] | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
    """A tensor shaped like value `info` (or `shape`), of its dtype: random normal floats,
    zeros for an integer value (token ids, labels)."""
    dtype = getattr(torch, info.dtype)
    shape = info.shape if shape is None else shape
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.zeros(shape, dtype=dtype)


def storage_key(t: torch.Tensor):
    """What tells storages apart: the data pointer, or for a tensor on the meta device
    (every meta storage has pointer 0) the storage's identity."""
    storage = t.untyped_storage()
    return StorageWeakRef(storage) if t.is_meta else storage.data_ptr()


class SavedBytes(contextlib.AbstractContextManager):
    """Counts the distinct storages autograd saves inside the block, minus `exclude` keys
    (`storage_key`: data pointers for real tensors) and what `pack` saves otherwise (which
    `unpack` then gives back). `split` then tells the region's own saved bytes from the
    storages of its inputs and outputs that autograd saved: those are value buffers, held
    by the stash past their last reader and counted once with them."""

    def __init__(self, exclude: set[int], pack=None, unpack=None):
        self.exclude = exclude
        self.seen: dict = {}   # storage key -> bytes
        self.first = pack      # what saves a tensor otherwise (-> None: counted as it is)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack or (lambda t: t))

    @property
    def bytes(self) -> int:
        """Bytes of every distinct storage saved (inputs and outputs included)."""
        return sum(self.seen.values())

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        other = self.first(t) if self.first is not None else None
        if other is not None:   # saved some other way (`runtime.seq_slices`): not counted
            return other
        try:
            ptr = storage_key(t)
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr not in self.exclude and ptr not in self.seen and size:
            self.seen[ptr] = size
        return t

    def split(self, inputs, outputs) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
        """(bytes saved in storages of neither an input nor an output; positions of the
        `inputs` whose storage autograd saved; positions of the `outputs` whose storage it
        saved and that no input shares). Each value is its own buffer, whichever storage
        it shares here (a received value does not). An entry that is None or no tensor is
        skipped (a batch input, which no stash holds: its storage goes in `exclude`)."""

        def hits(tensors, seen) -> tuple[tuple[int, ...], set]:
            out, keys = [], set()
            for i, t in enumerate(tensors):
                if not isinstance(t, torch.Tensor):
                    continue
                try:
                    key = storage_key(t)
                except (RuntimeError, NotImplementedError):
                    continue
                if key in seen:
                    out.append(i)
                    keys.add(key)
            return tuple(out), keys

        kept_in, used = hits(inputs, self.seen)
        rest = {k: b for k, b in self.seen.items() if k not in used}
        kept_out, more = hits(outputs, rest)
        return sum(b for k, b in rest.items() if k not in more), kept_in, kept_out

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


@functools.cache
def element_size(dtype: str) -> int:
    """Bytes of one element of dtype `dtype` (a torch dtype's name: `float32`)."""
    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def value_bytes(info) -> int:
    """Bytes of one value (a `ValueInfo`), without allocating anything."""
    return math.prod(info.shape) * element_size(info.dtype)


def bucket_bytes(plan, bucket: int) -> int:
    """Bytes of one bucket's full (unsharded) flat buffer."""
    total = 0
    for p in plan.buckets[bucket].params:
        shape, dtype = plan.params[p]
        total += math.prod(shape) * element_size(dtype)
    return total


def message_bytes(plan, ins) -> int:
    """Bytes one SEND/RECV or collective moves (a collective: its full buffer)."""
    if ins.is_scalar:
        return NORM_BYTES
    if 0 <= ins.bucket < len(plan.buckets):
        full = bucket_bytes(plan, ins.bucket)
        reduce = getattr(plan, "reduce_dtype", None)
        if reduce and ins.purpose == Purpose.GRAD:   # a bf16 plan may reduce gradients in fp32
            first = plan.params[plan.buckets[ins.bucket].params[0]][1]
            return full * element_size(reduce) // element_size(first)
        return full
    return sum(value_bytes(plan.values[v]) for v in ins.data.values if v in plan.values)
