"""Sequence parallelism in a sharded region (Megatron's; Korthikanti et al. 2022): the
replicated parts run on each device's slice of the sequence, not on all of it.

With `sequence_parallel=True`, what a replicated part computes from the residual stream
(norms, dropout, residual sums, a rowwise layer's bias) holds `s/t` of the sequence on each
device. The analysis marks those ops *sequence-sharded* (`seq`), from three sources: a
region input that an earlier sequence-parallel region hands on as a slice, a region input
whose whole sequence this region cuts on entry (`narrow_sequence`; from a copy made in a
part before when it needs a gradient, so that its shares are summed), and the sum of a
rowwise layer's (or a vocabulary embedding's) partial output, of which each device keeps
its own slice (a reduce-scatter). Going back into a sharded part, a slice is laid into
zeros at its offset (`pad_sequence`) and all-gathered, which gives every device the whole
sequence; a slice leaving for a region not sequence-parallel does the same on its way out.
A value needing a gradient and read on slices (a norm's weight) goes through an alias made
in a part before, whose gradient, a per-device share, is summed on its way back.

An op that needs the whole sequence (a reduction over it such as a loss's mean, a
flattening of batch and sequence, an attention product outside the sharded layers), or
that would join slices to a whole value needing a gradient made in its own part, gets the
slices laid back whole first, and it and what follows move to a part after: any model
runs, and what can runs on slices. A length the degree does not divide is a PlanError.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from piper_nb.capture.sequence_ops import (
    SEQ_DIM,
    narrow_sequence,
    pad_sequence,
    whole_like,
    with_params,
)
from piper_nb.errors import PlanError
from piper_nb.ir.kinds import Op
from piper_nb.tp.parts import Info, P, R, S
from piper_nb.tp.reductions import reduced_dims
from piper_nb.tp.shapes import op_target
from piper_nb.tp.vocab import tp_rank

__all__ = ["SeqCut", "SeqPlan", "sequence_length", "shard_sequence"]
_ALIAS = torch.ops.aten.alias.default
_CLONE = torch.ops.aten.clone.default   # a parameter's: ZeRO-3 frees the gathered one
_SIZES = {torch.ops.aten.sym_size.int, torch.ops.aten.size.default, torch.ops.aten.dim.default}
_MIXING = {torch.ops.aten.matmul.default, torch.ops.aten.bmm.default,
           torch.ops.aten.scaled_dot_product_attention.default, torch.matmul, torch.bmm,
           torch.nn.functional.scaled_dot_product_attention}


def sequence_length(batch: dict, degree: int, region: str) -> int:
    """The batch's sequence length (dimension 1 of its first input with two or more), which
    the degree must divide."""
    seq = next((t.shape[SEQ_DIM] for t in batch.values()
                if isinstance(t, torch.Tensor) and t.dim() > SEQ_DIM), None)
    if seq is None:
        raise PlanError("tensor_parallel: sequence_parallel=True needs inputs of [batch, "
                        f"sequence, ...] (region {region}); the batch has "
                        + ", ".join(f"{k} {list(t.shape)}" for k, t in batch.items()))
    if seq % degree:
        raise PlanError(f"tensor_parallel: sequence_parallel=True cuts the sequence of region "
                        f"{region} ({seq} tokens) over {degree} devices, which does not divide "
                        f"it; use a sequence length that {degree} divides (pad it to "
                        f"{-(-seq // degree) * degree}) or a degree that divides {seq}")
    return seq


@dataclass
class SeqCut:
    """What the analysis found (node names): the sequence-sharded ops, the values whose
    gradients are summed, the region outputs handed on as slices, and the sums' kinds where
    not all-reduces: all-gathers of padded slices, reduce-scatters of values only cut
    (their gradients all-gathered)."""

    seq: set
    grad_sum: set
    sliced_outputs: set
    sums: dict = field(default_factory=dict)


class SeqPlan:
    """Sequence parallelism over a capture's regions, as `tp.rewrite` cuts them in order:
    which values leave a region as slices, and which regions run on slices."""

    def __init__(self, capture, chosen: dict, batch: dict):
        self.capture, self.batch = capture, batch
        self.on = {r: q for r, q in chosen.items() if q.sequence_parallel}
        self.sliced: dict[str, int] = {}   # value handed on as slices -> its degree
        self.regions: set[int] = set()

    def shard(self, gm, info, req, status, level, infos, streams) -> SeqCut:
        """`shard_sequence` for a region cut under `req`; nothing without sequence_parallel."""
        if not req.sequence_parallel:
            self.check_whole(info)
            return SeqCut(set(), set(), set())
        seq = sequence_length(self.batch, req.degree, info.name)
        keep = {v for v in info.outputs if self._takes_slices(v, req.degree)}
        sliced = {v for v in info.inputs if self.sliced.get(v) == req.degree}
        cut = shard_sequence(gm, status, level, infos, info, seq, req.degree, sliced,
                             streams, keep, set(self.batch))
        self.regions.add(info.index)
        self.sliced.update(dict.fromkeys(cut.sliced_outputs, req.degree))
        return cut

    def _takes_slices(self, v: str, degree: int) -> bool:
        readers = self.capture.consumers.get(v, ())
        return bool(readers) and all(r in self.on and self.on[r].degree == degree
                                     for r in readers)

    def args(self, info, args: list) -> list:
        """A region's recorded inputs as this device holds them: slices where handed on so."""
        return [narrow_sequence(a, self.sliced[v], torch.tensor(0)) if v in self.sliced
                else a for v, a in zip(info.inputs, args, strict=True)]

    def check_whole(self, info) -> None:
        """A region that takes the whole sequence must not be handed slices."""
        got = [v for v in info.inputs if v in self.sliced]
        if got:
            raise PlanError(
                f"tensor_parallel: sequence_parallel=True: region {info.name} reads "
                f"{', '.join(got)} as slices of the sequence but runs without sequence "
                "parallelism (it shards no layer, or its directive does not set "
                "sequence_parallel); shard a layer in it, or give it the same directive")


