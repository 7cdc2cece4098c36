"""Dropout under context parallelism: each device draws the mask of the whole sequence, as
one process does from the same generator state (`runtime.rng` seeds a region's members
alike), and applies its chunks of it (`capture.slice_dropout.share_dropout`), so a plan
with dropout trains as one process does. Any other random op in a region cut over a
context is a PlanError naming it.
"""

from __future__ import annotations

from piper_nb.capture.slice_dropout import share_dropout
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
        if spec is None:
            if draws_random(gm, n):
                raise PlanError(f"context_parallel: region {info.name}: {n.format_node()} "
                                "draws random numbers on a device's share of the sequence, "
                                "which only dropout knows how to draw as one process does; "
                                "draw it outside the model, or drop it",
                                op="context_parallel")
            continue
        x, p, train = spec
        whole, mine = full.get(x.name), infos[x.name].shape
        cut = [d for d, (a, b) in enumerate(zip(whole or (), mine or (), strict=False)) if a != b]
        if len(cut) != 1 or whole[cut[0]] != layout.seq:
            raise PlanError(f"context_parallel: region {info.name}: dropout {n.format_node()} "
                            f"reads {x.name} of shape {list(mine or ())} on a share (whole: "
                            f"{list(whole or ())}), whose sequence is not one dimension of "
                            f"{layout.seq} tokens (merged with the batch?), so its mask cannot "
                            "be each device's chunks of one process's; apply the dropout to "
                            "[batch, sequence, ...] values", op="context_parallel")
        with g.inserting_before(n):
            new = g.call_function(share_dropout, (x, p, train, cut[0] - len(whole),
                                                  layout.degree, rank(), layout.balance))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
        made = True
    if made:
        g.lint()
        gm.recompile()
    return made
