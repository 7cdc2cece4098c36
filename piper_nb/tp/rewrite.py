"""Tensor parallelism on a captured model: each sharded region cut into *parts* between its
collectives, and its linear layers' (and `vocab` embeddings', `tp.vocab`) weights
into per-device shards (Megatron's f and g, found in the graph of the model as the user
has it).

In a sharded region every op gets a status: *sharded* (it reads a colwise layer's output:
each device computes its own share, attention on its own heads), *partial* (a rowwise
layer's output: each device's share of a sum) or *replicated* (everything else: every
device computes the same). Parts alternate replicated, sharded, replicated, ... : part
`2k+1` runs from the colwise layers to the rowwise ones, and a partial value leaving it is
all-reduced before a later part reads it (g: the forward all-reduce). A replicated value
that requires a gradient and enters a sharded part goes through an alias of its own made
in the part before, whose gradient, a per-device share, is all-reduced in the backward (f:
the backward all-reduce); a replicated parameter read inside a sharded part (Qwen3's
per-head norms) takes the same path. Each part is a region of the new capture, tagged
`PART=k`, so the passes, the runtime and the simulator treat it as any other region; the
collectives between parts are placed by the `tensor_parallel` directive's pass.

The captured model's sharded parameters become views of device 0's shard (`local_shard`),
so shapes, buckets and memory are computed for a device's share; `Capture.tp` records how
each is cut, for the workers (which cut their own from the whole) and for gathering the
trained weights back.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from piper_nb.capture.meta_routing import on_meta
from piper_nb.capture.region_code import own_copy, param_aliases
from piper_nb.capture.untouched import untouched
from piper_nb.errors import PlanError
from piper_nb.ir.filters import matches
from piper_nb.ir.kinds import Op
from piper_nb.tp.checks import check_heads, check_readers, check_tied
from piper_nb.tp.dropout import shard_dropouts
from piper_nb.tp.fused import Origin
from piper_nb.tp.loss import feeds_only_loss, loss_readers, parallel_cross_entropy
from piper_nb.tp.match import SHARDABLE, check_types, nothing_sharded
from piper_nb.tp.parts import (
    PART,
    Cut,
    Info,
    P,
    S,
    build_parts,
    close_partials,
    levels,
    route_aliases,
)
from piper_nb.tp.sequence import SeqPlan
from piper_nb.tp.shapes import localize
from piper_nb.tp.shards import join_shards, local_shard
from piper_nb.tp.styles import Sharding, Style, style_of
from piper_nb.tp.vocab import EMBEDDING, gathered_output, vocab_embedding

__all__ = ["PART", "TPRequest", "TPLayout", "shard_capture", "local_shard", "join_shards"]

_LINEAR = torch.ops.aten.linear.default
_ADD = torch.ops.aten.add.Tensor

@dataclass(frozen=True)
class TPRequest:
    """One `tensor_parallel` directive as the capture needs it."""

    filter: Mapping
    degree: int
    plan: Mapping[str, str]
    directive: int = -1
    sequence_parallel: bool = False


@dataclass(frozen=True)
class TPLayout:
    """What sharding a capture changed: per sharded parameter (dim, degree, blocks); the
    values summed over the group after a forward (partial sums) and those whose gradients
    are summed (the inputs of sharded parts); per part region its original region and
    part number; per original region its degree; the regions run sequence-parallel
    (`tp.sequence`) and the kind of each of their sums that is not an all-reduce."""

    params: Mapping[str, tuple[int, int, int]]
    partial: frozenset[str]
    grad_sum: frozenset[str]
    parts: Mapping[int, tuple[int, int]]
    degree: Mapping[int, int]
    sequence: frozenset[int] = frozenset()
    sums: Mapping[str, Op] = dataclasses.field(default_factory=dict)   # SP: value -> AG/RS


def shard_capture(capture, requests: list[TPRequest], batch: dict):
    """`capture` with the regions the requests select cut into parts and their linear layers
    sharded; the capture itself when nothing is sharded."""
    chosen = _choose(capture, requests)
    if not chosen:
        return capture
    check_heads(capture.model, chosen, capture.regions)
    by_request = _regions_of(capture, chosen)
    for req, mine in by_request:
        check_types(capture.model, req.plan, [p for r in mine for p in r.modules], req.directive)
    infos = on_meta(any(t.is_meta for t in batch.values()), _node_infos, capture,
                    set(chosen), batch)
    aliases = param_aliases(capture.model)
    regions, modules, parts, degree = [], [], {}, {}
    params: dict[str, tuple[int, int, int]] = {}
    local: dict[str, nn.Parameter] = {}   # device 0's shard of each sharded parameter
    partial, grad_sum, sums = set(), set(), {}
    names = {v for r in capture.regions for v in (*r.inputs, *r.outputs)}
    cut_of: dict[int, dict] = {}   # region -> the parameters its cut shards
    seq = SeqPlan(capture, {r: q for r, q in chosen.items()
                            if _linears(capture.modules[r], q.plan)}, batch)
    for info, gm in zip(capture.regions, capture.modules, strict=True):
        req = chosen.get(info.index)
        cut = _cut(gm, info, req, infos.get(info.index), names, aliases,
                   capture.model, seq) if req else None
        cut_of[info.index] = cut.params if cut is not None else {}
        if cut is None:
            seq.check_whole(info)
            regions.append(dataclasses.replace(info, index=len(regions)))
            modules.append(gm)
            continue
        degree[info.index] = req.degree
        names |= {v for pinfo, _ in cut.parts for v in (*pinfo.inputs, *pinfo.outputs)}
        params.update(cut.params)
        local.update(cut.local)
        partial |= cut.partial
        grad_sum |= cut.grad_sum
        sums |= cut.sums
        for k, (pinfo, pgm) in enumerate(cut.parts):
            parts[len(regions)] = (info.index, k)
            regions.append(dataclasses.replace(pinfo, index=len(regions)))
            modules.append(pgm)
    for req, mine in by_request:
        if not any(cut_of[r.index] for r in mine):
            linears = [p for r in mine for p in r.modules
                       if isinstance(capture.model.get_submodule(p), SHARDABLE)]
            raise nothing_sharded(req.plan, mine, linears, req.directive)
    check_readers(capture.regions, cut_of, params, aliases)
    for gm in modules:
        _bind_local(gm, local, aliases)
    return capture.with_regions(regions, modules, tp_local=local, tp=TPLayout(
        params, frozenset(partial), frozenset(grad_sum), parts, degree, frozenset(seq.regions),
        sums))


def _choose(capture, requests: list[TPRequest]) -> dict[int, TPRequest]:
    chosen: dict[int, TPRequest] = {}
    for req in requests:
        hits = [r for r in capture.regions if matches(req.filter, dict(r.tags))]
        if not hits:
            raise PlanError(f"tensor_parallel: filter {dict(req.filter)} matches no region; "
                            "regions are " + ", ".join(r.name for r in capture.regions),
                            directive=req.directive, op="tensor_parallel")
        for r in hits:
            if r.index in chosen and chosen[r.index].degree != req.degree:
                raise PlanError(f"tensor_parallel: region {r.name} is given two degrees, "
                                f"{chosen[r.index].degree} and {req.degree}; give it one",
                                directive=req.directive, op="tensor_parallel")
            chosen[r.index] = req
    return {r: q for r, q in chosen.items() if q.degree > 1}


def _regions_of(capture, chosen: dict[int, TPRequest]) -> list[tuple[TPRequest, list]]:
    """Each chosen request with the regions it shards."""
    out: dict[int, tuple[TPRequest, list]] = {}
    for r in capture.regions:
        if r.index in chosen:
            out.setdefault(id(chosen[r.index]), (chosen[r.index], []))[1].append(r)
    return list(out.values())


def _node_infos(capture, wanted: set[int], batch: dict) -> dict[int, tuple[dict, list]]:
    """Per chosen region: per node name what one run of the regions on the batch records
    (`Info`), and the region's inputs in that run."""
    vals = dict(batch)
    out: dict[int, tuple[dict, list]] = {}
    with untouched(capture.model):
        for info, gm in zip(capture.regions, capture.modules, strict=True):
            args = [vals[v].detach().requires_grad_(True)
                    if v not in batch and vals[v].is_floating_point() else vals[v]
                    for v in info.inputs]
            if info.index in wanted:
                seen: dict[str, Info] = {}
                outs = _Recorder(gm, seen).run(*args)
                out[info.index] = (seen, args)
            else:
                outs = gm(*args)
            vals.update(zip(info.outputs, outs, strict=True))
    return out