_Region = namedtuple("_Region", "name inputs outputs seq degree")   # one region's sizes


def shard_sequence(gm: fx.GraphModule, status: dict, level: dict, infos: dict, info,
                   seq: int, degree: int, sliced: set, streams: set, keep: set,
                   batch: set) -> SeqCut:
    """Mark and rewrite `gm` (after `parts.levels`) for sequence parallelism. `sliced`:
    region inputs an earlier region hands on as slices; `streams`: the partial nodes
    (rowwise layers, vocabulary embeddings) whose sums each device keeps a slice of;
    `keep`: region outputs the consumers take as slices; `batch`: the batch's names."""
    reg = _Region(info.name, tuple(info.inputs), tuple(info.outputs), seq, degree)
    g = gm.graph
    marked: set[fx.Node] = set()
    grad_sum: set[str] = set()
    before = False   # a part before the first, for copies whose gradient shares are summed
    phs = [n for n in g.nodes if n.op == "placeholder"]
    for ph, name in zip(phs, reg.inputs, strict=True):
        i = infos.get(ph.name)
        if name in sliced:
            marked.add(ph)
        elif (i is not None and i.floating and _stream(i, seq) and name not in batch
              and any(status.get(u) == R for u in ph.users)):
            users, src = list(ph.users), ph
            if i.grad:   # cut from a copy made a part before, where its shares are summed
                with g.inserting_after(phs[-1]):
                    src = g.call_function(_CLONE, (ph,))
                status[src], level[src], before = R, -1, True
                infos[src.name] = Info(True, True, i.shape, True)
                grad_sum.add(src.name)
            cut = _insert(gm, src, narrow_sequence, degree, after=src, users=[])
            for u in users:
                u.replace_input_with(ph, cut)
            status[cut], level[cut] = R, 0
            infos[cut.name] = Info(True, i.grad, i.shape, True)
            marked.add(cut)
    for p in [n for n in g.nodes if n in streams and _stream(infos.get(n.name), seq)]:
        users = [u for u in p.users if status.get(u) == R]
        if not users:
            continue
        cut = _insert(gm, p, narrow_sequence, degree, after=p, users=users)
        status[cut], level[cut] = R, level[p] + 1
        infos[cut.name] = infos[p.name]
        marked.add(cut)
        grad_sum.add(p.name)
    for n in list(g.nodes):   # a replicated op reading a slice runs on slices
        if n not in marked and status.get(n) == R and n.op not in ("get_attr", "placeholder") \
                and any(a in marked for a in n.all_input_nodes):
            if _reads_size(n):   # a size: the whole sequence's, as traced
                _whole_sizes(gm, n, marked, status, level, reg)
                continue
            if not _token_by_token(gm, n, infos, reg) or _joins_own_part(n, marked, level, infos):
                _gather_before(gm, n, marked, status, level, infos, reg)   # laid back whole
                continue
            _cut_whole_inputs(gm, n, marked, status, level, infos, grad_sum, reg)
            marked.add(n)
    _functional_modules(gm, marked, status, level, infos)
    _pad_for_sharded(gm, marked, status, level, infos, grad_sum, reg)
    _exits(gm, marked, status, level, infos, keep, reg)
    prologue = _alias_params(gm, marked, status, level, infos, grad_sum, reg) or before
    if prologue:   # a part of its own before the first, for the aliases it makes
        for n in level:
            level[n] += 1
    outs = next(n for n in g.nodes if n.op == "output").args[0]
    sliced_out = {v for v, a in zip(reg.outputs, outs, strict=True) if a in marked}
    # a padded slice is all-gathered; a value read only as this device's slice, scattered
    sums = {n.name: Op.ALL_GATHER if n.target is pad_sequence else Op.REDUCE_SCATTER
            for n in g.nodes if n.target is pad_sequence or (n.op != "placeholder" and n.users
                                    and all(u.target is narrow_sequence for u in n.users))}
    g.lint()
    gm.recompile()
    return SeqCut({n.name for n in marked}, grad_sum, sliced_out, sums)


