"""Attention cores in a region's graph, and selective recompute of them (Megatron's
`--recompute-granularity selective`; Korthikanti et al. 2022, section 4.2).

An attention core is what lies between two products of activations: the scores `q k^T`
(a matmul or bmm neither of whose operands is a parameter), everything computed from them
(scaling, masking, softmax, dropout) and the product of the probabilities with `v`. Those
ops keep the `as/h`-sized tensors (scores, probabilities, dropout mask, 5as/h sbh in 16
bits) while costing a small share of the layer's FLOPs; a fused attention
(`scaled_dot_product_attention`) is a core of one op. `cores` finds them in a GraphModule
(a core whose inner values are read outside it, that mutates in place or that holds a
parameter is left alone); `recompute_cores` replaces each with one call of a
`capture.recomputed.Recomputed` submodule, which keeps only the core's inputs (q, k, v and
the mask, which the projections keep anyway) and runs it again in the backward. Everything
else in the region saves what autograd saves, so the projections, norms and MLP keep their
activations: Table 2's 34sbh (34sbh/t with TP and SP) per layer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from piper_nb.capture.recomputed import Recomputed

__all__ = ["cores", "recompute_cores", "CORE_PREFIX"]

CORE_PREFIX = "recomputed_attention_"
_A = torch.ops.aten
_PRODUCTS = {torch.matmul, torch.bmm, operator.matmul, _A.matmul.default, _A.bmm.default}
_FUSED = {F.scaled_dot_product_attention, _A.scaled_dot_product_attention,
          _A._scaled_dot_product_flash_attention_for_cpu,
          _A._scaled_dot_product_flash_attention,
          _A._scaled_dot_product_efficient_attention,
          _A._scaled_dot_product_cudnn_attention}   # ops as packets: any overload
_RANDOM_WORDS = ("dropout", "rand", "bernoulli", "normal", "multinomial")


def _is_param(gm: fx.GraphModule, n) -> bool:
    if not isinstance(n, fx.Node) or n.op != "get_attr":
        return False
    owner = gm
    for part in str(n.target).split("."):
        owner = getattr(owner, part, None)
    return isinstance(owner, torch.nn.Parameter)


def _product(gm: fx.GraphModule, n: fx.Node) -> bool:
    """A product of two activations: `q k^T` or `probs v`, not a layer's weight."""
    is_op = (n.op == "call_function" and n.target in _PRODUCTS) or \
        (n.op == "call_method" and n.target in ("matmul", "bmm", "__matmul__"))
    if not is_op or len(n.args) < 2:
        return False
    return all(isinstance(a, fx.Node) and not _is_param(gm, a) for a in n.args[:2])


def _fused(n: fx.Node) -> list[fx.Node] | None:
    """A fused attention's core: the op, and the `[0]` of a kernel returning a tuple (the
    output; its log-sum-exp and the rest unread), else None."""
    op = getattr(n.target, "overloadpacket", n.target)
    if n.op != "call_function" or op not in _FUSED:
        return None
    if op in (F.scaled_dot_product_attention, _A.scaled_dot_product_attention):
        return [n]   # returns the output itself
    users = list(n.users)
    if len(users) == 1 and users[0].target is operator.getitem and users[0].args[1] == 0:
        return [n, users[0]]
    return None


def _mutates(n: fx.Node) -> bool:
    if n.op == "call_method":
        return str(n.target).endswith("_") and not str(n.target).endswith("__")
    op = n.target
    return isinstance(op, torch._ops.OpOverload) and op._schema.is_mutable


def _random(n: fx.Node) -> bool:
    if n.op == "call_module":
        return True   # dropout modules; a module without parameters, conservatively
    name = getattr(n.target, "__name__", str(n.target)).lower()
    if isinstance(n.target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in n.target.tags or \
            any(w in name for w in _RANDOM_WORDS)
    return any(w in name for w in _RANDOM_WORDS)


def _holds_params(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op == "call_module":
        return any(True for _ in gm.get_submodule(str(n.target)).parameters())
    return _is_param(gm, n) or n.op in ("placeholder", "output")


def cores(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The attention cores of `gm`, each its nodes in graph order (the last is its output)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    taken: set[fx.Node] = set()
    found = []
    for a in gm.graph.nodes:
        if a in taken:
            continue
        fused = _fused(a)
        if fused:
            core = fused
        elif _product(gm, a):
            down, todo = set(), [a]
            while todo:                      # everything computed from the scores
                for u in todo.pop().users:
                    if u not in down:
                        down.add(u)
                        todo.append(u)
            ends = sorted((u for u in down if _product(gm, u)), key=order.__getitem__)
            if not ends:
                continue
            b = ends[0]                      # the probabilities times v
            up, todo = {b}, [b]
            while todo:
                for x in todo.pop().all_input_nodes:
                    if x in down and x not in up:
                        up.add(x)
                        todo.append(x)
            core = sorted({a} | up, key=order.__getitem__)
        else:
            continue
        inside = set(core)
        escapes = [n for n in core[:-1] if any(u not in inside for u in n.users)]
        if escapes or any(_mutates(n) or _holds_params(gm, n) for n in core):
            continue
        taken |= inside
        found.append(core)
    return found


def recompute_cores(gm: fx.GraphModule) -> int:
    """Each attention core of `gm` made one call of a `Recomputed` submodule (in place);
    how many were made."""
    made, index = 0, 0
    for core in cores(gm):
        inside = set(core)
        inputs = list(dict.fromkeys(x for n in core for x in n.all_input_nodes
                                    if x not in inside))
        sub = fx.Graph(tracer_cls=gm.graph._tracer_cls)   # unpickling traces it again
        env = {x: sub.placeholder(x.name) for x in inputs}
        for n in core:
            env[n] = sub.node_copy(n, env.__getitem__)
        sub.output(env[core[-1]])
        piece = fx.GraphModule(gm, sub)
        while hasattr(gm, f"{CORE_PREFIX}{index}"):
            index += 1
        name = f"{CORE_PREFIX}{index}"
        gm.add_module(name, Recomputed(piece, any(_random(n) for n in core)))
        last = core[-1]
        with gm.graph.inserting_before(last):
            call = gm.graph.call_module(name, tuple(inputs))
        call.meta = dict(last.meta)
        last.replace_all_uses_with(call)
        for n in reversed(core):
            gm.graph.erase_node(n)
        made += 1
    if made:
        gm.graph.lint()
        gm.recompile()
    return made
