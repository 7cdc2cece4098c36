"""The state of one worker: parameters (full or ZeRO shards) and values in flight.

`ParamStore` owns one `nn.Parameter` per parameter the device touches, the flat shards of
its ZeRO buckets, the reduced gradient shards, and the optimizer state, which exists only
where an update runs (per parameter, or per bucket shard). A ZeRO-3 bucket's parameters are
views of one full flat buffer whose storage is resized to 0 between uses (FSDP's trick): an
all-gather's WAIT re-allocates it and copies the gathered values in (the first of several
overlapping users; a reference count), the matching FREE releases it. Autograd's saved
views of a weight (`W.t()` for a matmul) point at that same storage, so a backward pass
after the next gather reads the right values, and nothing keeps a stale copy alive.
`ValueStore` holds activations, value gradients and the forward stash.

Memory is counted by the rule `sim.memory` predicts: bytes actually held, in logical
tensor bytes, each tensor once. Parameters held (full, or the ZeRO-3 shard plus gathered
buckets); gradients while they exist, plus reduced shards; optimizer state; activations =
the bytes autograd saved per stash (`SavedBytes`, as `pn.compile` measures them) + each
act:/grad: buffer once while the store or a stash still holds it (a stash keeps the input
and output buffers autograd saved, a recomputed forward's inputs until its backward and,
between BI and BW, the output gradients) + receive buffers in flight; buffers =
reduce/gather buffers in flight and ZeRO-1/2 shards awaiting their gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from piper_nb.ir.kinds import Held
from piper_nb.runtime.layout import Layout

__all__ = ["ParamStore", "ValueStore", "Stash", "nbytes"]


def nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class ParamStore:
    def __init__(self, names: list[str], init: dict[str, torch.Tensor], layouts: dict[int, Layout],
                 device_id: int, device: torch.device, frozen: frozenset[str] = frozenset()):
        self.device_id, self.device = device_id, device
        self.params = {n: nn.Parameter(torch.empty(0, dtype=init[n].dtype, device=device),
                                       requires_grad=n not in frozen)
                       for n in names}
        self.layouts = {b: lay for b, lay in layouts.items()
                        if device_id in lay.group and any(n in self.params for n in lay.names)}
        self.reset(init)

    def reset(self, init: dict[str, torch.Tensor]) -> None:
        """Parameters back to `init`, no gradients, no optimizer state; ZeRO-3 sharded."""
        for n, p in self.params.items():
            p.data = init[n].to(self.device, copy=True)
            p.grad = None
        self.shards: dict[int, torch.Tensor] = {}       # bucket -> this device's flat shard
        self.grad_shards: dict[int, torch.Tensor] = {}  # bucket -> reduced gradient shard
        self.refs: dict[int, int] = {}                  # ZeRO-3 bucket -> gathers in use
        self.full: dict[int, torch.Tensor] = {}         # ZeRO-3 bucket -> full flat buffer
        self.state: dict = {}                           # name | ("bucket", b) -> optimizer state
        for b, lay in self.layouts.items():
            if lay.zero == 3:
                flat = self.full[b] = self.flat_params(b)
                self.shards[b] = lay.my_shard(flat, self.device_id).clone()
                for n, v in zip(lay.names, lay.views(flat), strict=True):
                    self.params[n].data = v
                self.release(b)
        self.sharded = {n for b in self.full for n in self.layouts[b].names}

    def like(self, b: int) -> torch.Tensor:
        """A parameter of bucket b (its dtype and device are the bucket's)."""
        return self.params[self.layouts[b].names[0]]

    def flat_params(self, b: int) -> torch.Tensor:
        lay = self.layouts[b]
        return lay.flatten([self.params[n].data for n in lay.names], self.like(b))

    def flat_grads(self, b: int) -> torch.Tensor:
        lay = self.layouts[b]
        return lay.flatten([self.params[n].grad for n in lay.names], self.like(b))

    def clear_grads(self, b: int) -> None:
        for n in self.layouts[b].names:
            self.params[n].grad = None

    def set_grads(self, b: int, flat: torch.Tensor) -> None:
        """ALL_REDUCE done: the summed gradients become views of the flat buffer (in the
        parameters' dtype: a bf16 plan reduces in fp32, then rounds once)."""
        if flat.dtype != self.like(b).dtype:
            flat = flat.to(self.like(b).dtype)
        for n, v in zip(self.layouts[b].names, self.layouts[b].views(flat), strict=True):
            self.params[n].grad = v

    def add_grad_shard(self, b: int, shard: torch.Tensor) -> None:
        old = self.grad_shards.get(b)
        self.grad_shards[b] = shard if old is None else old + shard

    def write_params(self, b: int, flat: torch.Tensor) -> None:
        """ZeRO-1/2 ALL_GATHER done: copy the updated parameters in."""
        with torch.no_grad():
            for n, v in zip(self.layouts[b].names, self.layouts[b].views(flat), strict=True):
                self.params[n].data.copy_(v)
        self.shards.pop(b, None)

    def acquire(self, b: int, flat: torch.Tensor) -> None:
        """ZeRO-3 ALL_GATHER done: the first user re-fills the bucket's storage; count."""
        if self.refs.get(b, 0) == 0:
            full = self.full[b]
            full.untyped_storage().resize_(full.numel() * full.element_size())
            with torch.no_grad():
                full.copy_(flat)
        self.refs[b] = self.refs.get(b, 0) + 1

    def free(self, b: int) -> None:
        self.refs[b] = self.refs.get(b, 0) - 1
        if self.refs[b] <= 0:
            self.refs[b] = 0
            self.release(b)

    def release(self, b: int) -> None:
        """ZeRO-3: let go of bucket b's gathered storage (its parameters keep their views)."""
        self.full[b].untyped_storage().resize_(0)

    def gathered(self, b: int) -> bool:
        return self.full[b].untyped_storage().nbytes() > 0

    def to_update(self, names: tuple[str, ...], buckets: tuple[int, ...]) -> tuple[list, list]:
        """What a U updates here: [(name, parameter)] of full parameters with a gradient, and
        [(bucket, shard, gradient shard)] of this device's bucket shards (a ZeRO-1/2 shard is
        cut from the full parameters now and held until its gather)."""
        full = [(n, self.params[n]) for n in names if self.params[n].grad is not None]
        shards = []
        for b in buckets:
            lay = self.layouts[b]
            if lay.zero == 3:
                shard = self.shards[b]
            else:  # ZeRO-1/2: the full parameters are here; update our slice, gather later
                shard = lay.my_shard(self.flat_params(b), self.device_id).clone()
                self.shards[b] = shard
            grad = self.grad_shards.pop(b, None)
            if grad is not None:
                shards.append((b, shard, grad))
        return full, shards

    def grads_done(self, names: tuple[str, ...]) -> None:
        """After U: the full parameters' gradients are consumed."""
        for n in names:
            self.params[n].grad = None

    def bytes(self) -> tuple[int, int, int]:
        """(parameters held, gradients, optimizer state) in bytes."""
        params = sum(nbytes(p) for n, p in self.params.items() if n not in self.sharded)
        params += sum(nbytes(s) for b, s in self.shards.items() if self.layouts[b].zero == 3)
        params += sum(nbytes(f) for b, f in self.full.items() if self.gathered(b))
        grads = sum(nbytes(p.grad) for p in self.params.values())
        grads += sum(nbytes(g) for g in self.grad_shards.values())
        optim = sum(nbytes(t) for st in self.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor))
        return params, grads, optim

    def pending_bytes(self) -> int:
        """ZeRO-1/2 shards updated and waiting for their ALL_GATHER."""
        return sum(nbytes(s) for b, s in self.shards.items() if self.layouts[b].zero != 3)

    def export(self) -> dict:
        """Full parameters held (CPU copies) and ZeRO-3 shards, for `assemble_state`."""
        full = {n: p.detach().cpu().clone() for n, p in self.params.items()
                if n not in self.sharded}
        shards = {b: (self.layouts[b].position(self.device_id), s.detach().cpu().clone())
                  for b, s in self.shards.items() if self.layouts[b].zero == 3}
        return {"full": full, "shards": shards}

    def export_train_state(self) -> dict:
        """`export()` plus the optimizer state (CPU copies), at a step boundary."""
        out = self.export()
        out["optim"] = {k: {n: v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v
                            for n, v in st.items()} for k, st in self.state.items()}
        return out

    def load_train_state(self, st: dict) -> None:
        """Put `export_train_state()`'s output back (after `reset`): parameters held in full,
        ZeRO-3 shards (their gathered buffers stay released) and optimizer state."""
        with torch.no_grad():
            for n, t in st["full"].items():
                if n in self.params and n not in self.sharded:
                    self.params[n].data.copy_(t)
            for b, (_, t) in st["shards"].items():
                self.shards[b].copy_(t)
        self.state = {k: {n: v.to(self.device) if isinstance(v, torch.Tensor) else v
                          for n, v in opt.items()} for k, opt in st["optim"].items()}


