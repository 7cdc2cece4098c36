"""The attentions of a region as context parallelism reads them: their queries, keys and
values, scale and causal mask, whether fused (`scaled_dot_product_attention`) or written
as products and a softmax (eager attention), and what it cannot rewrite, said by name.

A fused attention's mask is its `attn_mask` (Hugging Face's sdpa passes the causal mask as
a tensor). An eager attention is the core `capture.attention_core.cores` finds (the scores
`q k^T`, what is computed from them, their product with `v`), read as a chain: the scores
of `q` and `k` transposed in its last two dimensions, scaled by constants (`*`, `/`),
perhaps masked (`masked_fill(mask, -inf)`, or `+ mask` of an additive mask), a softmax
over the last dimension, casts and a dropout of 0 (Hugging Face's eager attention), the
product with `v`. A mask is causal when, on the run of the whole sequence, it hides
exactly the keys after each query (`causal_mask`); any other is refused, as are dropout
on the probabilities and any op the chain does not name.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from piper_nb.capture.attention_core import cores
from piper_nb.errors import PlanError

__all__ = ["Attention", "attentions", "mask_input", "causal_mask", "refused"]

_A = torch.ops.aten
_SDPA = {F.scaled_dot_product_attention, _A.scaled_dot_product_attention.default}
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")
# flash kernels, returning (output, log-sum-exp, ...): their output is the `[0]`
_FLASH = {_A._scaled_dot_product_flash_attention, _A._scaled_dot_product_flash_attention_for_cpu}
_FLASH_ARGS = ("query", "key", "value", "dropout_p", "is_causal")
_TRANSPOSE = {torch.transpose, _A.transpose.int, "transpose"}
_SOFTMAX = {torch.softmax, F.softmax, _A.softmax.int, _A._softmax.default, "softmax"}
_MUL = {operator.mul, torch.mul, _A.mul.Tensor, _A.mul.Scalar, "mul"}
_DIV = {operator.truediv, torch.div, _A.div.Tensor, _A.div.Scalar, "div"}
_ADD = {operator.add, torch.add, _A.add.Tensor, "add"}
_FILL = {torch.masked_fill, _A.masked_fill.Scalar, "masked_fill"}


@dataclass
class Attention:
    """One attention: its output node (replaced), q, k, v, the scale (None: 1/sqrt(d)),
    whether causal by flag, the mask node whose value decides it (None: no mask), the
    nodes it replaces, and whether keys and values have fewer heads (`enable_gqa`)."""

    out: fx.Node
    q: fx.Node
    k: fx.Node
    v: fx.Node
    scale: float | None
    causal: bool
    mask: fx.Node | None
    nodes: list
    gqa: bool = False
    fused_mask: bool = False   # the mask is a fused attention's attn_mask (True: attend)


def _target(n: fx.Node):
    return n.target if n.op == "call_function" else n.target if n.op == "call_method" else None


def attentions(gm: fx.GraphModule, info) -> list[Attention]:
    """Every attention of the region's graph (see the module docstring); PlanError for one
    it cannot rewrite."""
    out = []
    fused = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in _SDPA]
    for n in fused:
        a = dict(zip(_SDPA_ARGS, n.args, strict=False))
        a.update(n.kwargs)
        mask = a.get("attn_mask")
        if mask is not None and not isinstance(mask, fx.Node):
            raise refused(info, n, "its mask is not a tensor of the graph")
        if a.get("dropout_p", 0.0) not in (0, 0.0):
            raise refused(info, n, "it applies dropout to the attention probabilities; set "
                          "the attention dropout to 0")
        out.append(Attention(n, a["query"], a["key"], a["value"], a.get("scale"),
                             bool(a.get("is_causal", False)), n if mask is not None else None,
                             [n], bool(a.get("enable_gqa", False)), mask is not None))
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "overloadpacket", n.target) in _FLASH:
            out.append(_flash(n, info))
            fused.append(n)
    for core in cores(gm):
        if not set(core) & set(fused):
            out.append(_eager(core, info))
    return out


def _flash(n: fx.Node, info) -> Attention:
    """A flash kernel whose output alone is read (`kernel(...)[0]`)."""
    a = dict(zip(_FLASH_ARGS, n.args, strict=False))
    a.update(n.kwargs)
    users = list(n.users)
    if len(users) != 1 or users[0].target is not operator.getitem or users[0].args[1] != 0:
        raise refused(info, n, "more than its output is read (its log-sum-exp); call "
                      "scaled_dot_product_attention")
    if a.get("dropout_p", 0.0) not in (0, 0.0) or n.kwargs.get("attn_mask") is not None:
        raise refused(info, n, "it applies dropout or a mask tensor; set the attention "
                      "dropout to 0 and use is_causal")
    return Attention(users[0], a["query"], a["key"], a["value"], n.kwargs.get("scale"),
                     bool(a.get("is_causal", False)), None, [n, users[0]])


def _eager(core: list[fx.Node], info) -> Attention:
    scores, product = core[0], core[-1]
    q, kt = scores.args[0], scores.args[1]
    if not isinstance(kt, fx.Node) or _target(kt) not in _TRANSPOSE or len(kt.args) < 3 \
            or set(kt.args[1:3]) not in ({-2, -1}, {2, 3}):
        raise refused(info, scores, "its scores are not q times k transposed in its last two "
                      "dimensions; write q @ k.transpose(-2, -1), or use "
                      "scaled_dot_product_attention")
    scale, mask, at, soft = 1.0, None, scores, None
    for n in core[1:-1]:
        t = _target(n)
        if soft is not None:   # after the softmax: a cast, or dropout that drops nothing
            if n.args[0] is at and _identity(n):
                at = n
                continue
            raise refused(info, n, "it computes from the probabilities before their "
                          "product with v (dropout, a second mask); context parallelism "
                          "takes softmax(scores) @ v")
        other = [a for a in (*n.args, *n.kwargs.values()) if a is not at]
        if n.args[0] is not at and not (t in _MUL | _ADD and at in n.args):
            raise refused(info, n, "its ops between the scores and the softmax are not one "
                          "chain; use scaled_dot_product_attention")
        if t in _MUL | _DIV and len(other) == 1 and isinstance(other[0], (int, float)):
            scale = scale * other[0] if t in _MUL else scale / other[0]
        elif t in _FILL and mask is None and math.isinf(n.args[2]) and n.args[2] < 0:
            mask = n
        elif t in _ADD and mask is None and len(other) == 1 and isinstance(other[0], fx.Node):
            mask = n
        elif t in _SOFTMAX and _last(n):
            soft = n
        else:
            raise refused(info, n, "context parallelism reads an eager attention as scores, "
                          "constant scaling, a causal mask, softmax over the keys and the "
                          "product with v, and this op is none of those; use "
                          "scaled_dot_product_attention")
        at = n
    if soft is None or product.args[0] is not at:
        raise refused(info, product, "it has no softmax over the keys right before the "
                      "product with v")
    return Attention(product, q, kt.args[0], product.args[1], scale, False, mask, core)


_CASTS = {_A.to.dtype, _A._to_copy.default, _A.to.dtype_layout, "to", "float", "type_as"}
_DROPOUT = {_A.dropout.default, F.dropout, torch.dropout}


def _identity(n: fx.Node) -> bool:
    """A cast (Hugging Face's softmax in fp32 cast back), or dropout of probability 0."""
    t = _target(n)
    if t in _CASTS:
        return True
    p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
    return t in _DROPOUT and p in (0, 0.0)


def _last(n: fx.Node) -> bool:
    dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
    return dim == -1 or dim == 3


def mask_input(att: Attention) -> fx.Node | None:
    """The tensor an eager attention's mask op reads as its mask (None: unmasked)."""
    if att.mask is None:
        return None
    if att.fused_mask:
        a = dict(zip(_SDPA_ARGS, att.mask.args, strict=False))
        a.update(att.mask.kwargs)
        return a["attn_mask"]
    if _target(att.mask) in _FILL:
        return att.mask.args[1]
    return next(a for a in att.mask.args if isinstance(a, fx.Node) and a not in att.nodes)


def causal_mask(att: Attention, value: torch.Tensor) -> bool:
    """Whether the mask attention `att` applies (`value`, on the whole sequence) hides
    exactly the keys after each query: a boolean `masked_fill` mask true above the
    diagonal, a fused attention's boolean mask true on and below it (sdpa's: true
    attends), or an additive one that is 0 on and below it and -inf (or below -1e4)
    above."""
    length = value.shape[-1]
    if value.is_meta or value.shape[-2:] != (length, length):
        return value.is_meta   # planning on meta: no values to read, as written
    above = torch.ones(length, length, dtype=torch.bool).triu(1)
    v = value.detach().cpu().reshape(-1, length, length)
    if v.dtype == torch.bool:
        return bool((v == (~above if att.fused_mask else above)).all())
    if _target(att.mask) in _FILL:
        return False
    return bool(((v == 0) == ~above).all() and (v[:, above] < -1e4).all())


def refused(info, n: fx.Node, why: str) -> PlanError:
    return PlanError(f"context_parallel: region {info.name} cannot be cut over the context "
                     f"at {n.name} ({n.format_node()}): {why}", op="context_parallel")
