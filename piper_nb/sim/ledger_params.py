"""The parameter store's side of the memory ledger (`ParamLedger`, a part of
`sim.ledger.Ledger`, as `runtime.stores.ParamStore` is of the worker): parameter bytes
held, gradients as they appear and go, and what a collective's WAIT or a FREE does to
ZeRO buckets (reduced shards, gathered ZeRO-3 buckets, ZeRO-1/2 shards awaiting their
gather)."""

from __future__ import annotations

import math

from piper_nb.ir.kinds import Memory
from piper_nb.plan.sizes import element_size

__all__ = ["ParamLedger", "param_numel", "PARAMS", "GRADS", "OPTIM", "ACTIVATIONS", "BUFFERS"]

# the memory kinds as plain ints: indexing `level` with an IntEnum member costs six times an
# int in the ledger's loop, which runs once per instruction of every device
PARAMS, GRADS, OPTIM, ACTIVATIONS, BUFFERS = (int(m) for m in Memory)


def param_numel(plan, p: str) -> int:
    """Elements of parameter `p` of `plan`."""
    return math.prod(plan.params[p][0])


class ParamLedger:
    """Parameter, gradient and ZeRO-shard bytes of a `Ledger`, which holds what they read:
    `plan`, `names` (parameters the device touches), `frozen`, `buckets` (its own), `pb`,
    `gb` and `rb` (bytes per element of parameters, gradients and reductions), `gsize`,
    the running totals `level`, and `grads`, `grad_shards`, `refs` and `zero_shards`."""

    def _params_held(self) -> float:
        """Parameter bytes held throughout: full parameters and ZeRO-3 bucket shards."""
        zero3 = [b for b in self.buckets.values() if b.zero == 3]
        sharded = {n for b in zero3 for n in b.params}
        base = sum(param_numel(self.plan, n) * (self.pb if self.pb is not None else self.elem(n))
                   for n in self.names if n not in sharded)
        return base + sum(self._shard(b.index, self.pb) for b in zero3)

    def elem(self, name: str) -> int:
        """Bytes per element of parameter `name`."""
        return element_size(self.plan.params[name][1])

    def _shard(self, b: int, per: float | None) -> float:
        """Bytes of one padded shard of bucket b (`per` bytes per element, None: dtype)."""
        bk = self.plan.buckets[b]
        total = sum(param_numel(self.plan, n) for n in bk.params)
        per = per if per is not None else self.elem(bk.params[0])
        return -(-total // len(bk.group)) * per

    def _padded(self, b: int, per: float | None) -> float:
        return self._shard(b, per) * len(self.plan.buckets[b].group)

    # -- gradients --
    def _param_grads(self, names) -> None:
        for n in names:
            if n in self.names and n not in self.grads and n not in self.frozen:
                self.grads[n] = None
                self.level[GRADS] += self.gsize[n]

    def _drop_grads(self, names) -> None:
        for n in names:
            if n in self.grads:
                del self.grads[n]
                self.level[GRADS] -= self.gsize[n]

    # -- what a WAIT or FREE does to the buckets --
    def _set_grads(self, b: int) -> None:
        """An all-reduce's WAIT: the gradients become views of the reduced flat bucket."""
        self._param_grads(self.buckets[b].params)

    def _add_grad_shard(self, b: int) -> None:   # a reduce-scatter's WAIT
        shard = self._shard(b, self.rb)
        self.level[GRADS] += shard - self.grad_shards.get(b, 0)
        self.grad_shards[b] = shard

    def _acquire(self, b: int) -> None:
        """A ZeRO-3 gather's WAIT: the full bucket, one buffer however many gathers overlap."""
        self.refs[b] = self.refs.get(b, 0) + 1
        if self.refs[b] == 1:
            self.level[PARAMS] += self._padded(b, self.pb)

    def _write_params(self, b: int) -> None:
        """A ZeRO-1/2 gather's WAIT: the updated shard waiting for it goes."""
        if b in self.zero_shards:
            self.level[BUFFERS] -= self.zero_shards.pop(b)

    def _release(self, b: int) -> None:
        """`free(param:b)`: the full bucket goes with its last use."""
        if self.refs.get(b, 0) > 0:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.level[PARAMS] -= self._padded(b, self.pb)
