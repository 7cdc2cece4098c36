"""Fused outputs are found, not assumed: a colwise layer whose output is then split into
k parts along the dimension it is sharded on (a fused q, k, v projection `chunk(3)`-ed or
`split([d, d, d])`, a fused gate and up `chunk(2)`-ed) holds, on each device, a share of
each of the k blocks only when it is cut `colwise:k`; cut as one block, device 0 would hold
q and half of k, and training would differ from one process without a word.

`localize` (`tp.shapes`) follows each sharded layer's output through the part,
carrying its (module path, blocks) (`Origin`); at each split along the sharded dimension
`split_parts` checks the parts against the blocks and divides the split's sizes for a
device's share. Megatron spells the same thing out by hand (its fused QKV layer's
`num_query_groups` and the interleaved layout it needs).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from piper_nb.errors import PlanError

__all__ = ["Origin", "pick_parts", "split_parts"]

_A = torch.ops.aten
_SPLITS = {_A.split.Tensor: "split", _A.split_with_sizes.default: "split",
           _A.chunk.default: "chunk", _A.unbind.int: "unbind", torch.split: "split",
           torch.chunk: "chunk", torch.unbind: "unbind", "split": "split",
           "split_with_sizes": "split", "chunk": "chunk", "unbind": "unbind"}


@dataclass(frozen=True)
class Origin:
    """The colwise layer a sharded value comes from and the blocks its cut keeps whole."""

    path: str
    blocks: int


def split_parts(n: fx.Node, target, at: int, d: int | None, whole: tuple, degree: int,
                origin: Origin | None, where: str) -> Origin | None:
    """At a split of a sharded value (its sharded dimension `d`, whole shape `whole`): a
    PlanError when it cuts the sharded dimension into k parts the layer's cut does not keep
    (plain `colwise` for a fused output), else the split's sizes made a device's own;
    -> the parts' origin (None: not a split along `d`)."""
    kind = _SPLITS.get(target) if n.op != "call_module" else None
    if kind is None or d is None or origin is None:
        return None
    rest = list(n.args[at + 1:])
    dim = n.kwargs.get("dim", rest[0 if kind == "unbind" else 1]
                       if len(rest) > (0 if kind == "unbind" else 1) else 0)
    if not isinstance(dim, int) or dim % len(whole) != d:
        return None
    size = rest[0] if kind != "unbind" else None
    if size is None and kind != "unbind":
        size = n.kwargs.get("split_size_or_sections", n.kwargs.get("chunks"))
    if kind == "unbind":
        k = whole[d]
    elif kind == "chunk":
        k = int(size)
    elif isinstance(size, (list, tuple)):
        k = len(size)
    else:
        k = -(-whole[d] // int(size))
    if k == origin.blocks:
        if kind == "split":   # each part's size, a device's share of it
            share = [s // degree for s in size] if isinstance(size, (list, tuple)) \
                else int(size) // degree
            n.args = (*n.args[:at + 1], share, *n.args[at + 2:])
        return Origin(origin.path, 1)
    if k > 1:
        raise PlanError(
            f"tensor_parallel: {where}: {origin.path}'s output is {kind} into {k} parts "
            f"along the dimension it is sharded on ({n.format_node()}): it fuses {k} "
            f"projections, which a cut into {origin.blocks} block(s) mixes across devices; "
            f"give {origin.path.removeprefix('model.')} 'colwise:{k}' in the plan")
    return None


_SELECTS = {_A.select.int: "select", torch.select: "select", "select": "select"}
_SLICES = {_A.slice.Tensor: "slice"}
_NARROWS = {_A.narrow.default: "narrow", _A.narrow: "narrow", torch.narrow: "narrow",
            "narrow": "narrow"}


def pick_parts(n: fx.Node, target, at: int, d: int | None, whole: tuple, degree: int,
               origin: Origin | None, where: str) -> Origin | None:
    """At an index, select, slice or narrow of a sharded value along its sharded dimension
    `d` (a fused output `view`-ed into (k, m) and its parts picked, `h[..., :d]` as Phi3
    takes q): a PlanError for plain `colwise` (a device's share is not the part), a slice
    of one of `colwise:k`'s blocks made a device's share of it; -> the part's origin (None: not
    one along `d`)."""
    if d is None or origin is None or n.op == "call_module":
        return None
    rest = list(n.args[at + 1:])
    if target in _SELECTS or target in _SLICES or target in _NARROWS:
        dim = n.kwargs.get("dim", rest[0] if rest else 0)
        if not isinstance(dim, int) or dim % len(whole) != d:
            return None
        if target in _SELECTS:
            return _picked(n, origin, whole[d], where)
        names = ("start", "length") if target in _NARROWS else ("start", "end", "step")
        bounds = [n.kwargs.get(k, rest[i + 1] if len(rest) > i + 1 else v)
                  for i, (k, v) in enumerate(zip(names, (None, None, 1), strict=False))]
        narrow = target in _NARROWS   # narrow(x, dim, start, length): a slice of `length`
        if narrow and all(isinstance(b, int) for b in bounds):
            start = bounds[0] + whole[d] if bounds[0] < 0 else bounds[0]
            bounds = [start, start + bounds[1]]
        cut = _sliced(n, slice(*bounds), whole[d], degree, origin, where)
        if cut is not None:
            n.args = (*n.args[:at + 2], cut.start, cut.stop - cut.start if narrow else cut.stop,
                      *n.args[at + 4:])
        return Origin(origin.path, 1) if cut is not None else None
    if target is not operator.getitem or len(n.args) < at + 2:
        return None
    idx = n.args[at + 1] if isinstance(n.args[at + 1], tuple) else (n.args[at + 1],)
    if any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) or isinstance(i, bool)
           for i in idx) or sum(i is Ellipsis for i in idx) > 1:
        return None   # a tensor, a traced size: not followed
    taken = sum(isinstance(i, (int, slice)) for i in idx)
    dims, pos = [], 0
    for i in idx:
        dims.append(pos if i is not None and i is not Ellipsis else None)
        pos += (len(whole) - taken) if i is Ellipsis else isinstance(i, (int, slice))
    if d not in dims:
        return None
    at_d = dims.index(d)
    if isinstance(idx[at_d], int):
        return _picked(n, origin, whole[d], where)
    cut = _sliced(n, idx[at_d], whole[d], degree, origin, where)
    if cut is None:
        return None
    fixed = (*idx[:at_d], cut, *idx[at_d + 1:])
    n.args = (*n.args[:at + 1], fixed if isinstance(n.args[at + 1], tuple) else cut,
              *n.args[at + 2:])
    return Origin(origin.path, 1)


