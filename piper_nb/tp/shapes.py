"""Shapes inside a sharded part, made a device's own: the sizes a traced graph wrote down
for the whole model (torch.export's `view(x, [B, 8, 4, 8])`, Hugging Face's `repeat_kv`
expanding to `[B, kv_heads, n_rep, T, D]`) divided where they count heads or features.

The part's ops run once with device 0's shards (`localize`). Before each op that takes a
shape (view, reshape, expand, unflatten), the dimension its input is sharded along is the one whose
size there differs from the whole model's; the output's sharded dimension is where that
dimension's leading factor lands (the same prefix of elements), and only that entry of
the shape is divided: a constant rewritten, a traced size divided in the graph, `-1` left
alone. An empty constant joined to a sharded tensor (an empty KV cache) is narrowed
alike. A shape that cannot be made a device's own is a PlanError naming the op.
"""

from __future__ import annotations

import contextlib
import math
import operator

import torch
import torch.fx as fx

from piper_nb.capture.meta_routing import balanced_routing, routes
from piper_nb.capture.region_code import call_op
from piper_nb.errors import PlanError
from piper_nb.tp.fused import Origin, pick_parts, split_parts
from piper_nb.tp.reductions import reduced_dims

__all__ = ["localize", "op_target"]

_A = torch.ops.aten
_SHAPE_OPS = {_A.view.default, _A.reshape.default, _A._unsafe_view.default, _A.expand.default,
              torch.reshape}
_SHAPE_METHODS = {"view", "reshape", "expand"}
_UNFLATTEN = {_A.unflatten.int, torch.unflatten, "unflatten"}   # (x, dim, sizes): a view
_CAT = {_A.cat.default, torch.cat}


def localize(gm: fx.GraphModule, args: list, full: dict[str, tuple | None], sharded: set,
             degree: int, local: dict, where: str,
             origins: dict[str, Origin] | None = None,
             sequence: set = frozenset(), op: str = "tensor_parallel") -> dict[str, int | None]:
    """Rewrite the shapes of the ops in `sharded` (node names) in `gm`'s graph for one
    device's share; `full` gives each node's whole-model shape, `local` the sharded
    parameters (get_attr target -> device 0's shard), `args` the region's inputs, `origins`
    the colwise layers' outputs (node name -> `tp_fused.Origin`), followed to their splits,
    `sequence` the ops on slices of the sequence (`tp.sequence`). Returns, per sharded op,
    the dimension its first input is cut along (None: not one). `op`: the directive cutting
    (`"context_parallel"` cuts the sequence of every op: a reduction over it, a loss's
    mean, is that directive's own business)."""
    localizer = _Localizer(gm, full, sharded, degree, local, where, dict(origins or {}))
    localizer.sequence, localizer.op = sequence, op
    # the run rewrites the graph as it goes, so it cannot be retried: the mode is on from
    # the start where the graph routes tokens on the meta device
    meta = any(isinstance(a, torch.Tensor) and a.is_meta for a in args) and routes(gm)
    try:
        with balanced_routing() if meta else contextlib.nullcontext():
            localizer.run(*args)
    except PlanError as err:   # without the note torch.fx's interpreter appends
        raise PlanError(str(err).split("\n\nWhile executing")[0]) from None
    gm.graph.lint()
    gm.recompile()
    return localizer.dims


