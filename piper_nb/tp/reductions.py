"""Which dimensions an op reduces over (sums, means, maxima, softmaxes, norms), so a sharded
part that reduces over the very dimension each device holds a share of (a LayerNorm or a
softmax over a colwise layer's output features) is a PlanError, not a silent per-device
answer (`tp.shapes.localize` asks, with the dimension each input is cut along).

`reduced_dims(gm, n, ndim)` gives the set of dimensions (non-negative) op `n` reduces of
its first input of `ndim` dimensions, or an empty set for an op that reduces none. Ops
the cut itself writes to reduce over a share on purpose (the vocabulary-parallel
cross-entropy's log-sum-exp) carry `n.meta[ON_SHARE]`.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

__all__ = ["ON_SHARE", "reduced_dims"]

ON_SHARE = "pn_tp_reduces_share"
_A = torch.ops.aten
# op -> position of its dim argument (keyword `dim`); absent or None: every dimension
_DIM_AT = {
    _A.sum.dim_IntList: 1, _A.mean.dim: 1, _A.amax.default: 1, _A.amin.default: 1,
    _A.logsumexp.default: 1, _A._softmax.default: 1, _A.softmax.int: 1,
    _A._log_softmax.default: 1, _A.log_softmax.int: 1, _A.var.correction: 1,
    _A.std.correction: 1, _A.var.dim: 1, _A.std.dim: 1, _A.max.dim: 1, _A.min.dim: 1,
    _A.argmax.default: 1, _A.argmin.default: 1, _A.cumsum.default: 1, _A.prod.dim_int: 1,
    _A.linalg_vector_norm.default: 2, _A.norm.ScalarOpt_dim: 2,
    torch.sum: 1, torch.mean: 1, torch.amax: 1, torch.logsumexp: 1, torch.softmax: 1,
    torch.log_softmax: 1, torch.var: 1, torch.std: 1, torch.norm: 2, torch.cumsum: 1,
    F.softmax: 1, F.log_softmax: 1,
}
_METHODS = {"sum": 1, "mean": 1, "amax": 1, "logsumexp": 1, "softmax": 1, "log_softmax": 1,
            "var": 1, "std": 1, "norm": 2, "cumsum": 1, "max": 1, "min": 1}
_ALL = {_A.sum.default, _A.mean.default}     # reduce everything, no dim argument
# normalisations over the trailing dimensions: op -> position of normalized_shape
_NORMS = {_A.layer_norm.default: 1, _A.native_layer_norm.default: 1, _A.rms_norm.default: 1,
          F.layer_norm: 1, F.rms_norm: 1}


def reduced_dims(gm: fx.GraphModule, n: fx.Node, ndim: int, target=None, at: int = 0) -> set[int]:
    """The dimensions (of `n`'s first input, `ndim` of them) `n` reduces over; `target`
    and `at` the op and where its arguments start, when `n` calls it through a wrapper
    (`capture.region_code.call_op`)."""
    if n.meta.get(ON_SHARE) or ndim == 0:
        return set()
    if n.op == "call_module":
        return _module(gm.get_submodule(str(n.target)), ndim)
    if n.op == "call_method" and n.target in _METHODS:
        return _dims(n, _METHODS[n.target], ndim)
    if n.op != "call_function":
        return set()
    target = n.target if target is None else target
    if target is F.normalize:
        return _dims(n, at + 2, ndim, default=1)
    if target in _NORMS:
        shape = _arg(n, at + _NORMS[target], "normalized_shape")
        return set(range(ndim - len(shape), ndim)) if isinstance(shape, (list, tuple)) else set()
    if target in _ALL:
        return set(range(ndim))
    return _dims(n, at + _DIM_AT[target], ndim) if target in _DIM_AT else set()


def _module(mod: nn.Module, ndim: int) -> set[int]:
    if isinstance(mod, (nn.LayerNorm, nn.RMSNorm)):
        return set(range(ndim - len(mod.normalized_shape), ndim))
    if isinstance(mod, (nn.Softmax, nn.LogSoftmax)) and mod.dim is not None:
        return {mod.dim % ndim}
    if isinstance(mod, nn.GroupNorm):
        return {1}
    return set()


def _arg(n: fx.Node, at: int, key: str):
    return n.args[at] if len(n.args) > at else n.kwargs.get(key)


def _dims(n: fx.Node, at: int, ndim: int, default: int | None = None) -> set[int]:
    """The dim argument at position `at` (or keyword `dim`); absent: `default`, or every
    dimension."""
    dim = _arg(n, at, "dim")
    if dim is None:
        return set(range(ndim)) if default is None else {default % ndim}
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return set()
    return {d % ndim for d in dims} if dims else set(range(ndim))
