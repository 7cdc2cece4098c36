"""Shape propagation: run the regions once on one microbatch slice to learn what flows.

For every value that crosses regions: shape, dtype, whether it carries a gradient. For
every region: the bytes autograd saves for its backward (parameters excluded). The
runtime counts saved bytes the same way (`saved_bytes`), so predicted and measured
memory agree.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from piper_nb.capture.split import LOSS
from piper_nb.errors import PlanError

__all__ = ["ValueInfo", "random_value", "propagate", "SavedBytes", "region_args"]


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
    (`storage_key`: data pointers for real tensors)."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        try:
            ptr = storage_key(t)
            size = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return t
        if ptr not in self.exclude and ptr not in self.seen and size:
            self.seen.add(ptr)
            self.bytes += size
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


def param_ptrs(capture) -> set[int]:
    ptrs = {storage_key(p) for p in capture.model.parameters()}
    ptrs |= {storage_key(b) for b in capture.model.buffers()}
    return ptrs


def region_args(info, vals: dict, batch: frozenset[str]) -> list[torch.Tensor]:
    """A region's inputs as its forward takes them: a float value that is not in the batch
    (names `batch`) becomes a fresh autograd leaf, as the worker detaches what it receives."""
    args = []
    for v in info.inputs:
        t = vals[v]
        if v not in batch and t.is_floating_point():
            t = t.detach().requires_grad_(True)
        args.append(t)
    return args


def propagate(capture, batch: dict[str, torch.Tensor]):
    """-> (values: name -> ValueInfo, saved: region -> bytes, loss value, changed: region ->
    the buffers its forward changes, such as BatchNorm's running statistics), running the
    regions on the named `batch`. Run inside `capture.untouched` so that the user's model
    keeps its buffers."""
    vals: dict[str, torch.Tensor] = dict(batch)
    names = frozenset(batch)
    saved: dict[int, int] = {}
    changed: dict[int, tuple[str, ...]] = {}
    exclude = param_ptrs(capture)
    loss = None
    for info, mod in zip(capture.regions, capture.modules, strict=True):
        args = region_args(info, vals, names)
        before = {n: b.detach().clone() for n, b in mod.named_buffers()}
        with SavedBytes(exclude | {storage_key(a) for a in args}) as counter:
            outs = mod(*args)
        saved[info.index] = counter.bytes
        moved = [n.removeprefix("model.") for n, b in mod.named_buffers()   # (meta: unknown)
                 if n in before and not b.is_meta and not torch.equal(b, before[n])]
        if moved:
            changed[info.index] = tuple(moved)
        for name, out in zip(info.outputs, outs, strict=True):
            if not isinstance(out, torch.Tensor):
                raise PlanError(f"value {name!r} leaves region {info.name} but is a "
                                f"{type(out).__name__}, not a tensor; move the cut so only "
                                "tensors cross regions")
            if name == LOSS:
                loss = out
            vals[name] = out
    values = {}
    for name, t in vals.items():
        values[name] = ValueInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                 bool(t.requires_grad and t.is_floating_point()))
    return values, saved, loss, changed