def _stream(i: Info | None, seq: int) -> bool:
    return i is not None and i.shape is not None and len(i.shape) > SEQ_DIM \
        and i.shape[SEQ_DIM] == seq


def _insert(gm, x: fx.Node, fn, degree: int, after: fx.Node, users: list) -> fx.Node:
    g = gm.graph
    with g.inserting_after(after):
        rank = tp_rank(gm)
    with g.inserting_after(rank):
        made = g.call_function(fn, (x, degree, rank))
    for u in users:
        u.replace_input_with(x, made)
    return made


def _reads_size(n: fx.Node) -> bool:
    """`x.size()`, `x.size(1)`, `x.shape`, `aten.sym_size`: an op reading a tensor's sizes."""
    if n.op == "call_method":
        return n.target in ("size", "dim")
    if n.op == "call_function" and n.target is getattr:
        return len(n.args) > 1 and n.args[1] in ("shape", "ndim")
    return n.op == "call_function" and n.target in _SIZES


def _whole_sizes(gm, n: fx.Node, marked: set, status: dict, level: dict, reg: _Region) -> None:
    """A size read of a slice (`x.size(1)`, `x.shape`) reads the whole sequence's, which
    the sharded parts use as the model wrote it and `tp.shapes` divides on slices."""
    for a in [a for a in n.all_input_nodes if a in marked]:
        with gm.graph.inserting_before(n):
            whole = gm.graph.call_function(whole_like, (a, reg.degree))
        status[whole], level[whole] = R, level[a]
        n.replace_input_with(a, whole)


def _functional_modules(gm, marked: set, status: dict, level: dict, infos: dict) -> None:
    """A module with trained parameters called on slices (a LayerNorm, an RMSNorm) reads
    them as values of the graph, so that `_alias_params` can route them."""
    g = gm.graph
    for n in [n for n in g.nodes if n in marked and n.op == "call_module"]:
        mod = gm.get_submodule(str(n.target))
        names = tuple(k for k, p in mod.named_parameters() if p.requires_grad)
        if not names:
            continue
        with g.inserting_before(n):
            owner = g.get_attr(str(n.target))
            params = [g.get_attr(f"{n.target}.{k}") for k in names]
            new = g.call_function(with_params, (owner, names, tuple(n.args), dict(n.kwargs),
                                                *params))
        for a in (owner, *params):
            status[a], level[a] = R, level[n]
        status[new], level[new] = status[n], level[n]
        infos[new.name] = infos.get(n.name, Info(True, True))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        marked.discard(n)
        marked.add(new)
        g.erase_node(n)


def _joins_own_part(n: fx.Node, marked: set, level: dict, infos: dict) -> bool:
    """Whether `n` would join to slices a whole value needing a gradient that its own part
    makes (or that enters the region whole): that gradient, each device's share, would have
    no sum on its way back, so `n` takes the whole sequence instead."""
    for a in n.all_input_nodes:
        i = infos.get(a.name)
        if a not in marked and a.op != "get_attr" and i is not None and i.grad and (
                a.op == "placeholder" or level.get(a) == level[n]):
            return True
    return False


def _cut_whole_inputs(gm, n, marked, status, level, infos, grad_sum, reg: _Region) -> None:
    """A whole sequence made in an earlier part (the embeddings' sum, before the first
    layer), or one needing no gradient (positions), joined to slices is cut there; the
    gradient of the first, each device's slice, is summed on its way back to its part."""
    for a in list(dict.fromkeys(n.all_input_nodes)):
        i = infos.get(a.name)
        if a in marked or a.op == "get_attr" or status.get(a) not in (R, None) \
                or not _stream(i, reg.seq):
            continue
        cut = _insert(gm, a, narrow_sequence, reg.degree, after=a, users=[n])
        status[cut], level[cut] = R, level[n]
        infos[cut.name] = i
        marked.add(cut)
        if i.grad:
            grad_sum.add(a.name)


