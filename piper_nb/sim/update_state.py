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

__all__ = ["update_states", "update_state", "shard_states", "state_levels"]


def _state_fn(plan, settings: MemorySettings):
    """(shape, dtype, group) -> bytes of state one updated tensor keeps."""
    if plan.precision == "fp32":
        return settings.optim_state
    return lambda shape, dtype, g: (settings.optim_state(shape, "float32", g)
                                    + 4 * math.prod(shape))


def shard_states(plan, bucket, position: int, settings: MemorySettings
                 ) -> list[tuple[str, float]]:
    """(first name, bytes of state) per piece of shard `position` of `bucket`."""
    state = _state_fn(plan, settings)
    sizes = [(n, math.prod(plan.params[n][0])) for n in bucket.params]
    shard = -(-sum(k for _, k in sizes) // len(bucket.group))
    dtype = plan.params[bucket.params[0]][1]
    return [(name, state((hi - lo,), dtype, g))
            for name, lo, hi, g in shard_pieces(sizes, shard, position, settings.group_of)]


def update_states(plan, instrs, d: int, buckets: dict, settings: MemorySettings
                  ) -> dict[int, dict]:
    """U index -> {key: bytes of state}, for device `d` holding `buckets` (index -> Bucket)."""
    return {i: update_state(plan, ins, d, buckets, settings)
            for i, ins in enumerate(instrs) if ins.kind == Op.U}


def update_state(plan, ins, d: int, buckets: dict, settings: MemorySettings) -> dict:
    """{key: bytes of state} that the update `ins` leaves on device `d` (see above)."""
    state = _state_fn(plan, settings)
    st = {n: state(plan.params[n][0], plan.params[n][1], settings.group_of(n))
          for n in ins.data.params if n in plan.params}
    for b in ins.data.buckets:
        if b not in buckets:
            continue
        bk = buckets[b]
        for name, nbytes in shard_states(plan, bk, bk.group.index(d), settings):
            st[("bucket", b, name)] = nbytes
    return st


def state_levels(states: list[dict], first_step: bool) -> tuple[float, list[float]]:
    """The bytes of optimizer state held before a device's first instruction, and after
    each of its updates (`states`, in order: what each leaves, as `update_state` says): a
    steady-state step holds all of it throughout, a first step from each update on."""
    held = {} if first_step else {k: v for st in states for k, v in st.items()}
    level, after = sum(held.values()), []
    start = level
    for st in states:
        for key, nbytes in st.items():
            level += nbytes - held.get(key, 0)
            held[key] = nbytes
        after.append(level)
    return start, after
