"""The vocabulary-parallel cross-entropy: the loss of a colwise LM head computed from each
device's share of the logits, which are never gathered (Megatron's vocab-parallel
cross-entropy; torchtitan's `loss_parallel`).

A cross-entropy (`F.cross_entropy`, `nn.CrossEntropyLoss`, torch.export's
`aten.cross_entropy_loss`) reading a device's share of the classes is rewritten, in the
sharded region's graph, as: each device's log-sum-exp over its own classes, and the logit
of each token's target where the target is in its range (zero elsewhere), with the sum of
its logits when the loss smooths labels. These few numbers per token go into one stacked
value, each device's log-sum-exp in a column of its own, whose forward all-reduce gives
every device all of them exactly (the other devices add zeros): the whole log-sum-exp is
the log-sum-exp of the columns, the loss per token that minus the target's logit, then
the loss's own `ignore_index`, label smoothing and reduction. In the backward each device's
logits get their softmax share from their own log-sum-exp, and the target's row its -1,
as one process computes them. Per token this sends `degree + 1` (or `+ 2`) numbers, not
the vocabulary.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn import _reduction

from piper_nb.errors import PlanError
from piper_nb.tp.parts import Info
from piper_nb.tp.reductions import ON_SHARE
from piper_nb.tp.vocab import between, own_range, tp_rank

__all__ = ["CROSS_ENTROPY", "loss_readers", "feeds_only_loss", "parallel_cross_entropy"]

CROSS_ENTROPY = (F.cross_entropy, torch.ops.aten.cross_entropy_loss.default)
_A = torch.ops.aten
_REDUCTIONS = ("none", "mean", "sum")   # aten's reduction numbers


def _is_loss(gm, n: fx.Node) -> bool:
    if n.op == "call_function":
        return n.target in CROSS_ENTROPY
    return n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                 nn.CrossEntropyLoss)


def _spread(gm, col: set, row: set) -> set[fx.Node]:
    """The ops that read a device's share (a colwise output, before any rowwise layer)."""
    shared: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if n in col or (n not in row and not _is_loss(gm, n)
                        and any(a in shared for a in n.all_input_nodes)):
            shared.add(n)
    return shared


def loss_readers(gm, col: set, row: set) -> list[fx.Node]:
    """The cross-entropies whose logits are a device's share of the classes."""
    shared = _spread(gm, col, row)
    return [n for n in gm.graph.nodes if _is_loss(gm, n) and n.args and n.args[0] in shared]


def feeds_only_loss(gm, lin: fx.Node, infos: dict) -> bool:
    """Whether `lin`'s output is only the logits of cross-entropies: what it reaches, up to
    them, reads nothing else but sizes (casts, views, a scale)."""
    chain, todo = {lin}, [lin]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                return False
            if _is_loss(gm, u):
                if u.args[0] is not n or n in u.args[1:] or n in u.kwargs.values():
                    return False
                continue
            others = [a for a in u.all_input_nodes if a not in chain]
            if any(infos.get(a.name) is None or infos[a.name].tensor for a in others):
                return False
            if u not in chain:
                chain.add(u)
                todo.append(u)
    return True


