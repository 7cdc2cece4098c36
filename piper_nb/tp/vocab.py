"""The vocabulary-parallel embedding (the `vocab` style of `tp.styles`): an
embedding rewritten, in a sharded region's graph, as one device's share of it; and the
gathered output of a colwise LM head (`colwise_gather_output`).

Each device holds `vocab / degree` rows of the weight (rows `rank * share` onward, cut by
`tensor_parallel.local_shard` like any sharded weight). It looks up the tokens in its range
and writes zeros for the others, so the devices' outputs are a partial sum that the
forward all-reduce after the part completes: every token's row comes from the one device
that holds it, plus zeros, exactly. The rank is a buffer of the part (`TP_RANK`, 0 in the
capture), which each worker sets to its own (`runtime.worker`). A padding index keeps its
row's value and gets no gradient, as in `nn.Embedding`.

A gathered colwise output is each device's share of the columns placed at its own offset
in zeros (multiplied by 1 there and by 0 elsewhere, which is exact), so the same
all-reduce makes the whole output on every device; its backward is each device's
columns of the whole gradient.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

from piper_nb.errors import PlanError
from piper_nb.tp.parts import Info

__all__ = ["TP_RANK", "EMBEDDING", "vocab_embedding", "gathered_output", "tp_rank", "own_range",
           "between"]

TP_RANK = "_pn_tp_rank"   # a part's own tensor-parallel rank, set by each worker
EMBEDDING = torch.ops.aten.embedding.default


def vocab_embedding(gm, n: fx.Node, path: str, gm0, degree: int, infos: dict):
    """Rewrite embedding node `n` of module `path` in `gm` as a device's share (see the
    module docstring); -> (the lookup, the masked output, the weight's get_attr target),
    which the cut treats as a colwise layer's output and a rowwise one's."""
    if n.op == "call_module":
        mod = gm0.get_submodule(path)
        ids, pad = n.args[0], mod.padding_idx
        vocab, odd = mod.num_embeddings, (mod.max_norm is not None or mod.scale_grad_by_freq
                                           or mod.sparse)
    else:
        args = list(n.args) + [None] * 5
        if n.target == EMBEDDING:
            ids, pad, odd = args[1], args[2], bool(args[3]) or bool(args[4])
            pad = None if pad is None or pad < 0 else pad
        else:
            ids, pad = args[0], args[2] if args[2] is not None else n.kwargs.get("padding_idx")
            odd = any(n.kwargs.get(k) for k in ("max_norm", "scale_grad_by_freq", "sparse"))
        vocab = gm0.get_parameter(f"{path}.weight").shape[0]
    name = path.removeprefix("model.")
    if odd:
        raise PlanError(f"tensor_parallel: {name} (vocab) uses max_norm, scale_grad_by_freq "
                        "or sparse gradients, which a vocabulary-parallel embedding does not "
                        "support; replicate it")
    if vocab % degree:
        raise PlanError(f"tensor_parallel: {name} (vocab) has {vocab} rows, which {degree} "
                        f"devices cannot divide; pad the vocabulary to a multiple of {degree} "
                        "or replicate it")
    share, g, A = vocab // degree, gm.graph, torch.ops.aten
    first = n.prev   # the new nodes go between it and n
    with g.inserting_before(n):
        w = g.get_attr(f"{path}.weight")
        safe, outside = own_range(g, ids, tp_rank(gm), share)
        look = g.call_function(F.embedding, (safe, w))
        got = look
        if pad is not None:   # the padding row's value, without its gradient
            still = g.call_function(A.detach.default, (look,))
            at_pad = g.call_function(A.unsqueeze.default,
                                     (g.call_function(A.eq.Scalar, (ids, pad)), -1))
            got = g.call_function(A.where.self, (at_pad, still, look))
        out = g.call_function(A.masked_fill.Scalar, (
            got, g.call_function(A.unsqueeze.default, (outside, -1)), 0.0))
    whole, lookups = infos.get(n.name, Info(True, True)), {look, got, out}
    for m in between(first, n):
        infos[m.name] = whole if m in lookups or m.target == A.detach.default \
            else Info(True, False)
    n.replace_all_uses_with(out)
    g.erase_node(n)
    return look, out, f"{path}.weight"


def tp_rank(gm) -> fx.Node:
    """A get_attr of the part's rank buffer (made, as 0, on first use), at the insert point."""
    if not hasattr(gm, TP_RANK):
        gm.register_buffer(TP_RANK, torch.tensor(0))
    return gm.graph.get_attr(TP_RANK)


def own_range(g: fx.Graph, ids: fx.Node, rank: fx.Node, share: int) -> tuple[fx.Node, fx.Node]:
    """(ids made this device's own: `ids - rank * share`, 0 outside its range; where they
    are outside), made at the insert point: the rows of a vocabulary cut `share` per device."""
    A = torch.ops.aten
    local = g.call_function(A.sub.Tensor, (ids, g.call_function(A.mul.Tensor, (rank, share))))
    outside = g.call_function(A.logical_or.default, (
        g.call_function(A.lt.Scalar, (local, 0)), g.call_function(A.ge.Scalar, (local, share))))
    return g.call_function(A.masked_fill.Scalar, (local, outside, 0)), outside


def between(a: fx.Node, b: fx.Node) -> list[fx.Node]:
    """The nodes strictly between `a` and `b`, get_attr aside."""
    out, m = [], a.next
    while m is not b:
        if m.op != "get_attr":
            out.append(m)
        m = m.next
    return out


def gathered_output(gm, lin: fx.Node, degree: int, infos: dict) -> fx.Node:
    """After colwise layer `lin` (a device's share of the columns), its share placed in the
    whole width (see the module docstring): -> the node whose all-reduce is the whole
    output, which the cut treats as a rowwise layer's."""
    g, A = gm.graph, torch.ops.aten
    users = list(lin.users)
    with g.inserting_before(lin.next):   # in the order made
        rank = tp_rank(gm)
        marks = [g.call_function(A.eq.Scalar, (rank, j)) for j in range(degree)]
        pieces = [g.call_function(A.mul.Tensor, (lin, m)) for m in marks]
        whole = g.call_function(A.cat.default, (pieces, -1))
        out = g.call_function(A.alias.default, (whole,))
    for u in users:
        u.replace_input_with(lin, out)
    share = infos.get(lin.name, Info(True, True))
    for m in (*pieces, whole, out):
        infos[m.name] = Info(True, share.grad)
    for m in marks:
        infos[m.name] = Info(True, False)
    return out
