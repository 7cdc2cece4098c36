"""Token rows: the sizes that depend on routing, as functions of the routing.

An expert layer's token buffers (the rows routed to each expert, their indices and weights,
what the expert saves for its backward) have as many rows as the router sends that
expert; `propagate` sees one routing, of one microbatch at compile time, and every step
routes afresh. `token_rows` runs the regions once more under `FakeTensorMode` with a
symbolic shape environment: each data-dependent size (`nonzero` and its kind) becomes a
symbol, so a value's first dimension reads as a symbol and a region's saved bytes as an
affine expression in them (`128*u0 + 8*u1 + 37952`). The memory model then sizes these
buffers from a routing (`MemorySettings(tokens=...)`: the one a measured step made, or by
default the captured one) instead of from the captured shapes.

Saved bytes are counted the way `shapes.SavedBytes` counts them (distinct storages;
parameters, buffers and the region's own inputs and outputs excluded), so at the captured routing the
expression equals `propagate`'s figure; a region where it would not is left out (sized as
captured).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from piper_nb.compiler.shapes import deliver, region_args
from piper_nb.plan.token_rows import captured_rows

__all__ = ["token_rows"]


def _affine(expr) -> dict[str, int] | None:
    """{symbol: coefficient, "": constant} of an integer affine expression, else None."""
    import sympy
    expr = sympy.expand(sympy.sympify(expr))
    syms = sorted(expr.free_symbols, key=str)
    if not syms:
        return {"": int(expr)}
    poly = sympy.Poly(expr, *syms)
    if poly.total_degree() > 1:
        return None
    out = {"": int(poly.coeff_monomial(1))}
    for s in syms:
        out[str(s)] = int(poly.coeff_monomial(s))
    return out


def _expr(n) -> object:
    return n.node.expr if isinstance(n, torch.SymInt) else n


class _Saved:
    """Distinct storages autograd saves, by storage identity, as a symbolic byte count."""

    def __init__(self, exclude: set):
        self.exclude, self.seen = exclude, {}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = StorageWeakRef(t.untyped_storage())
        if key not in self.exclude and key not in self.seen:
            self.seen[key] = _expr(t.untyped_storage().nbytes())
        return t

    def own(self, outputs) -> object:
        """Bytes saved outside the region's outputs (`SavedBytes.split`: a saved output is a
        value buffer the stash holds, counted as the value)."""
        outs = {StorageWeakRef(o.untyped_storage()) for o in outputs
                if isinstance(o, torch.Tensor)}
        return sum((b for k, b in self.seen.items() if k not in outs), 0)


def token_rows(capture, batch: dict[str, torch.Tensor], saved: dict[int, int], values: dict,
               ) -> tuple[dict[str, str], dict[int, dict[str, int]]]:
    """-> (rows: value -> the symbol its first dimension is, saved_rows: region -> bytes per
    row of each symbol its saved bytes depend on). Only data-dependent sizes appear; a
    value whose shape depends on the data past its first dimension is left as captured."""
    import sympy  # symbolic shapes: imported here, as only expert plans need them
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    rows: dict[str, str] = {}
    per_row: dict[int, dict[str, int]] = {}
    with mode, torch.random.fork_rng(devices=[]):
        memo: dict[int, torch.Tensor] = {}

        def fake(t: torch.Tensor) -> torch.Tensor:   # one fake per real tensor (tied weights)
            if id(t) not in memo:
                memo[id(t)] = mode.from_tensor(t, static_shapes=True)
            return memo[id(t)]
        exclude: set = set()
        vals = {k: fake(t) for k, t in batch.items()}
        for info, mod in zip(capture.regions, capture.modules, strict=True):
            state = {n: fake(t) for n, t in [*mod.named_parameters(), *mod.named_buffers()]}
            exclude |= {StorageWeakRef(t.untyped_storage()) for t in state.values()}
            deliver(capture, info, vals)
            args = region_args(info, vals, frozenset(batch))
            counter = _Saved(exclude | {StorageWeakRef(a.untyped_storage()) for a in args})
            with counter.hooks:
                outs = torch.func.functional_call(mod, state, tuple(args))
            for name, out in zip(info.outputs, outs, strict=True):
                vals[name] = out
                first = _expr(out.shape[0]) if out.dim() else 0
                if isinstance(first, sympy.Symbol) and not any(
                        isinstance(s, torch.SymInt) for s in out.shape[1:]):
                    rows[name] = str(first)
            terms = _affine(_expr(counter.own(outs)))
            if terms is not None and len(terms) > 1:
                per_row[info.index] = terms
    hints = captured_rows(rows, values)
    out = {}
    for r, terms in per_row.items():   # kept where it reproduces propagate's figure
        coef = {s: c for s, c in terms.items() if s}
        if all(s in hints for s in coef) and terms[""] + sum(
                c * hints[s] for s, c in coef.items()) == saved[r]:
            out[r] = coef
    return rows, out