def _options(gm, n: fx.Node, where: str) -> tuple[str, int, float]:
    """(reduction, ignore_index, label_smoothing) of a cross-entropy node; PlanError for
    class weights or a target of probabilities, which the rewrite does not cover."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        weight, reduction = mod.weight, mod.reduction
        ignore, smooth = mod.ignore_index, mod.label_smoothing
    elif n.target is F.cross_entropy:
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction", "label_smoothing")
        got = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None,
               "reduction": "mean", "label_smoothing": 0.0}
        got |= dict(zip(names, n.args, strict=False)) | dict(n.kwargs)
        weight, ignore, smooth = got["weight"], got["ignore_index"], got["label_smoothing"]
        reduction = got["reduction"]
        if got["size_average"] is not None or got["reduce"] is not None:
            reduction = _reduction.legacy_get_string(got["size_average"], got["reduce"])
    else:
        args = list(n.args) + [None] * 6
        weight = args[2] if args[2] is not None else n.kwargs.get("weight")
        reduction = _REDUCTIONS[args[3] if args[3] is not None else n.kwargs.get("reduction", 1)]
        ignore = args[4] if args[4] is not None else n.kwargs.get("ignore_index", -100)
        smooth = args[5] if args[5] is not None else n.kwargs.get("label_smoothing", 0.0)
    if weight is not None:
        raise PlanError(f"tensor_parallel: {where}: a vocabulary-parallel cross-entropy "
                        "does not take class weights; gather the logits "
                        "(colwise_gather_output) or keep the head whole (replicate)")
    return reduction, int(ignore), float(smooth)


def parallel_cross_entropy(gm, n: fx.Node, degree: int, infos: dict, where: str) -> fx.Node:
    """Rewrite cross-entropy `n`, whose logits are a device's share, as the module docstring
    says; -> the stacked per-token value, which the cut treats as a rowwise layer's output."""
    reduction, ignore, smooth = _options(gm, n, where)
    x, target = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs["target"]
    shape = infos[x.name].shape
    if infos.get(target.name) is not None and infos[target.name].shape == shape:
        raise PlanError(f"tensor_parallel: {where}: the cross-entropy's target is a "
                        "distribution over the classes, which a vocabulary-parallel loss "
                        "does not take; gather the logits (colwise_gather_output)")
    c = 1 if len(shape) > 1 else 0                     # the class dimension
    vocab = shape[c]
    share, g = vocab // degree, gm.graph
    with g.inserting_before(n):
        rank = tp_rank(gm)
        lse = g.call_function(_A.logsumexp.default, (x, [c]))
        lse.meta[ON_SHARE] = True   # over this device's classes, on purpose
        safe, outside = own_range(g, target, rank, share)
        picked = g.call_function(_A.squeeze.dim, (g.call_function(
            _A.gather.default, (x, c, g.call_function(_A.unsqueeze.default, (safe, c)))), c))
        picked = g.call_function(_A.masked_fill.Scalar, (picked, outside, 0.0))
        cols = [g.call_function(_A.mul.Tensor, (lse, g.call_function(_A.eq.Scalar, (rank, j))))
                for j in range(degree)] + [picked]
        if smooth:
            cols.append(g.call_function(_A.sum.dim_IntList, (x, [c])))
            cols[-1].meta[ON_SHARE] = True
        stacked = g.call_function(_A.stack.default, (cols, -1))
        stats = g.call_function(_A.alias.default, (stacked,))
        whole = g.call_function(_A.logsumexp.default,
                                (g.call_function(_A.slice.Tensor, (stats, -1, 0, degree)), [-1]))
        per = g.call_function(_A.sub.Tensor,
                              (whole, g.call_function(_A.select.int, (stats, -1, degree))))
        if smooth:
            mean_x = g.call_function(_A.div.Tensor,
                                     (g.call_function(_A.select.int, (stats, -1, degree + 1)), vocab))
            uniform = g.call_function(_A.sub.Tensor, (whole, mean_x))
            per = g.call_function(_A.add.Tensor, (g.call_function(_A.mul.Tensor, (per, 1.0 - smooth)),
                                                  g.call_function(_A.mul.Tensor, (uniform, smooth))))
        ignored = g.call_function(_A.eq.Scalar, (target, ignore))
        per = g.call_function(_A.masked_fill.Scalar, (per, ignored, 0.0))
        if reduction == "mean":
            count = g.call_function(_A.sum.default, (g.call_function(_A.logical_not.default, (ignored,)),))
            out = g.call_function(_A.div.Tensor, (g.call_function(_A.sum.default, (per,)), count))
        elif reduction == "sum":
            out = g.call_function(_A.sum.default, (per,))
        else:
            out = per
    infos[rank.name] = Info(True, False)
    for m in between(rank, n):   # the new ops need a gradient where they follow the logits
        infos[m.name] = Info(True, any(infos[a.name].grad for a in m.all_input_nodes
                                       if a.name in infos))
    n.replace_all_uses_with(out)
    g.erase_node(n)
    return stats

