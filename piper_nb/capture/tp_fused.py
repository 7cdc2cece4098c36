"""Fused outputs are found, not assumed: a colwise layer whose output is then split into
k parts along the dimension it is sharded on (a fused q, k, v projection `chunk(3)`-ed or
`split([d, d, d])`, a fused gate and up `chunk(2)`-ed) holds, on each device, a share of
each of the k blocks only when it is cut `colwise:k`; cut as one block, device 0 would hold
q and half of k, and training would differ from one process without a word.

`localize` (`capture.tp_shapes`) follows each sharded layer's output through the part,
carrying its (module path, blocks) (`Origin`); at each split along the sharded dimension
`split_parts` checks the parts against the blocks and divides the split's sizes for a
device's share. Megatron spells the same thing out by hand (its fused QKV layer's
`num_query_groups` and the interleaved layout it needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from piper_nb.errors import PlanError

__all__ = ["Origin", "split_parts"]

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