def _token_by_token(gm, n: fx.Node, infos: dict, reg: _Region) -> bool:
    """Whether op `n` can run on slices: it keeps the sequence where it was (its output is
    [batch, sequence, ...]), reduces over no token and mixes none (an attention product)."""
    if n.target in _MIXING or not _stream(infos.get(n.name), reg.seq):
        return False
    target, at = op_target(n) if n.op == "call_function" else (n.target, 0)
    x = n.args[at] if len(n.args) > at else None
    shape = infos[x.name].shape if isinstance(x, fx.Node) and x.name in infos else None
    return shape is None or SEQ_DIM not in reduced_dims(gm, n, len(shape), target, at)


def _gather_before(gm, n: fx.Node, marked: set, status, level, infos, reg: _Region) -> None:
    """Op `n` needs the whole sequence (a loss's mean, a flattening of batch and sequence,
    attention outside the sharded layers): its slices are laid back whole (padded, then
    summed) in its part, and `n` with what follows it there moves to a new part after."""
    k = level[n]
    moved, todo = set(), [n]
    while todo:
        u = todo.pop()
        if u not in moved and level.get(u) == k:
            moved.add(u)
            todo.extend(u.users)
    for m in level:
        if level[m] > k:
            level[m] += 1
    for m in moved:
        level[m] = k + 1
    for a in [a for a in dict.fromkeys(n.all_input_nodes) if a in marked]:
        pad = _insert(gm, a, pad_sequence, reg.degree, after=a, users=[n])
        status[pad], level[pad] = P, k
        i = infos.get(a.name, Info(True, True))
        infos[pad.name] = Info(True, i.grad, _whole(i.shape, reg), i.floating)


def _pad_for_sharded(gm, marked, status, level, infos, grad_sum, reg: _Region) -> None:
    """A slice a sharded part reads is padded in the part before and summed (all-gathered)."""
    for n in [n for n in gm.graph.nodes if n in marked]:
        by_part: dict[int, list] = {}
        for u in n.users:
            if status.get(u) == S:
                by_part.setdefault(level[u], []).append(u)
        for part, users in sorted(by_part.items()):
            pad = _insert(gm, n, pad_sequence, reg.degree, after=n, users=users)
            status[pad], level[pad] = P, part - 1
            i = infos.get(n.name, Info(True, True))
            infos[pad.name] = Info(True, i.grad, _whole(i.shape, reg))
            if i.grad:
                grad_sum.add(pad.name)


def _whole(shape, reg: _Region):
    return None if shape is None else (*shape[:SEQ_DIM], reg.seq, *shape[SEQ_DIM + 1:])


def _exits(gm, marked, status, level, infos, keep: set, reg: _Region) -> None:
    """A slice leaving for a region that takes the whole sequence is padded, summed and
    handed on through an alias in a part after (as `parts.close_partials`)."""
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    for v, a in zip(reg.outputs, list(out.args[0]), strict=True):
        if a not in marked or v in keep:
            continue
        pad = _insert(gm, a, pad_sequence, reg.degree, after=a, users=[])
        status[pad], level[pad] = P, level[a]
        i = infos.get(a.name, Info(True, True))
        infos[pad.name] = Info(True, i.grad, _whole(i.shape, reg))
        with g.inserting_before(out):
            al = g.call_function(_ALIAS, (pad,))
        status[al], level[al] = R, level[a] + 1
        infos[al.name] = infos[pad.name]
        out.replace_input_with(a, al) if list(out.args[0]).count(a) == 1 else \
            _replace_output(out, v, reg, al)


def _replace_output(out: fx.Node, v: str, reg: _Region, new: fx.Node) -> None:
    args = list(out.args[0])
    args[reg.outputs.index(v)] = new
    out.args = (type(out.args[0])(args),)


def _alias_params(gm, marked, status, level, infos, grad_sum, reg: _Region) -> bool:
    """A value needing a gradient that ops on slices read whole (a norm's weight, a value
    an earlier part made) is read through an alias (a parameter's copy) made a part before,
    whose gradient share the group sums; -> whether an alias needs a part before the first."""
    g, prologue = gm.graph, False
    for n in list(g.nodes):
        users = [u for u in n.users if u in marked and u.target is not narrow_sequence]
        if n in marked or status.get(n) != R or not users or not _needs_grad(gm, n, infos):
            continue
        part = min(level[u] for u in users) - 1   # a value: made before (`_joins_own_part`)
        prologue |= part < 0
        with g.inserting_after(n):
            al = g.call_function(_CLONE if n.op == "get_attr" else _ALIAS, (n,))
        status[al], level[al] = R, part
        infos[al.name] = Info(True, True)
        for u in users:
            u.replace_input_with(n, al)
        grad_sum.add(al.name)
    return prologue


def _needs_grad(gm, n: fx.Node, infos: dict) -> bool:
    if n.op == "get_attr":
        try:
            return gm.get_parameter(str(n.target)).requires_grad
        except AttributeError:
            return False
    i = infos.get(n.name)
    return i is not None and bool(i.grad)