class _Recorder(fx.Interpreter):
    def __init__(self, gm, seen):
        super().__init__(gm)
        self.seen = seen

    def run_node(self, n):
        v = super().run_node(n)
        t = isinstance(v, torch.Tensor)
        self.seen[n.name] = Info(t, t and v.is_floating_point() and v.requires_grad,
                                 tuple(v.shape) if t else None, t and v.is_floating_point())
        return v


def _linears(gm: fx.GraphModule, plan: Mapping[str, str]) -> list[tuple[fx.Node, str, Sharding]]:
    """The linear layers and embeddings the plan shards: (node, module path, sharding)."""
    found = []
    for n in gm.graph.nodes:
        path, embedding = _layer(gm, n)
        if path is None:
            continue
        sharding = style_of(plan, path.removeprefix("model."))
        if sharding is None or sharding.style == Style.REPLICATE:
            continue
        if embedding and sharding.style != Style.VOCAB:
            raise PlanError(f"tensor_parallel: {path.removeprefix('model.')} is an embedding, "
                            f"which takes vocab or replicate, not {sharding.style}")
        found.append((n, path, sharding))
    return found


def _layer(gm: fx.GraphModule, n: fx.Node) -> tuple[str | None, bool]:
    """(module path, is an embedding) of a linear layer or embedding op, else (None, False)."""
    if n.op == "call_module":
        mod = gm.get_submodule(str(n.target))
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            return str(n.target), isinstance(mod, nn.Embedding)
        return None, False
    if n.op != "call_function" or n.target not in (_LINEAR, F.linear, EMBEDDING, F.embedding):
        return None, False
    embedding = n.target in (EMBEDDING, F.embedding)
    w = n.args[0 if n.target == EMBEDDING else 1] if len(n.args) > 1 else None
    if isinstance(w, fx.Node) and w.op == "get_attr" and str(w.target).endswith(".weight"):
        return str(w.target)[:-len(".weight")], embedding
    return None, False


