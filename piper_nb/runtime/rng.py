"""The random state of each forward on a worker: what dropout draws from.

Each forward is seeded from (run seed, step, region, microbatch, replica), so a plan
trains the same way twice whatever order its devices happen to run in. The region is named
by its tags (`PP=1`), not by its index, and a tensor-parallel *part* (`PART=k`, see
`tp.rewrite`) by the region it was cut from: part 0 is seeded as that region
would be, and part k continues from the state part k - 1 left on this device for the same
microbatch. So a sharded region draws, op for op, from the stream the unsharded region
draws from, and the draws of its sharded dropouts (`tp.dropout`, a slice of the
whole mask) stay in step with it. Every TP rank seeds alike: a replicated part draws the
same masks on each. So do the members of a context group (`RegionInfo.context`), whose
plan replicas `k x degree .. k x degree + degree - 1` are data-parallel replica `k`: each
draws the whole sequence's mask and keeps its chunks of it (`cp.dropout`).

A recomputed forward runs again from the state its first run started from (`start`
returns it for such a forward, `restore` puts it back).
"""

from __future__ import annotations

import hashlib

import torch

from piper_nb.ir.filters import tags_text
from piper_nb.tp import PART

__all__ = ["forward_seed", "ForwardRng"]


def forward_seed(seed: int, step: int, region: str, mb: int, replica: int) -> int:
    """The generator seed of one forward: a hash, so nearby inputs give unrelated streams."""
    key = f"{seed}:{step}:{region}:{mb}:{replica}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


class ForwardRng:
    """Seeds torch's generators (the CPU's, and `device`'s on CUDA) for each forward of
    `plan` on one worker, as the module docstring says."""

    def __init__(self, plan, device: torch.device):
        self.device = device
        self.origin: dict[int, tuple[str, int]] = {}   # region -> (region cut from, part)
        self.context: dict[int, int] = {}   # region -> its context degree (members alike)
        for r in plan.regions:
            tags = dict(r.tags)
            part = tags.pop(PART, None)
            self.origin[r.index] = (tags_text(tags) or "all", part)
            if r.context:
                self.context[r.index] = r.context[0]
        self.after: dict[tuple, tuple] = {}   # (step, region cut from, mb, replica) -> state

    def start(self, seed: int, step: int, ins) -> tuple | None:
        """Seed (or continue) the generators for forward `ins`; the state it starts from
        when it is recomputed (read only then: a copy of the CUDA state synchronises)."""
        name, part = self.origin[ins.region]
        state = self.after.pop((step, name, ins.mb, ins.replica), None) if part else None
        if state is None:   # part 0, a whole region, or a part timed alone (the profiler)
            key = f"{name}#{part}" if part else name
            mb = max(ins.mb, 0)   # -1: a plan without microbatches, whose one is the 0th
            # a context group's members are one replica, seeded alike (`cp.dropout`)
            replica = ins.replica // self.context.get(ins.region, 1)
            s = forward_seed(seed, step, key, mb, replica)
            torch.default_generator.manual_seed(s)
            if self.device.type == "cuda":
                torch.cuda.default_generators[self.device.index or 0].manual_seed(s)
            return self.state() if ins.data.recompute else None
        self.restore(state)
        return state

    def end(self, step: int, ins) -> None:
        """After forward `ins` of a part: its state, for the next part of its region."""
        name, part = self.origin[ins.region]
        if part is not None:
            self.after[(step, name, ins.mb, ins.replica)] = self.state()

    def state(self) -> tuple:
        cuda = (torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None)
        return torch.get_rng_state(), cuda

    def restore(self, state: tuple) -> None:
        cpu, cuda = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, self.device)

    def new_step(self) -> None:
        """Forget what a step's last parts left: nothing continues across steps."""
        self.after.clear()