def _picked(n: fx.Node, origin: Origin, k: int, where: str):
    raise PlanError(
        f"tensor_parallel: {where}: {origin.path}'s output is indexed along the dimension it "
        f"is sharded on ({n.format_node()}), a device holding only a share of it: if it fuses "
        f"{k} projections (viewed into {k} parts, each taken), give "
        f"{origin.path.removeprefix('model.')} 'colwise:{k}' in the plan and split it with "
        "chunk or split")


def _sliced(n: fx.Node, s: slice, size: int, degree: int, origin: Origin,
            where: str) -> slice | None:
    """A slice along the sharded dimension: None for the whole range; a device's share of
    it when it is one of `origin`'s blocks, else (or traced bounds) a PlanError."""
    if any(v is not None and not isinstance(v, int) for v in (s.start, s.stop, s.step)):
        raise PlanError(
            f"tensor_parallel: {where}: {origin.path}'s output is sliced along the dimension it "
            f"is sharded on ({n.format_node()}) by bounds traced at run time: they must be "
            "constants here, where a device's share of them is worked out; write them as "
            "Python ints, or keep the layer whole (replicate)")
    start, stop, step = s.indices(size)
    if (start, stop, step) == (0, size, 1):
        return None
    width = max(0, stop - start)
    if step == 1 and origin.blocks > 1 and width * origin.blocks == size and start % width == 0:
        return slice(start // degree, stop // degree)
    k = size // width if width and size % width == 0 and step == 1 else None
    hint = f"if it fuses {k} projections, give {origin.path.removeprefix('model.')} " \
        f"'colwise:{k}' in the plan" if k and origin.blocks == 1 else \
        "take whole blocks of its colwise:k cut, or keep the layer whole (replicate)"
    raise PlanError(
        f"tensor_parallel: {where}: {origin.path}'s output is sliced along the dimension it is "
        f"sharded on ({n.format_node()}; [{start}:{stop}:{step}] of {size}), a device holding "
        f"only a share of it: {hint}")
