"""What each update (U) leaves behind on a device: the optimizer state of what it updates,
keyed as the worker keys it (`runtime.update`): a parameter's name, or ("bucket", b, first
name) per piece of a bucket shard (a shard is cut where the parameter group changes,
`optim.shard_pieces`). Each entry is the bytes the optimizer really allocates for that
tensor (`MemorySettings.optim_state`: its scalar step included); a bf16 plan steps fp32
masters, so its state is the fp32 optimizer's plus the 4-byte master copy.
"""

from __future__ import annotations

import math

from piper_nb.ir.kinds import Op
from piper_nb.optim import shard_pieces
from piper_nb.sim.memory_settings import MemorySettings

__all__ = ["update_states"]


def update_states(plan, instrs, d: int, buckets: dict, settings: MemorySettings
                  ) -> dict[int, dict]:
    """U index -> {key: bytes of state}, for device `d` holding `buckets` (index -> Bucket)."""
    mixed = plan.precision != "fp32"

    def state(shape, dtype: str, g: int) -> float:
        if not mixed:
            return settings.optim_state(shape, dtype, g)
        return settings.optim_state(shape, "float32", g) + 4 * math.prod(shape)

    out: dict[int, dict] = {}
    for i, ins in enumerate(instrs):
        if ins.kind != Op.U:
            continue
        st = {n: state(plan.params[n][0], plan.params[n][1], settings.group_of(n))
              for n in ins.params if n in plan.params}
        for b in ins.buckets:
            if b not in buckets:
                continue
            bk = buckets[b]
            sizes = [(n, math.prod(plan.params[n][0])) for n in bk.params]
            shard = -(-sum(k for _, k in sizes) // len(bk.group))
            dtype = plan.params[bk.params[0]][1]
            for name, lo, hi, g in shard_pieces(sizes, shard, bk.group.index(d),
                                                settings.group_of):
                st[("bucket", b, name)] = state((hi - lo,), dtype, g)
        out[i] = st
    return out
