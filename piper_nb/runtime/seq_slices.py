"""Inputs a forward keeps as its device's sequence slice (`Pass.slices`, `compiler.regather`):
what autograd saves of them refers to the whole input gathered again before the backward.

A sharded part under sequence parallelism reads the whole sequence, all-gathered; its
linear layers save it for their weight gradients. `SliceSaver` stores this device's slice
of each such input as the value `slice_name(v)` (the plan's regather all-gather reads it)
and packs every tensor autograd saves in that input's storage as a `_Saved`: its size,
stride and offset in the input. Unpacked in the backward, it is that view of the input as
the regather made it whole again (`values.acts`), so the stash holds the slice, not the
sequence, and the backward computes what it would have from the input kept whole.
"""

from __future__ import annotations

import torch

from piper_nb.capture.sequence_ops import member_slice
from piper_nb.plan.instr import slice_name
from piper_nb.plan.sizes import storage_key

__all__ = ["SliceSaver", "unpack"]


class _Saved:
    """A saved view of an input kept as a slice: found again, whole, in `acts`."""

    __slots__ = ("acts", "key", "size", "stride", "offset", "where")

    def __init__(self, acts: dict, key: tuple[str, int], t: torch.Tensor, base: int, where: str):
        self.acts, self.key, self.where = acts, key, where
        self.size, self.stride, self.offset = tuple(t.size()), t.stride(), t.storage_offset() - base

    def whole(self) -> torch.Tensor:
        t = self.acts.get(self.key)
        if t is None:
            v, mb = self.key
            raise RuntimeError(f"the backward of {self.where} reads input {v}@{mb}, kept as this "
                               "device's sequence slice, but it was not gathered again: the plan "
                               "has no regather ALL_GATHER before it, or frees it too early")
        return t.as_strided(self.size, self.stride, self.offset)


def unpack(p):
    """The saved tensor: a `_Saved`'s view of the gathered input, anything else as it is."""
    return p.whole() if isinstance(p, _Saved) else p


class SliceSaver:
    """The forward `where` of microbatch `mb` keeps `inputs` (name -> the whole tensor it
    reads) as this device's slice (member `rank` of `degree[name]`): the slices are stored
    in `acts` now, and `pack` turns autograd's saves of the inputs into `_Saved` (None for
    any other tensor)."""

    def __init__(self, acts: dict, mb: int, inputs: dict[str, torch.Tensor], rank: int,
                 degree: dict[str, int], where: str):
        self.acts, self.mb, self.where = acts, mb, where
        self.mine: dict = {}
        for v, x in inputs.items():
            if not x.is_contiguous():
                raise RuntimeError(f"{where}: input {v}@{mb}, kept as a sequence slice, is not "
                                   "contiguous; its gathered copy would not match its views")
            acts[(slice_name(v), mb)] = member_slice(x, rank, degree[v]).clone()
            self.mine[storage_key(x)] = (v, x.storage_offset())

    def pack(self, t: torch.Tensor) -> _Saved | None:
        try:
            hit = self.mine.get(storage_key(t))
        except (RuntimeError, NotImplementedError):
            return None
        if hit is None:
            return None
        v, base = hit
        return _Saved(self.acts, (v, self.mb), t, base, self.where)

    def hooks(self):
        """The saved-tensor hooks of a forward that counts nothing."""
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self.pack(t) or t, unpack)