class _Localizer(fx.Interpreter):
    def __init__(self, gm, full, sharded, degree, local, where, origins):
        super().__init__(gm)
        self.origins = origins
        self.full, self.sharded, self.degree = full, sharded, degree
        self.local, self.where = local, where
        self.dims: dict[str, int | None] = {}   # sharded op -> its first input's cut dimension
        self.sequence: set = frozenset()   # ops on slices of the sequence (tp.sequence)
        self.op = "tensor_parallel"        # the directive cutting

    def get_attr(self, target, args, kwargs):
        return self.local.get(str(target)) if str(target) in self.local else \
            super().get_attr(target, args, kwargs)

    def run_node(self, n: fx.Node):
        if n.name in self.sharded:
            first = next(iter(n.all_input_nodes), None)
            self.dims[n.name] = self._sharded_dim(first) if first is not None else None
            if self.op == "tensor_parallel":
                self._check_reduction(n)
                self._follow(n)
            try:
                self._fix(n)
            except PlanError:
                raise
            except Exception as err:   # noqa: BLE001 - reported with the op that failed
                self._fail(n, f"{type(err).__name__}: {err}")
        try:
            return super().run_node(n)
        except Exception as err:   # noqa: BLE001
            fix = ("shard the layers around it otherwise, or keep them whole (replicate)"
                   if self.op == "tensor_parallel" else "it mixes the tokens across the "
                   "sequence (a layer sized by it), which only attention may, or holds sizes "
                   "written for the whole sequence: compute them from the tensors it reads")
            raise PlanError(f"{self.op}: {self.where}: {n.format_node()} fails on a "
                            f"device's share ({type(err).__name__}: {err}); {fix}") from None

    def _fail(self, n: fx.Node, why: str):
        hint = ("; it runs on slices of the sequence (sequence_parallel=True): annotate the "
                "layers that take the whole sequence (an LM head and its loss) as a region of "
                "their own, shard them in the plan, or drop sequence_parallel"
                if n.name in self.sequence else "")
        raise PlanError(f"{self.op}: {self.where}: {n.format_node()} cannot be made a "
                        f"device's share: {why}{hint}")

    def _follow(self, n: fx.Node) -> None:
        """Carry the colwise layer `n`'s value comes from; check a split of it."""
        if n.name not in self.origins:
            came = [self.origins[a.name] for a in n.all_input_nodes if a.name in self.origins]
            if not came:
                return
            self.origins[n.name] = came[0]
        target, at = op_target(n) if n.op != "call_module" else (None, 0)
        x = n.args[at] if len(n.args) > at else None
        if not isinstance(x, fx.Node) or self.full.get(x.name) is None:
            return
        for find in (split_parts, pick_parts):   # a split of it, else a part picked from it
            parts = find(n, target, at, self._sharded_dim(x), tuple(self.full[x.name]),
                         self.degree, self.origins[n.name], self.where)
            if parts is not None:
                self.origins[n.name] = parts
                return

    def _check_reduction(self, n: fx.Node) -> None:
        """A reduction over the dimension the input is cut along: PlanError."""
        target, at = op_target(n) if n.op == "call_function" else (n.target, 0)
        x = n.args[at] if len(n.args) > at else None
        d = self._sharded_dim(x) if isinstance(x, fx.Node) else None
        if d is None or d not in reduced_dims(self.module, n, len(self.full[x.name]), target, at):
            return
        if n.name in self.sequence:
            raise PlanError(f"tensor_parallel: sequence_parallel=True: {self.where}: "
                            f"{n.format_node()} reduces over dimension {d} of "
                            f"{list(self.full[x.name])}, the sequence, of which each device "
                            "holds a slice outside the sharded layers: its result would differ "
                            "per device; move it after a colwise layer (a vocab-parallel or "
                            "gathered LM head for a loss), or drop sequence_parallel")
        raise PlanError(f"tensor_parallel: {self.where}: {n.format_node()} reduces over "
                        f"dimension {d} of {list(self.full[x.name])}, which each device holds "
                        "only a share of (a colwise layer's output features): its result "
                        "would differ per device; put the rowwise layer before it, or keep "
                        "the layer feeding it whole (replicate)")

    def _sharded_dim(self, x: fx.Node) -> int | None:
        t, whole = self.env.get(x), self.full.get(x.name)
        if not isinstance(t, torch.Tensor) or whole is None or tuple(t.shape) == tuple(whole):
            return None
        diff = [i for i, (a, b) in enumerate(zip(t.shape, whole, strict=False)) if a != b]
        return diff[0] if len(diff) == 1 and len(t.shape) == len(whole) else None

    def _fix(self, n: fx.Node) -> None:
        target, at = op_target(n)
        if target in _CAT:
            self._fix_cat(n, at)
            return
        method = n.op == "call_method" and target in _SHAPE_METHODS
        unflat = n.op != "call_module" and target in _UNFLATTEN
        if not (n.op == "call_function" and target in _SHAPE_OPS) and not method and not unflat:
            return
        x = n.args[at]
        d = self._sharded_dim(x)
        out = self.full.get(n.name)
        if d is None or out is None:
            return
        whole_in = tuple(self.full[x.name])
        if target in (_A.expand.default,) or (method and target == "expand"):
            j = d + len(out) - len(whole_in)
        else:
            prefix = math.prod(whole_in[:d])
            ends = [k for k in range(len(out)) if math.prod(out[:k]) == prefix and out[k] > 1]
            if not ends and self.op != "tensor_parallel":   # the sequence merged with the
                upto = prefix * whole_in[d]                  # batch: the dim holding its end
                ends = [k for k in range(len(out)) if math.prod(out[:k + 1]) >= upto][:1]
            if not ends:
                self._fail(n, f"its sharded dimension {d} of {list(whole_in)} does not start a "
                           f"dimension of {list(out)}")
            j = ends[0]
        o = self.origins.get(n.name)
        if o is not None and o.blocks > 1 and out[j] == o.blocks and j + 1 < len(out):
            j += 1   # (k, m) of colwise:k's blocks: a device holds a share of each, m's
            self.origins[n.name] = Origin(o.path, 1)
        if out[j] % self.degree:
            fused = f"; if {o.path.removeprefix('model.')} fuses {out[j]} projections, give " \
                f"it 'colwise:{out[j]}'" if o is not None and o.blocks == 1 else ""
            what = "heads or features" if self.op == "tensor_parallel" else "tokens"
            self._fail(n, f"dimension {j} of {list(out)} ({out[j]}: {what}) is not "
                       f"divisible by {self.degree} devices{fused}")
        want = list(out)
        want[j] = out[j] // self.degree
        if unflat:   # its sizes are entries dim.. of the output's shape
            dim, sizes = (n.kwargs.get(k, n.args[at + i] if len(n.args) > at + i else None)
                          for i, k in ((1, "dim"), (2, "sizes")))
            first = dim % len(whole_in)
            fixed = [self._entry(n, a, first + k, want, out) for k, a in enumerate(sizes)]
            n.args, n.kwargs = (*n.args[:at + 1], dim, type(sizes)(fixed)), {}
            return
        spread = method and not isinstance(n.args[1], (list, tuple))   # x.view(b, t, 4, 8)
        shape = list(n.args[1:]) if spread else list(n.args[at + 1])
        fixed = [self._entry(n, a, k, want, out) for k, a in enumerate(shape)]
        if spread:
            n.args = (x, *fixed)
        else:
            n.args = (*n.args[:at + 1], fixed, *n.args[at + 2:])

    def _entry(self, n: fx.Node, a, k: int, want: list, out: tuple):
        value = self.env[a] if isinstance(a, fx.Node) else a
        if value == -1 or k >= len(want) or value == want[k]:
            return a
        if value != out[k]:
            self._fail(n, f"entry {k} of its shape is {value}, neither the whole model's "
                       f"{out[k]} nor a device's {want[k]}")
        if isinstance(a, fx.Node):   # a traced size of the whole: divided in the graph
            with n.graph.inserting_before(n):
                div = n.graph.call_function(operator.floordiv, (a, self.degree))
            self.env[div] = value // self.degree
            return div
        return want[k]

    def _fix_cat(self, n: fx.Node, at: int) -> None:
        parts = n.args[at]
        dims = {self._sharded_dim(p) for p in parts if isinstance(p, fx.Node)} - {None}
        if len(dims) != 1:
            return
        (d,) = dims
        fixed = []
        for p in parts:
            t = self.env.get(p)
            if (isinstance(t, torch.Tensor) and self._sharded_dim(p) is None
                    and t.dim() > d and t.shape[d] == (self.full.get(p.name) or t.shape)[d]):
                if t.numel():
                    self._fail(n, f"it joins {p.name}, a whole tensor of {list(t.shape)}, to "
                           "a device's share; only an empty one (a KV cache) can be cut")
                with n.graph.inserting_before(n):
                    p = n.graph.call_function(_A.narrow.default,
                                              (p, d, 0, t.shape[d] // self.degree))
                self.env[p] = t.narrow(d, 0, t.shape[d] // self.degree)
            fixed.append(p)
        n.args = (*n.args[:at], fixed, *n.args[at + 1:])


def op_target(n: fx.Node) -> tuple[object, int]:
    """An op's target and where its arguments start: `call_op("aten.expand.default", x,
    shape)` (`capture.region_code`) is `aten.expand.default(x, shape)`."""
    if n.target is call_op and n.args and isinstance(n.args[0], str):
        ns, op, overload = n.args[0].split(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload), 1
    return n.target, 0
