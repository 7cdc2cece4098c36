"""Flat bucket layouts, batch slicing and full-model assembly: the arithmetic of the runtime.

A bucket's parameters travel as one flat buffer: their tensors flattened and concatenated in
bucket order, padded with zeros to a multiple of the group size; shard i (of `shard`
elements) belongs to the device at position i of the group (ZeRO's flat parameter, as in
DeepSpeed and FSDP1). Microbatch `mb` of a batch is chunk `mb` of `microbatches` equal
chunks along dim 0, and replica `i` of `n` takes part `i` of that chunk. Nothing here talks
to other processes, so the driver uses it too (to put shards back into a full state dict).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from piper_nb.optim import shard_pieces
from piper_nb.tp import join_shards, local_shard

__all__ = ["Layout", "bucket_layouts", "batch_part", "assemble_state", "assemble_optim_state",
           "local_init"]


@dataclass(frozen=True)
class Layout:
    """Where each parameter of bucket `index` sits in the flat buffer."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]        # element offset of each parameter
    total: int                      # elements before padding
    shard: int                      # elements per shard (padded total / group size)
    group: tuple[int, ...]
    zero: int

    @property
    def padded(self) -> int:
        return self.shard * len(self.group)

    def position(self, device: int) -> int:
        return self.group.index(device)

    def flatten(self, tensors: list[torch.Tensor | None], like: torch.Tensor) -> torch.Tensor:
        """One padded flat buffer; None (no gradient) counts as zeros."""
        flat = torch.zeros(self.padded, dtype=like.dtype, device=like.device)
        for t, off, shape in zip(tensors, self.offsets, self.shapes, strict=True):
            if t is not None:
                flat[off:off + math.prod(shape)].copy_(t.detach().reshape(-1))
        return flat

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` (a full padded buffer) shaped like each parameter."""
        return [flat[off:off + math.prod(shape)].view(shape)
                for off, shape in zip(self.offsets, self.shapes, strict=True)]

    def my_shard(self, flat: torch.Tensor, device: int) -> torch.Tensor:
        pos = self.position(device)
        return flat[pos * self.shard:(pos + 1) * self.shard]

    def pieces(self, device: int, group_of) -> list[tuple[str, int, int, int]]:
        """`device`'s shard cut where the parameter group changes (`optim.shard_pieces`):
        (first name, start, stop, group), start and stop inside the shard."""
        sizes = [(n, math.prod(s)) for n, s in zip(self.names, self.shapes, strict=True)]
        return shard_pieces(sizes, self.shard, self.position(device), group_of)

    def piece(self, device: int, group_of, first: str) -> tuple[int, int]:
        """(start, stop) inside `device`'s shard of the piece that begins at `first`."""
        return next((lo, hi) for name, lo, hi, _ in self.pieces(device, group_of)
                    if name == first)


def bucket_layouts(plan) -> dict[int, Layout]:
    """Layout of every bucket of `plan` (shapes from `plan.params`)."""
    out = {}
    for b in plan.buckets:
        shapes = tuple(tuple(plan.params[p][0]) for p in b.params)
        offsets, off = [], 0
        for s in shapes:
            offsets.append(off)
            off += math.prod(s)
        n = len(b.group)
        out[b.index] = Layout(b.index, tuple(b.params), shapes, tuple(offsets), off,
                              -(-off // n), tuple(b.group), b.zero)
    return out


def batch_part(t: torch.Tensor, microbatches: int, mb: int, replica: int, replicas: int
               ) -> torch.Tensor:
    """Part `replica` of `replicas` of microbatch `mb` of `microbatches` (dim 0)."""
    chunk = t.shape[0] // microbatches
    part = chunk // replicas
    start = mb * chunk + replica * part
    return t[start:start + part]


def local_init(init: dict[str, torch.Tensor], plan, device: int) -> dict[str, torch.Tensor]:
    """The initial parameters as `device` holds them: its shard of each tensor-parallel one
    (`plan.tp_params`), the rest whole."""
    if not plan.tp_params:
        return init
    rank = plan.tp_rank(device)
    return {n: local_shard(t, *plan.tp_params[n], rank) if n in plan.tp_params else t
            for n, t in init.items()}


def _per_rank(plan, per_device: list[dict]) -> list[list[dict]]:
    """The workers' reports split by tensor-parallel rank (one list when there is none)."""
    if not plan.tp_params:
        return [per_device]
    ranks = [plan.tp_rank(d) for d in range(len(per_device))]
    return [[st if ranks[d] == k else {} for d, st in enumerate(per_device)]
            for k in range(max(ranks) + 1)]


def _joined(plan, by_rank: list[dict], name: str, value):
    """A tensor-parallel parameter's (or its state's) shards joined back into one tensor."""
    dim, degree, blocks = plan.tp_params[name]
    return join_shards([value(by_rank[k]) for k in range(degree)], dim, blocks)


def _held(plan, per_device: list[dict], layouts) -> dict[str, torch.Tensor]:
    full: dict[str, torch.Tensor] = {}
    for st in per_device:
        for name, t in st.get("full", {}).items():
            full.setdefault(name, t)
    shards: dict[int, dict[int, torch.Tensor]] = {}
    for st in per_device:
        for b, (pos, t) in st.get("shards", {}).items():
            shards.setdefault(b, {})[pos] = t
    for b, parts in shards.items():
        lay = layouts[b]
        if all(n in full for n in lay.names) or len(parts) != len(lay.group):
            continue
        flat = torch.cat([parts[i] for i in range(len(lay.group))])
        for name, view in zip(lay.names, lay.views(flat), strict=True):
            full.setdefault(name, view.clone())
    return full


def assemble_state(plan, per_device: list[dict]) -> dict[str, torch.Tensor]:
    """Canonical parameter name -> full tensor, from each worker's `export_state()`, and
    buffer name -> tensor for the buffers the workers train.

    A worker reports the parameters it holds in full and, for ZeRO-3 buckets, its shard;
    shards are concatenated in group order and cut back into parameters. Tensor-parallel
    parameters are joined from every rank's shard (`plan.tp_params`). Expert pieces
    (`plan.pieces`: `<param>[lo:hi]`, `capture.experts`) are concatenated along dim 0 back
    into their stacked parameter. Each trained buffer comes from the one device that owns
    it (`runtime.buffers`).
    """
    layouts = bucket_layouts(plan)
    by_rank = [_held(plan, states, layouts) for states in _per_rank(plan, per_device)]
    full = dict(by_rank[0])
    for name in plan.tp_params:
        if all(name in held for held in by_rank[:plan.tp_params[name][1]]):
            full[name] = _joined(plan, by_rank, name, lambda held, n=name: held[n])
    missing = [n for n in plan.params if n not in full]
    if missing:
        raise RuntimeError(f"no worker holds parameters {missing[:5]}; the plan places them "
                           "nowhere")
    pieces = sorted(getattr(plan, "pieces", {}).items(), key=lambda kv: (kv[1][0], kv[1][1]))
    for name, (stacked, _, _) in pieces:   # expert pieces back into their stacked parameter
        piece = full.pop(name)
        full[stacked] = torch.cat([full.pop(stacked), piece]) if stacked in full else piece
    for st in per_device:
        full.update(st.get("buffers", {}))
    return full


def assemble_optim_state(plan, per_device: list[dict], group_of) -> dict[str, dict]:
    """`_optim_state` per tensor-parallel rank, each sharded parameter's state tensors of its
    shape joined back into the whole parameter's (scalars, such as `step`, from rank 0)."""
    by_rank = [_optim_state(plan, states, group_of) for states in _per_rank(plan, per_device)]
    out = by_rank[0]
    for name, (_, degree, _) in plan.tp_params.items():
        if name not in out or not all(name in r for r in by_rank[:degree]):
            continue
        shape = tuple(plan.params[name][0])
        for k, v in out[name].items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == shape:
                out[name][k] = _joined(plan, by_rank, name, lambda r, n=name, k=k: r[n][k])
    return out


def _optim_state(plan, per_device: list[dict], group_of) -> dict[str, dict]:
    """Canonical parameter name -> its full optimizer state (`exp_avg`, `step`, ...), from
    each worker's `train_state()`: a parameter updated whole gives its state as it is (the
    replicas hold equal copies); ZeRO shards give theirs piece by piece (`optim.shard_pieces`,
    `group_of` the optimizer's groups), laid back into the bucket's flat order and cut into
    parameters, as the shards of the parameters are. bf16 master weights are left out."""
    out: dict[str, dict] = {}
    layouts = bucket_layouts(plan)
    flats: dict[tuple[int, str], torch.Tensor] = {}
    scalars: dict[int, dict] = {}
    for rank, st in enumerate(per_device):
        for key, state in (st or {}).get("optim", {}).items():
            if isinstance(key, str):
                out.setdefault(key, dict(state))
            elif key[0] == "bucket":
                _, b, first = key
                lay = layouts[b]
                pos = lay.position(rank)
                lo, hi = lay.piece(rank, group_of, first)
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == hi - lo:
                        flat = flats.setdefault((b, k), torch.zeros(lay.padded, dtype=v.dtype))
                        flat[pos * lay.shard + lo:pos * lay.shard + hi] = v
                    else:
                        scalars.setdefault(b, {}).setdefault(k, v)
    for (b, k), flat in flats.items():
        for name, view in zip(layouts[b].names, layouts[b].views(flat), strict=True):
            out.setdefault(name, {})[k] = view.clone()
    for b, values in scalars.items():
        for name in layouts[b].names:
            if name in out:
                for k, v in values.items():
                    out[name].setdefault(k, v.clone() if isinstance(v, torch.Tensor) else v)
    return dict(sorted(out.items()))
