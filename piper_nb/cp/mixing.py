"""Ops that mix tokens outside attention, which a region cut over the context cannot run
on a device's share: each device would mix only its own tokens, a silent per-device
answer. Found after the cut (`tp.localize` says which dimension each op's input is cut
along): a reduction over the sequence (a mean over the tokens, a cumulative sum, a
softmax over them), a linear layer or product contracting it, a convolution or
BatchNorm over it. A loss's reduction to its scalar is exempt (what only the loss outputs
read, reduced to one number: each device's mean over its tokens, which the plan averages,
`Plan.loss_scale`), also when the loss spans regions (a tensor-parallel region's parts: its
label count made in the first part, `loss_values`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from piper_nb.errors import PlanError
from piper_nb.ir.loss_outputs import is_loss_output
from piper_nb.tp import op_target, reduced_dims

__all__ = ["check_mixing", "loss_values"]

_A = torch.ops.aten
_LINEAR = {_A.linear.default, F.linear}
_PRODUCTS = {_A.matmul.default, _A.mm.default, _A.bmm.default, torch.matmul, torch.bmm,
             _A.addmm.default}
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.modules.batchnorm._BatchNorm, nn.GroupNorm,
         nn.InstanceNorm1d)


def check_mixing(gm: fx.GraphModule, info, cut: dict, shapes: dict,
                 to_loss: frozenset[str] = frozenset()) -> None:
    """PlanError at the first op of `gm` (region `info`) that mixes the tokens along the
    dimension its input is cut along (`cut`: op name -> that dimension; `shapes`: node
    name -> its shape on the share), unless only the loss reads it (`to_loss`: the
    region outputs only later regions' losses read, `loss_values`)."""
    loss_only = None   # what only the loss outputs read: found at the first reduction
    for n in gm.graph.nodes:
        d = cut.get(n.name)
        x = next(iter(n.all_input_nodes), None)
        if d is None or x is None or shapes.get(x.name) is None:
            continue
        scalar = shapes.get(n.name) is not None and all(s == 1 for s in shapes[n.name])
        if scalar:
            loss_only = _loss_only(gm, info, to_loss) if loss_only is None else loss_only
            if n in loss_only:
                continue
        ndim = len(shapes[x.name])
        if _mixes(gm, n, d, ndim):
            raise PlanError(
                f"context_parallel: region {info.name} mixes the tokens of the sequence at "
                f"{n.name} ({n.format_node()}), over dimension {d} of "
                f"{list(shapes[x.name])}, which each device holds only its share of: its "
                "result would differ per device. Context parallelism mixes tokens in "
                "attention only; keep this op out of the regions it cuts, or mix in "
                "attention", op="context_parallel")


def _mixes(gm, n: fx.Node, d: int, ndim: int) -> bool:
    target, at = op_target(n) if n.op == "call_function" else (n.target, 0)
    if d in reduced_dims(gm, n, ndim, target, at):
        return True
    if n.op == "call_module":
        return isinstance(gm.get_submodule(str(n.target)), (nn.Linear,)) and d == ndim - 1 \
            or isinstance(gm.get_submodule(str(n.target)), _CONV)
    if target in _LINEAR:
        return d == ndim - 1
    if target in _PRODUCTS or (n.op == "call_method" and n.target in ("matmul", "bmm")):
        return d == ndim - 1
    return False


def loss_values(regions, modules) -> frozenset[str]:
    """The region outputs that only losses read, in whichever region they are made (a
    label count the first part of a region makes for the loss in its last)."""
    found: set[str] = set()
    readers: dict[str, list[bool]] = {}   # value -> per reading region: only to its loss?
    for info, gm in reversed(list(zip(regions, modules, strict=True))):
        made = [v for v in info.outputs if not is_loss_output(v)]
        found |= {v for v in made if readers.get(v) and all(readers[v])}
        only = _loss_only(gm, info, frozenset(found))
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for ph, v in zip(phs, info.inputs, strict=True):
            readers.setdefault(v, []).append(ph in only)
    return frozenset(found)


def _loss_only(gm: fx.GraphModule, info, to_loss: frozenset[str] = frozenset()
               ) -> set[fx.Node]:
    """The ops only the region's loss outputs (and outputs in `to_loss`) read."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    others = [a for v, a in zip(info.outputs, out.args[0], strict=True)
              if not is_loss_output(v) and v not in to_loss and isinstance(a, fx.Node)]
    reach, todo = set(), list(others)
    while todo:
        n = todo.pop()
        if n not in reach:
            reach.add(n)
            todo.extend(n.all_input_nodes)
    return {n for n in gm.graph.nodes if n not in reach and n.op != "output"}