@dataclass
class Stash:
    """The autograd state of one forward, kept until its backward (`runtime.entries`)."""

    inputs: Any                                 # `Entries`: the inputs' gradient sink, or None
    roots: dict                                 # output -> (gradient edge, shape, dtype, device)
    saved: int                                  # bytes autograd saved (SavedBytes.split)
    kept: list[torch.Tensor]                    # input and output buffers autograd saved
    out_grads: list | None = None               # BI keeps (roots, grads) for BW
    args: list | None = None                    # a recomputed forward's inputs, until B/BI
    rng: tuple | None = None                    # and the random state it started from
    entering: list[int] = field(default_factory=list)   # the inputs that need gradients
    raw: list | None = None                     # its inputs as buffers (None: the batch's)


@dataclass
class ValueStore:
    acts: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    grads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    stash: dict[tuple[int, int], Stash] = field(default_factory=dict)

    def add_grad(self, value: str, mb: int, g: torch.Tensor) -> None:
        old = self.grads.get((value, mb))
        self.grads[(value, mb)] = g if old is None else old + g

    def drop(self, kind: str, key: tuple[str, int]) -> None:
        """Drop the buffer a parsed FREE key (`parse_free("act:x@1")`) names, if held."""
        (self.acts if kind == Held.ACT else self.grads).pop(key, None)

    def clear(self) -> None:
        self.acts.clear()
        self.grads.clear()
        self.stash.clear()

    def bytes(self) -> int:
        """Saved bytes of every stash + each value buffer once, while anything holds it."""
        held = [*self.acts.values(), *self.grads.values()]
        for s in self.stash.values():
            held += s.kept
            held += s.out_grads[1] if s.out_grads else ()
        return sum(s.saved for s in self.stash.values()) + _distinct_bytes(held)


def _distinct_bytes(tensors) -> int:
    """Logical bytes of `tensors`, each counted once however many holders it has (a detached
    leaf and the buffer it came from are one; None is skipped)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            n = nbytes(t)
            if n > seen.get(t.data_ptr(), -1):
                seen[t.data_ptr()] = n
    return sum(seen.values())
