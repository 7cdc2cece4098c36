"""Where each tensor a device holds sits in the model's own tensors: the geometry of DCP.

A DCP checkpoint stores every tensor under the name `model.state_dict()` gives it, as
chunks: boxes (offsets and sizes) of the whole tensor. A plan's devices hold their tensors
in three cut forms, composed in this order:

- an expert piece `<param>[lo:hi]` is rows lo..hi of its stacked parameter (`plan.pieces`);
- a tensor-parallel parameter is its rank's shard along `dim` (`plan.tp_params`, each of
  `blocks` stacked blocks cut alike: `tp.local_shard`);
- a ZeRO bucket is a flat range of its parameters' local tensors laid end to end
  (`runtime.layout.Layout`), which `boxes` cuts into whole boxes.

`Geometry(plan)` maps a local box of a device's tensor to boxes of the whole tensor
(`to_global`), and cuts the local tensor out of a whole one (`local`), which loading into
any other plan needs.
"""

from __future__ import annotations

import math

import torch

from piper_nb.tp import local_shard

__all__ = ["Box", "Geometry", "boxes"]

Box = tuple[tuple[int, ...], tuple[int, ...]]     # (offsets, sizes)


def boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[Box, int, int]]:
    """The flat range [lo, hi) of a row-major tensor of `shape` as whole boxes, each with
    the flat range it covers: at most a partial row, a block of whole rows and a partial
    row per dimension."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [(((lo,), (hi - lo,)) if shape else ((), ()), lo, hi)]
    inner = math.prod(shape[1:])
    out: list[tuple[Box, int, int]] = []
    row = lo // inner
    if lo % inner:                                   # the first row, partly
        end = min(hi, (row + 1) * inner)
        out += _in_row(shape, row, lo - row * inner, end - row * inner)
        lo, row = end, row + 1
    last = hi // inner
    if lo < hi and last > row:                       # whole rows
        out.append((((row,) + (0,) * (len(shape) - 1), (last - row, *shape[1:])),
                    row * inner, last * inner))
        lo = last * inner
    if lo < hi:                                      # the last row, partly
        out += _in_row(shape, last, lo - last * inner, hi - last * inner)
    return out


def _in_row(shape, row: int, lo: int, hi: int) -> list[tuple[Box, int, int]]:
    inner = math.prod(shape[1:])
    return [(((row, *o), (1, *s)), a + row * inner, b + row * inner)
            for (o, s), a, b in boxes(shape[1:], lo, hi)]


class Geometry:
    """The plan's tensors as parts of the model's: names, whole shapes and the boxes."""

    def __init__(self, plan):
        self.plan = plan
        self.pieces = dict(getattr(plan, "pieces", {}) or {})
        self.tp = dict(plan.tp_params)
        stacked: dict[str, list] = {}
        for name, (full, lo, hi) in self.pieces.items():
            stacked.setdefault(full, []).append((lo, hi, name))
        self.shapes: dict[str, tuple[int, ...]] = {}
        for name, (shape, *_) in plan.params.items():
            if name not in self.pieces:
                self.shapes[name] = self._whole(name, tuple(shape))
        for full, parts in stacked.items():
            rows = max(hi for _, hi, _ in parts)
            one = self._whole(parts[0][2], tuple(plan.params[parts[0][2]][0]))
            self.shapes[full] = (rows, *one[1:])

    def _whole(self, name: str, local: tuple[int, ...]) -> tuple[int, ...]:
        """The shape before tensor parallelism cut it (a piece's: the piece's)."""
        if name not in self.tp:
            return local
        dim, degree, _ = self.tp[name]
        return local[:dim] + (local[dim] * degree,) + local[dim + 1:]

    def fqn(self, name: str) -> str:
        """The model's name of the tensor `name` is a part of."""
        return self.pieces[name][0] if name in self.pieces else name

    def tp_rank(self, device: int) -> int:
        return self.plan.tp_rank(device) if self.tp else 0

    def to_global(self, name: str, rank: int, box: Box) -> list[tuple[Box, tuple[slice, ...]]]:
        """Box `box` of device tensor `name` (on tensor-parallel rank `rank`) as boxes of
        the whole tensor, each with the slices of `box` it takes."""
        offsets, sizes = box
        parts = [(box, tuple(slice(0, s) for s in sizes))]
        if name in self.tp:
            parts = [p for b, rel in parts for p in self._untp(name, rank, b, rel)]
        if name in self.pieces:
            lo = self.pieces[name][1]
            parts = [(((o[0] + lo, *o[1:]), s), rel) for (o, s), rel in parts]
        return parts

    def _untp(self, name: str, rank: int, box: Box, rel: tuple[slice, ...]):
        """A box of a tensor-parallel shard in the unsharded tensor: split where the
        shard's blocks end (each block's slice of the shard lies elsewhere)."""
        dim, degree, blocks = self.tp[name]
        offsets, sizes = box
        whole = self._local_shape(name)[dim] * degree
        seg = whole // degree // blocks                  # a block's share on one rank
        out, at, end = [], offsets[dim], offsets[dim] + sizes[dim]
        while at < end:
            block, inside = divmod(at, seg)
            n = min(end - at, seg - inside)
            start = block * (whole // blocks) + rank * seg + inside
            o = offsets[:dim] + (start,) + offsets[dim + 1:]
            s = sizes[:dim] + (n,) + sizes[dim + 1:]
            r0 = rel[dim].start + at - offsets[dim]
            out.append(((o, s), rel[:dim] + (slice(r0, r0 + n),) + rel[dim + 1:]))
            at += n
        return out

    def _local_shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.plan.params[name][0])

    def local(self, name: str, rank: int, whole: torch.Tensor) -> torch.Tensor:
        """Device tensor `name` of rank `rank`, cut out of the model's whole tensor."""
        t = whole
        if name in self.pieces:
            _, lo, hi = self.pieces[name]
            t = t[lo:hi]
        if name in self.tp:
            dim, degree, blocks = self.tp[name]
            t = local_shard(t, dim, degree, blocks, rank)
        return t