def _normalize(gm, n: fx.Node, path: str, style: Style, infos: dict) -> tuple[fx.Node, str, str]:
    """Rewrite a sharded linear as `aten.linear(x, w[, b])` on parameters read by get_attr
    (a rowwise one without its bias, added after: once, not once per device)."""
    g = gm.graph
    x = n.args[0]
    if n.op == "call_module":
        bias = f"{path}.bias" if gm.get_submodule(path).bias is not None else None
    else:
        b = n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
        bias = str(b.target) if isinstance(b, fx.Node) else None
    with g.inserting_before(n):
        w = g.get_attr(f"{path}.weight")
        bn = g.get_attr(bias) if bias else None
        if style == Style.ROWWISE:
            lin = g.call_function(_LINEAR, (x, w))
            out = g.call_function(_ADD, (lin, bn)) if bn is not None else lin
        else:
            lin = out = g.call_function(_LINEAR, (x, w, bn) if bn is not None else (x, w))
    for made in {lin, out}:
        infos[made.name] = infos.get(n.name, Info(True, True))
    n.replace_all_uses_with(out)
    g.erase_node(n)
    for dead in [a for a in g.nodes if a.op == "get_attr" and not a.users]:
        g.erase_node(dead)
    return lin, f"{path}.weight", bias


