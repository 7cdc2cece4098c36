"""Routed token rows at run time: a plan's expert buffers sized from a routing.

The compiler (`compiler.token_rows.token_rows`) writes each routed value's rows as a symbol and
each expert region's saved bytes as an affine expression in the symbols; these helpers
evaluate them for the routing the memory model is given."""

from __future__ import annotations

__all__ = ["captured_rows", "saved_at"]


def captured_rows(rows: dict[str, str], values: dict) -> dict[str, int]:
    """symbol -> its size in the captured routing (`propagate`'s shapes)."""
    out: dict[str, int] = {}
    for v, s in rows.items():
        out.setdefault(s, values[v].shape[0])
    return out


def saved_at(captured: int, coef: dict[str, int], at: dict[str, int],
             hints: dict[str, int]) -> int:
    """A region's saved bytes with symbol sizes `at`, from its bytes at `hints`."""
    return captured + sum(c * (at[s] - hints[s]) for s, c in coef.items())
