"""Module buffers on a worker: what a forward changes besides its outputs.

Buffers (BatchNorm's running statistics and batch counter, any `register_buffer`) live in
the region modules a worker runs; several regions on one device share one module object,
so one tensor. A forward updates them in place, as in one process. `Buffers` keeps their
initial values (a new run starts from the model's), and exports the ones this device
trains: those of the regions whose first microbatch forward it runs as replica 0, so
each buffer comes back from exactly one device (`compiler.buffers` says why that device's
copy is the one-process value).

Random operations (dropout) draw from torch's generator, seeded for each forward by
`runtime.rng`.
"""

from __future__ import annotations

import torch
from torch import nn

from piper_nb.ir.kinds import Op

__all__ = ["Buffers"]


class Buffers:
    def __init__(self, plan, modules: dict[int, nn.Module], instrs):
        self.tensors: dict[str, torch.Tensor] = {}
        for mod in modules.values():
            for name, buf in mod.named_buffers():
                if name.startswith("model."):   # direct_calls' flat aliases are the same tensors
                    self.tensors.setdefault(name.removeprefix("model."), buf)
        self.init = {n: b.detach().clone() for n, b in self.tensors.items()}
        owned = {i.region for i in instrs if i.kind == Op.F and i.mb <= 0 and i.replica == 0}
        self.owned = [n for r in sorted(owned) for n in plan.regions[r].buffers
                      if n in self.tensors]

    def reset(self) -> None:
        self.load(self.init)

    def load(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in values.items():
                if name in self.tensors:
                    self.tensors[name].copy_(value)

    def export(self, owned: bool) -> dict[str, torch.Tensor]:
        """CPU copies of the buffers this device trains (`owned`) or of all it holds."""
        names = self.owned if owned else self.tensors
        return {n: self.tensors[n].detach().cpu().clone() for n in names}