def _cut(gm0, info, req: TPRequest, recorded: tuple, names: set, aliases: dict,
         model: nn.Module, seq: SeqPlan) -> Cut | None:
    found = _linears(gm0, req.plan)
    if not found:
        return None
    infos, args = recorded
    gm = own_copy(gm0)   # the capture's own stays as it was
    found = [(m, p, s) for (n, p, s) in found for m in gm.graph.nodes if m.name == n.name]
    col, row, params, origins, streams = set(), set(), {}, {}, set()
    for n, path, sh in found:
        if _layer(gm, n)[1]:   # an embedding (vocab)
            look, out, weight = vocab_embedding(gm, n, path, gm0, req.degree, infos)
            params[aliases.get(weight.removeprefix("model."), weight.removeprefix("model."))] = \
                _split(gm0.get_parameter(weight), sh, req.degree, path, info)
            col.add(look)
            row.add(out)
            streams.add(out)
            continue
        lin, weight, bias = _normalize(gm, n, path, sh.style, infos)
        if sh.style == Style.COLWISE and not sh.gather:
            origins[lin.name] = Origin(path.removeprefix("model."), sh.blocks)
        params[aliases.get(weight.removeprefix("model."), weight.removeprefix("model."))] = \
            _split(gm0.get_parameter(weight), sh, req.degree, path, info)
        if sh.style in (Style.COLWISE, Style.VOCAB):   # vocab: an LM head, for its loss
            col.add(lin)
            if sh.style == Style.VOCAB and not feeds_only_loss(gm, lin, infos):
                raise PlanError(f"tensor_parallel: {path.removeprefix('model.')} (vocab) is a "
                                "linear layer whose output reaches more than a cross-entropy's "
                                "logits; a vocab-parallel LM head needs its logits used only "
                                "by the loss: use colwise_gather_output to gather them")
            if sh.gather and not feeds_only_loss(gm, lin, infos):   # else: a vocab-parallel loss
                row.add(gathered_output(gm, lin, req.degree, infos))
            if bias:
                params[aliases.get(bias.removeprefix("model."), bias.removeprefix("model."))] = \
                    (0, req.degree, sh.blocks)
        else:
            row.add(lin)
            streams.add(lin)
    for ce in loss_readers(gm, col, row):
        row.add(parallel_cross_entropy(gm, ce, req.degree, infos, f"region {info.name}"))
    check_tied(params, aliases, req.plan, info)
    status, level = levels(gm, col, row, info)
    close_partials(gm, status, level, infos)
    on_slices = seq.shard(gm, info, req, status, level, infos, streams)
    # a sharded weight by any of its names (a tied LM head's is the embedding's)
    sharded = set(params) | {n for n, p in aliases.items() if p in params}
    grad_sum = route_aliases(gm, status, level, infos, sharded) | on_slices.grad_sum
    local = {n: _local_param(model.get_parameter(n), *params[n]) for n in params}
    before = set(gm.graph.nodes)
    full = {k: i.shape for k, i in infos.items()}
    dims = localize(gm, seq.args(info, args), full,
                    {n.name for n in gm.graph.nodes if status.get(n) in (S, P)} | on_slices.seq,
                    req.degree, {f"model.{n}": p for n, p in local.items()},
                    f"region {info.name}", origins, on_slices.seq)
    by_name = {n.name: n for n in gm.graph.nodes}
    made = shard_dropouts(gm, {n.name for n in gm.graph.nodes if status.get(n) == S}
                          | on_slices.seq, dims, full, req.degree, f"region {info.name}")
    for n, was in made.items():   # the sharded dropouts and their rank: the dropout's part
        status[n], level[n] = status[by_name[was]], level[by_name[was]]
        infos[n.name] = infos[was] if n.op != "get_attr" else Info(True, False)
    for n in gm.graph.nodes:   # what localize added (sizes divided, caches cut): its user's part
        if n not in before and n not in status:
            user = next(u for u in n.users if u in status)
            status[n], level[n] = status[user], level[user]
            infos[n.name] = Info(n.target is not operator.floordiv, False)
    return dataclasses.replace(
        build_parts(gm, info, status, level, infos, names, grad_sum, params, aliases,
                    on_slices.sums),
        local=local)


def _split(w: torch.Tensor, sh: Sharding, degree: int, path: str, info) -> tuple:
    dim = sh.dim
    size = w.shape[dim]
    if size % (degree * sh.blocks):
        what = "output" if dim == 0 else "input"
        blocks = f" in {sh.blocks} blocks" if sh.blocks > 1 else ""
        raise PlanError(f"tensor_parallel: {path.removeprefix('model.')} ({sh.style}) has "
                        f"{size} {what} features{blocks}, which {degree} devices cannot divide "
                        f"(region {info.name}); use a degree that divides {size // sh.blocks}")
    return (dim, degree, sh.blocks)


def _local_param(p: nn.Parameter, dim: int, degree: int, blocks: int) -> nn.Parameter:
    return nn.Parameter(local_shard(p.detach(), dim, degree, blocks, 0), requires_grad=p.requires_grad)


def _bind_local(gm: fx.GraphModule, local: dict, aliases: dict) -> None:
    """Point a part's get_attr of each sharded parameter at device 0's shard (in the part's
    own module tree, never the user's)."""
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        name = str(n.target).removeprefix("model.")
        name = aliases.get(name, name)
        if name in local:
            owner, _, leaf = str(n.target).rpartition(".")
            setattr(gm.get_submodule(owner), leaf, local[name])
