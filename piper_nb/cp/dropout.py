"""Dropout under context parallelism: each device draws the mask of the whole sequence, as
one process does from the same generator state (`runtime.rng` seeds a region's members
alike), and applies its chunks of it (`capture.slice_dropout.share_dropout`), so a plan
with dropout trains as one process does. A tensor-parallel part's dropout on a slice
(`slice_dropout`) takes its slice of those chunks (`share_slice_dropout`). Any other
random op in a region cut over a context is a PlanError naming it.
"""

from __future__ import annotations

from piper_nb.capture.slice_dropout import share_dropout, share_slice_dropout, slice_dropout
from piper_nb.errors import PlanError
from piper_nb.tp import draws_random, dropout_of

__all__ = ["share_dropouts"]


def share_dropouts(gm, info, layout, full: dict, infos: dict, rank) -> bool:
    """Each dropout made `share_dropout`: the whole sequence's mask drawn (as one process
    draws it, from the same generator state), this device's chunks of it applied; another
    random op is a PlanError. `layout` is the `CPLayout`, `full` each op's shape on the
    whole sequence, `infos` on the share, `rank()` makes the part's rank node. -> whether
    any was made."""
    g, made = gm.graph, False
    for n in list(g.nodes):
        spec = dropout_of(gm, n)
        if n.op == "call_function" and n.target is slice_dropout:   # TP's, on the share
            x, p, train, dim, degree, tp_rank = n.args
            cut = _cut(info, layout, n, full.get(x.name), infos[x.name].shape, dim, degree)
            with g.inserting_before(n):
                made = _swap(g, n, g.call_function(share_slice_dropout, (
                    x, p, train, dim, degree, tp_rank, cut, layout.degree, rank(),
                    layout.balance)))
            continue
        if spec is None:
            if draws_random(gm, n):
                raise PlanError(f"context_parallel: region {info.name}: {n.format_node()} "
                                "draws random numbers on a device's share of the sequence, "
                                "which only dropout knows how to draw as one process does; "
                                "draw it outside the model, or drop it",
                                op="context_parallel")
            continue
        x, p, train = spec
        cut = _cut(info, layout, n, full.get(x.name), infos[x.name].shape)
        with g.inserting_before(n):
            made = _swap(g, n, g.call_function(share_dropout, (
                x, p, train, cut, layout.degree, rank(), layout.balance)))
    if made:
        g.lint()
        gm.recompile()
    return made


def _cut(info, layout, n, whole, mine, dim: int | None = None, degree: int = 1) -> int:
    """The dimension (from the end) along which dropout `n` reads a share of the
    sequence: the one its input's whole and share shapes differ in, of the sequence's
    length (a tensor-parallel slice of it, `degree` along `dim`, under sequence
    parallelism)."""
    cut = [d for d, (a, b) in enumerate(zip(whole or (), mine or (), strict=False)) if a != b]
    length = layout.seq // (degree if cut and dim is not None
                            and cut[0] == dim % len(whole) else 1)
    if len(cut) != 1 or whole[cut[0]] != length:
        raise PlanError(f"context_parallel: region {info.name}: dropout {n.format_node()} "
                        f"reads {n.args[0]} of shape {list(mine or ())} on a share (whole: "
                        f"{list(whole or ())}), whose sequence is not one dimension of "
                        f"{layout.seq} tokens (merged with the batch?), so its mask cannot "
                        "be each device's chunks of one process's; apply the dropout to "
                        "[batch, sequence, ...] values", op="context_parallel")
    return cut[0] - len(whole)


def _swap(g, n, new) -> bool:
    """Dropout `n` replaced by `new`; True."""
    new.meta = dict(n.meta)
    n.replace_all_uses_with(new)
    g.erase_node(n)
    return True
