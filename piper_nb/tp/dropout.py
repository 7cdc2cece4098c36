"""Dropout in a sharded part draws, on each device, its slice of the mask one process draws.

Left as it is, a dropout on a device's share of heads or features (attention
probabilities, the MLP's hidden activation) would draw a mask of the share's shape from
the same seed on every device: features i and i + n/t always dropped together, nothing
like one process. `shard_dropouts` makes each such op `capture.slice_dropout.slice_dropout`, which
draws the mask of the whole tensor, as `torch.nn.functional.dropout` does on the unsharded
region (the same draws from the same generator state, so the ops after it stay in step
too: `runtime.rng` continues a region's stream across its parts), and keeps the device's
slice along the dimension its input is cut on. A dropout on a replicated or partial value
is left alone: every device draws the whole mask, and a mask times a share of a sum is
that share of the masked sum. Any other random op in a sharded part is a PlanError naming
it.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from piper_nb.capture.slice_dropout import slice_dropout
from piper_nb.errors import PlanError
from piper_nb.tp.vocab import tp_rank

__all__ = ["shard_dropouts", "dropout_of", "draws_random"]

_A = torch.ops.aten
_DROPOUTS = {_A.dropout.default, F.dropout, torch.dropout}
_RANDOM_FUNCTIONS = {F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                     F.feature_alpha_dropout, torch.rand_like, torch.randn_like, torch.bernoulli,
                     torch.rand, torch.randn, torch.randint, torch.randint_like, torch.multinomial,
                     torch.normal, torch.randperm}
_RANDOM_MODULES = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                   nn.FeatureAlphaDropout)


def shard_dropouts(gm: fx.GraphModule, sharded: set, dims: dict[str, int | None], full: dict,
                   degree: int, where: str) -> dict[fx.Node, str]:
    """Each dropout in `sharded` (node names) of `gm` made `slice_dropout` along the dimension
    `dims` says its input is cut on (`full`: each node's whole-model shape); another random
    op there is a PlanError. Returns the nodes made, each with the name of the dropout it
    stands for."""
    g, made = gm.graph, {}
    for n in list(g.nodes):
        if n.name not in sharded:
            continue
        spec = dropout_of(gm, n)
        if spec is None:
            _refuse_random(gm, n, where)
            continue
        x, p, train = spec
        dim = dims.get(n.name)
        if dim is None:
            raise PlanError(f"tensor_parallel: {where}: dropout {n.format_node()} reads a value "
                            "that is not cut along one dimension, so its mask cannot be each "
                            "device's slice of one process's; keep the layers around it whole "
                            "(replicate) or move the dropout after the rowwise layer")
        with g.inserting_before(n):
            rank = tp_rank(gm)
            new = g.call_function(slice_dropout, (x, p, train, dim - len(full[x.name]), degree,
                                               rank))
        new.meta = dict(n.meta)
        made[rank] = made[new] = n.name
        n.replace_all_uses_with(new)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return made


def dropout_of(gm: fx.GraphModule, n: fx.Node):
    """(input, p, train) of a dropout node, else None."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if type(mod) is nn.Dropout:
            return n.args[0], mod.p, mod.training
        return None
    if n.op != "call_function" or n.target not in _DROPOUTS:
        return None
    names = ("input", "p", "train" if n.target is not F.dropout else "training")
    given = {**dict(zip(names, n.args, strict=False)), **n.kwargs}
    p = given.get("p", 0.5)
    train = given.get("train", given.get("training", True))
    if isinstance(p, fx.Node) or isinstance(train, fx.Node):
        return None
    return given["input"], float(p), bool(train)


def _seeded(n: fx.Node) -> bool:
    """An op overload that draws random numbers as called here (attention with a
    `dropout_p` of 0 draws none)."""
    op = n.target
    if not isinstance(op, torch._ops.OpOverload) or \
            torch.Tag.nondeterministic_seeded not in op.tags:
        return False
    names = [a.name for a in op._schema.arguments]
    if "dropout_p" not in names:
        return True
    i = names.index("dropout_p")
    p = n.args[i] if len(n.args) > i else n.kwargs.get("dropout_p", 0.0)
    return isinstance(p, fx.Node) or p != 0


def draws_random(gm: fx.GraphModule, n: fx.Node) -> bool:
    """Whether node `n` draws random numbers other than a dropout's (`dropout_of`)."""
    return (n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)),
                                                 _RANDOM_MODULES)) or \
        (n.op == "call_function" and (n.target in _RANDOM_FUNCTIONS or _seeded(n)))


def _refuse_random(gm: fx.GraphModule, n: fx.Node, where: str) -> None:
    if draws_random(gm, n):
        raise PlanError(f"tensor_parallel: {where}: {n.format_node()} draws random numbers on "
                        "a device's share of heads or features, which only dropout knows how "
                        "to draw as one process does; keep the layers around it whole "
                        "(replicate), or draw it outside the sharded layers")
