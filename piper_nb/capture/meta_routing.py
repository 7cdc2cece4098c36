"""Routing on the meta device: how many tokens each expert gets, assumed balanced.

A model on the meta device has no values, so `torch.nonzero` (the tokens a router sends to
an expert) has no size to return. While regions run on meta tensors (shape propagation,
FLOP counting), `balanced_routing` answers it from where the mask came from: a `topk`
over E experts picks k distinct indices per token, and a mask comparing them with
constants (`topi == e`, `(topi >= lo) & (topi < hi)`: an interval [lo, hi) of experts)
holds, under a balanced router, `k (hi - lo) / E` true entries per token; reduced over the
k picks (`mask.any(-1)`), a token is routed there with probability `min(1, k (hi - lo) / E)`.
So each of E experts gets `tokens x k / E` rows, what an auxiliary load-balancing loss
aims at. The memory model resizes expert buffers from a measured routing whenever one is
given (`MemorySettings(tokens=...)`); this is only the default the plan is compiled at.

A `nonzero` on a meta tensor whose origin is not such a mask is a `PlanError`.

The mode sees every operator, a cost a dense model need not pay: `on_meta` runs a
function plainly and again under the mode only when a `nonzero` on the meta device
stopped it; `routes` tells from a graph whether it asks for one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from piper_nb.errors import PlanError

__all__ = ["balanced_routing", "on_meta", "routes"]

_A = torch.ops.aten
_COMPARE = {_A.eq.Scalar: lambda c, e: (c, c + 1), _A.ge.Scalar: lambda c, e: (c, e),
            _A.gt.Scalar: lambda c, e: (c + 1, e), _A.lt.Scalar: lambda c, e: (0, c),
            _A.le.Scalar: lambda c, e: (0, c + 1)}
_AND = {_A.bitwise_and.Tensor, _A.logical_and.default, _A.mul.Tensor}
_ANY = {_A.any.dim, _A.any.dims}
_SAME = {_A.view.default, _A._unsafe_view.default, _A.reshape.default, _A.alias.default,
         _A.clone.default, _A.detach.default, _A._to_copy.default, _A.squeeze.dim,
         _A.squeeze.default, _A.unsqueeze.default, _A.flatten.using_ints,
         _A.contiguous.default, _A.lift_fresh_copy.default}


@dataclass(frozen=True)
class _Picks:
    """Expert indices from a topk: k distinct of `experts` per token, in [lo, hi) if a mask."""

    experts: int
    k: int
    lo: int = 0
    hi: int | None = None
    reduced: bool = False   # reduced over the k picks: one entry per token

    def share(self) -> float:
        width = max(0, min(self.hi, self.experts) - max(self.lo, 0)) / self.experts
        return min(1.0, self.k * width) if self.reduced else width


class _Balanced(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.facts = WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _A.nonzero.default and args[0].is_meta:
            return self._nonzero(args[0])
        out = func(*args, **kwargs)
        try:
            self._learn(func, args, kwargs, out)
        except (IndexError, TypeError, AttributeError):   # an unusual signature: nothing learned
            pass
        return out

    def _learn(self, func, args, kwargs, out) -> None:
        facts = self.facts
        if func is _A.topk.default:
            x, k = args[0], args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if dim in (-1, x.dim() - 1):
                facts[out[1]] = _Picks(x.shape[-1], k)
            return
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        fact = facts.get(first) if first is not None else None
        if fact is None:
            return
        if func in _COMPARE and fact.hi is None and isinstance(args[1], (int, float)):
            lo, hi = _COMPARE[func](int(args[1]), fact.experts)
            facts[out] = _Picks(fact.experts, fact.k, lo, hi)
        elif func in _AND and isinstance(args[1], torch.Tensor):
            other = facts.get(args[1])
            if (other is not None and fact.hi is not None and other.hi is not None
                    and (fact.experts, fact.k, fact.reduced) == (other.experts, other.k,
                                                                 other.reduced)):
                facts[out] = _Picks(fact.experts, fact.k, max(fact.lo, other.lo),
                                    min(fact.hi, other.hi), fact.reduced)
        elif func in _ANY and fact.hi is not None and not fact.reduced:
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            if list(dims) in ([-1], [first.dim() - 1]):
                facts[out] = _Picks(fact.experts, fact.k, fact.lo, fact.hi, True)
        elif func in _SAME and isinstance(out, torch.Tensor):
            facts[out] = fact

    def _nonzero(self, mask: torch.Tensor) -> torch.Tensor:
        fact = self.facts.get(mask)
        if fact is None or fact.hi is None:
            raise PlanError("on the meta device, torch.nonzero has no values to count, and "
                            f"the {tuple(mask.shape)} tensor it reads is not a router's "
                            "expert mask (a topk's indices compared with constants) whose "
                            "size piper_nb can assume; build the model on the CPU to plan "
                            "it with a real routing")
        rows = round(mask.numel() * fact.share())
        return torch.empty((rows, mask.dim()), dtype=torch.long, device="meta")


@contextlib.contextmanager
def balanced_routing():
    """While it is active, `nonzero` on meta tensors returns the balanced routing's size
    (see the module docstring); everything else runs as it would."""
    with _Balanced():
        yield


def on_meta(meta: bool, fn, *args, **kwargs):
    """`fn(*args, **kwargs)`; on the meta device (`meta`), where a `nonzero` had no size to
    return, again under `balanced_routing`. `fn` must be safe to run twice."""
    if not meta:
        return fn(*args, **kwargs)
    try:
        return fn(*args, **kwargs)
    except Exception as e:   # noqa: BLE001 - only a meta nonzero's is retried
        if not _data_dependent(e):
            raise
    with balanced_routing():
        return fn(*args, **kwargs)


def _data_dependent(e: BaseException | None) -> bool:
    """Whether `e` (or what it was raised from) is a meta `nonzero` without a size."""
    while e is not None:
        if "nonzero" in str(e) and isinstance(e, (NotImplementedError, RuntimeError,
                                                  PlanError)):
            return True
        e = e.__cause__ or e.__context__
    return False


def routes(gm) -> bool:
    """Whether graph module `gm` calls `nonzero` (or `argwhere`, or a one-argument
    `where`): a size only a routing gives on the meta device."""
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__",
                                                                       str(n.target))
            if "nonzero" in str(name) or "argwhere" in str(name) or (
                    name == "where" and len(n.args) + len(n.kwargs) == 1):
                return True
    return False
