"""Parameter units for the gradient completeness check (`gradflow`): which gradient
contributions a parameter's update must have seen, as the bits of one integer mask.

A bucket's parameters are reduced together, so the bucket is one unit; a parameter
outside buckets (one holder) is its own. Each backward that uses a unit (a region, a
microbatch, a replica) owns one bit of the unit's mask.
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["Units", "set_bits"]


def set_bits(mask: int) -> list[int]:
    """The indices of the bits set in `mask`, lowest first."""
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


class Units:
    """Parameter units and their bits: a bucket's parameters are reduced together, so the
    bucket is one unit; a parameter outside buckets (one holder) is its own. Bit
    ((position of the region in the unit) * microbatches + mb) * width + replica."""

    def __init__(self, plan, width: dict[int, int], frozen: frozenset[str]):
        self.plan, self.frozen = plan, frozen
        self.mbs = max(plan.microbatches, 1)
        # a parameter is in one bucket, or in one per tensor-parallel rank (`tp.widen`)
        self.buckets_of: dict[str, list[int]] = defaultdict(list)
        for b in plan.buckets:
            for p in b.params:
                self.buckets_of[p].append(b.index)
        regions_of: dict[object, list[int]] = defaultdict(list)
        for r in plan.regions:
            for p in r.params:
                for u in self.buckets_of.get(p) or [p]:
                    if p not in frozen and r.index not in regions_of[u]:
                        regions_of[u].append(r.index)
        self.regions_of = dict(regions_of)
        self.wmax = {u: max(width.get(r, 1) for r in rs) for u, rs in self.regions_of.items()}
        self.expected: dict[object, int] = {}
        for u, rs in self.regions_of.items():
            mask = 0
            for r in rs:
                mask |= self._block(u, r, (1 << width.get(r, 1)) - 1)
            self.expected[u] = mask
        self._of_region: dict[tuple[int, int], tuple] = {}
        self._columns: dict[tuple, int] = {}

    def offset(self, u, region: int) -> int:
        return self.regions_of[u].index(region) * self.mbs * self.wmax[u]

    def _block(self, u, region: int, row: int) -> int:
        """The bits `row` (replicas, under 1 << wmax) of every microbatch of `region` in
        unit u: `row` repeated every wmax bits (times a mask with one bit per microbatch;
        the copies do not overlap, so nothing carries)."""
        w = self.wmax[u]
        every = ((1 << w * self.mbs) - 1) // ((1 << w) - 1)   # bits 0, w, 2w, ...
        return (row * every) << self.offset(u, region)

    def column(self, u, region: int, rep: int | None) -> int:
        """The bits of `region` in unit u: all of them, or one replica's (`rep`)."""
        key = (u, region, rep)
        mask = self._columns.get(key)
        if mask is None:
            row = (1 << self.wmax[u]) - 1 if rep is None else 1 << rep
            mask = self._columns[key] = self._block(u, region, row)
        return mask

    def of_region(self, region: int, device: int) -> tuple:
        """(unit, bit offset, width) for each unit region `region` adds to on `device`."""
        key = (region, device)
        out = self._of_region.get(key)
        if out is None:
            units = []
            for p in self.plan.regions[region].params:
                if p in self.frozen:
                    continue
                u = self.unit(p, device)
                if all(u != x[0] for x in units):
                    units.append((u, self.offset(u, region), self.wmax[u]))
            out = self._of_region[key] = tuple(units)
        return out

    def unit(self, p: str, device: int):
        for b in self.buckets_of.get(p, ()):
            if device in self.plan.buckets[b].group:
                return b
        return p

    def name(self, u) -> str:
        if isinstance(u, int):
            ps = self.plan.buckets[u].params
            return f"bucket {u} ({', '.join(ps[:3])}{' ...' if len(ps) > 3 else ''})"
        return f"parameter {u}"

    def describe(self, u, mask: int) -> str:
        rs, w, bits = self.regions_of[u], self.wmax[u], set_bits(mask)
        out = []
        for i in bits[:4]:
            ri, m = divmod(i // w, self.mbs)
            out.append(f"{{{self.plan.regions[rs[ri]].name}}} microbatch {m} replica {i % w}")
        return ", ".join(out) + (f" and {len(bits) - 4} more" if len(bits) > 4 else "")
