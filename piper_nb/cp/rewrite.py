"""Context parallelism on a captured model: every region run on each device's share of the
sequence, its attention over the whole sequence (ring attention), its positions global.

A region cut over a context group of `degree` devices runs on each device's tokens
(`capture.ring_attention.positions`: chunks `r` and `2 x degree - 1 - r` under `zigzag`).
Three things in its graph would see only those tokens, and are rewritten:

- **positions**: an `arange` over the sequence (the positions a learned embedding looks
  up, the angles of rotary embeddings) gives this device's global positions instead
  (`context_arange`). Which aranges count the sequence is found by running the regions
  on the whole sequence and on half of it: those whose length follows the sequence's, or
  (torch.export writes lengths down) a constant one of the whole sequence's length;
- **sizes** a graph wrote down for the whole sequence (torch.export's `view(x, [B, 16, 4,
  8])`) are made the share's (`tp.localize`, as tensor parallelism does for heads);
- **attention**: `scaled_dot_product_attention(q, k, v)` becomes `ring_attention` over
  every member's keys and values. Each device's keys and values are laid at its place in
  zeros of the whole (`pad_sequence`, on [batch, tokens, heads, dim]), and the region is
  cut there into *parts* (`PART=k`, as tensor parallelism cuts, `tp.parts`): between them
  the group all-gathers those values, and in the backward reduce-scatters their gradients'
  shares, so each member gets the sum of every member's gradient for its own keys and
  values. The collectives are the plan's instructions (`cp.directive`);
- **what cannot be cut** is a PlanError before anything runs: an attention with a mask
  tensor, with dropout, or not written as `scaled_dot_product_attention`; a sequence the
  load balance cannot cut.

Everything else (embeddings, norms, the MLP, the loss) runs on the share as written, but
dropout: each device draws the whole sequence's mask, as one process does from the same
generator state, and applies its chunks of it (`cp.dropout`); another random op is a
PlanError. The loss of a share is its mean; the plan averages the members'
(`Plan.loss_scale`), which is the whole sequence's mean when every member counts the same
tokens (a step whose shares count ignored labels unevenly is stopped: `cp.labels`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.fx as fx

from piper_nb.capture.meta_routing import on_meta
from piper_nb.capture.region_code import own_copy, param_aliases
from piper_nb.capture.ring_attention import (
    check_length,
    context_arange,
    ring_attention,
    take_share,
)
from piper_nb.capture.sequence_ops import SEQ_DIM, pad_sequence
from piper_nb.capture.untouched import untouched
from piper_nb.cp import ring
from piper_nb.cp.attention import attentions, causal_mask, mask_input, refused
from piper_nb.cp.dropout import share_dropouts
from piper_nb.cp.mixing import check_mixing, loss_values
from piper_nb.cp.regions import drop_unread, origins_of, prune
from piper_nb.errors import PlanError
from piper_nb.ir.filters import freeze_tags
from piper_nb.ir.kinds import Op
from piper_nb.tp import PART, PARTIAL, REPLICATED, Info, build_parts, localize

__all__ = ["CP_RANK", "CPLayout", "cut_capture", "sequence_inputs", "sequence_length",
           "share_batch"]

CP_RANK = "_pn_cp_rank"   # a part's own rank in its context group, set by each worker
_ARANGE = {torch.arange, torch.ops.aten.arange.default, torch.ops.aten.arange.start,
           torch.ops.aten.arange.start_step}
_T = torch.transpose


@dataclass(frozen=True)
class CPLayout:
    """What cutting over a context changed: the degree and load balance, the whole
    sequence's length, the batch inputs cut along it, per part region its original region
    and part number, the values all-gathered after a forward and those whose gradients'
    shares are reduce-scattered; how keys and values go round (`rotate`) and, for the
    point-to-point ring, each value it delivers -> the value it is sent from (`cp.ring`)."""

    degree: int
    balance: str
    seq: int
    inputs: frozenset[str]
    parts: Mapping[int, tuple[int, int]]
    gathered: frozenset[str]
    grad_sum: frozenset[str]
    directive: int = -1
    rotate: str = "all_gather"
    rotations: Mapping[str, str] = dataclasses.field(default_factory=dict)


def sequence_length(batch: Mapping[str, torch.Tensor]) -> int | None:
    """The sequence's length: dimension 1 of the first input with two or more (None
    without one)."""
    return next((t.shape[SEQ_DIM] for t in batch.values()
                 if isinstance(t, torch.Tensor) and t.dim() > SEQ_DIM), None)


def sequence_inputs(batch: Mapping[str, torch.Tensor]) -> tuple[int, frozenset[str]]:
    """(the sequence's length, the batch inputs that hold it): `sequence_length`, and every
    input with that length there."""
    seq = sequence_length(batch)
    if seq is None:
        raise PlanError("context_parallel needs inputs of [batch, sequence, ...]; the batch "
                        "has " + ", ".join(f"{k} {list(t.shape)}" for k, t in batch.items()))
    return seq, frozenset(k for k, t in batch.items()
                          if t.dim() > SEQ_DIM and t.shape[SEQ_DIM] == seq)


def share_batch(batch: Mapping[str, torch.Tensor], layout: CPLayout, rank: int = 0) -> dict:
    """Device `rank`'s share of the batch: its tokens of every input that holds the
    sequence."""
    return {k: take_share(t, layout.degree, rank, layout.balance) if k in layout.inputs else t
            for k, t in batch.items()}


def cut_capture(capture, degree: int, balance: str, directive: int, batch: Mapping,
                rotate: str = "all_gather"):
    """`capture` with every region cut over a context of `degree` devices (see the module
    docstring; `rotate="p2p"`: the point-to-point ring, `cp.ring`)."""
    seq, inputs = sequence_inputs(batch)
    need = check_length(seq, degree, balance)
    if need:
        raise PlanError(f"context_parallel: load_balance={balance!r} cuts the sequence of "
                        f"{seq} tokens into {need} chunks ({degree} devices), which do not "
                        f"divide it; pad the sequence to {-(-seq // need) * need} tokens, or "
                        "use a degree whose chunks divide it", directive=directive,
                        op="context_parallel")
    layout = CPLayout(degree, balance, seq, inputs, {}, frozenset(), frozenset(), directive,
                      rotate)
    masks = set()   # what cannot be rewritten is said before any run; masks are read in it
    for info, gm in zip(capture.regions, capture.modules, strict=True):
        masks |= {m.name for a in attentions(gm, info) if (m := mask_input(a)) is not None}
        _check_no_shift(gm, info, inputs)
    meta = any(t.is_meta for t in batch.values())
    wholes = on_meta(meta, _wholes, capture, batch, inputs, seq, masks)
    share = share_batch(batch, layout)
    vals = dict(share)
    names = {v for r in capture.regions for v in (*r.inputs, *r.outputs)}
    canonical = param_aliases(capture.model)
    regions, modules, parts = [], [], {}
    gathered, grad_sum, rotations = set(), set(), {}
    to_loss = loss_values(capture.regions, capture.modules)
    origins, count, tp_parts = origins_of(capture), Counter(), {}
    rewritten = []
    for info, gm0 in zip(capture.regions, capture.modules, strict=True):
        full, traced, constant, values = wholes[info.index]
        gm = own_copy(gm0)
        _global_positions(gm, traced, constant, layout)
        rewritten.append((gm, _ring_attention(gm, info, layout, values, full)))
    kept = drop_unread(capture, [gm for gm, _ in rewritten])
    for info, (gm, (pads, ghosts, firsts)) in zip(kept, rewritten, strict=True):
        full = wholes[info.index][0]
        args = _args(info, vals, share)
        cut_at = on_meta(meta, localize, gm, args, full, {n.name for n in gm.graph.nodes},
                         degree, {}, f"region {info.name}", op="context_parallel")
        infos, outs = on_meta(meta, _share_run, gm, info, args, share)
        check_mixing(gm, info, cut_at, {k: i.shape for k, i in infos.items()}, to_loss)
        if share_dropouts(gm, info, layout, full, infos, partial(_rank, gm)):   # run again:
            infos, outs = on_meta(meta, _share_run, gm, info, args, share)
        vals.update(zip(info.outputs, outs, strict=True))
        status = {n: PARTIAL if n in pads else REPLICATED for n in gm.graph.nodes}
        cut = build_parts(gm, info, status, ring.levels(gm, pads, ghosts, firsts), infos,
                          names, {p.name for p in pads if infos[p.name].grad}, {}, canonical,
                          {p.name: Op.ALL_GATHER for p in pads}, ghosts)
        gathered |= cut.partial
        grad_sum |= cut.grad_sum
        rotations.update(cut.ghosts)
        origin, tp_part = origins[info.index]
        for pinfo, pgm in cut.parts:
            names |= {*pinfo.inputs, *pinfo.outputs}
            k = count[origin]   # numbered over the region it was cut from (TP's parts too)
            count[origin] += 1
            parts[len(regions)] = (origin, k)
            if tp_part is not None:
                tp_parts[len(regions)] = (origin, k)
            regions.append(dataclasses.replace(
                pinfo, index=len(regions), tags=freeze_tags({**dict(pinfo.tags), PART: k}),
                context=(degree, balance, tuple(sorted(inputs & set(pinfo.inputs))))))
            modules.append(pgm)
    layout = dataclasses.replace(layout, parts=parts, gathered=frozenset(gathered),
                                 grad_sum=frozenset(grad_sum), rotations=rotations)
    tp = capture.tp and dataclasses.replace(capture.tp, parts=tp_parts)
    return capture.with_regions(regions, modules, cp=layout, tp=tp)


_SHIFTS = {torch.ops.aten.pad.default, torch.ops.aten.constant_pad_nd.default,
           torch.nn.functional.pad, torch.roll, torch.ops.aten.roll.default, "roll"}


def _check_no_shift(gm, info, inputs: frozenset) -> None:
    """A batch input cut along the sequence must not be shifted along it (a causal LM's
    `labels[..., 1:]`): each device would shift its own share, and the tokens at its
    chunks' edges would get the wrong labels."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for ph, name in zip(phs, info.inputs, strict=True):
        if name not in inputs:
            continue
        for u in ph.users:
            if u.target in _SHIFTS or _slices_after_first(u):
                raise PlanError(
                    f"context_parallel: region {info.name} shifts the batch's {name} along "
                    f"the sequence at {u.name} ({u.format_node()}): each device would shift "
                    "its own share, and the tokens at its chunks' edges would read the wrong "
                    "ones; pass it shifted already (Hugging Face: the batch's shift_labels, "
                    "the labels moved one left with -100 last, as torchtitan's loader does)",
                    op="context_parallel")


def _slices_after_first(n: fx.Node) -> bool:
    """A slice of the sequence not from its first token (`x[:, 1:]`, `aten.slice(x, 1, 1)`)."""
    if n.target is torch.ops.aten.slice.Tensor:
        return len(n.args) > 2 and n.args[1] not in (0,) and n.args[2] not in (0, None)
    if n.target is operator.getitem and isinstance(n.args[1], tuple):
        return any(isinstance(s, slice) and s.start not in (0, None)
                   for s in n.args[1][1:]) or (n.args[1] and n.args[1][0] is Ellipsis and any(
                       isinstance(s, slice) and s.start not in (0, None) for s in n.args[1]))
    return False


class _Recorder(fx.Interpreter):
    """One run of a region, recording what each op made (`Info`), each arange's length and
    the values of the ops named `keep`."""

    def __init__(self, gm, keep: set = frozenset()):
        super().__init__(gm)
        self.seen, self.lengths, self.keep, self.values = {}, {}, keep, {}

    def run_node(self, n):
        v = super().run_node(n)
        t = isinstance(v, torch.Tensor)
        if n.name in self.keep:
            self.values[n.name] = v
        self.seen[n.name] = Info(t, t and v.is_floating_point() and v.requires_grad,
                                 tuple(v.shape) if t else None, t and v.is_floating_point())
        if n.op == "call_function" and n.target in _ARANGE and t:
            self.lengths[n.name] = v.numel()
        return v


def _wholes(capture, batch: Mapping, inputs: frozenset, seq: int, keep: set) -> dict:
    """Per region, from runs on the whole sequence: each op's shape, the aranges over the
    sequence (traced ones, whose length follows the sequence's on half of it; constant
    ones, written down at its length by torch.export) and the values of the ops `keep`
    names (masks)."""
    half = {k: t.narrow(SEQ_DIM, 0, seq // 2) if k in inputs else t for k, t in batch.items()}
    runs = _run(capture, batch, keep)
    try:   # a graph holding the sequence's length as a constant fails here: no traced arange
        halves = _run(capture, half, set())
    except Exception:   # noqa: BLE001
        halves = {}
    out = {}
    for r, rec in runs.items():
        gm = capture.modules[r]
        by_name = {n.name: n for n in gm.graph.nodes}
        half_lengths = halves[r].lengths if r in halves else {}
        traced = {n for n, k in rec.lengths.items() if k == seq and by_name[n].all_input_nodes
                  and half_lengths.get(n) == seq // 2}
        constant = {n for n, k in rec.lengths.items() if k == seq
                    and not by_name[n].all_input_nodes}
        out[r] = ({k: i.shape for k, i in rec.seen.items()}, traced, constant, rec.values)
    return out


def _run(capture, batch: Mapping, keep: set) -> dict[int, _Recorder]:
    vals, out = dict(batch), {}
    with untouched(capture.model):
        for info, gm in zip(capture.regions, capture.modules, strict=True):
            rec = _Recorder(gm, keep)
            outs = rec.run(*_args(info, vals, batch))
            out[info.index] = rec
            vals.update(zip(info.outputs, outs, strict=True))
    return out


def _args(info, vals: dict, batch: Mapping) -> list:
    """A region's inputs as its forward takes them: what another region made as a fresh
    leaf needing a gradient."""
    return [vals[v].detach().requires_grad_(True)
            if v not in batch and vals[v].is_floating_point() else vals[v]
            for v in info.inputs]


def _share_run(gm, info, args: list, share: Mapping) -> tuple[dict, tuple]:
    """The rewritten region run on a device's share: what each op made, and its outputs."""
    rec = _Recorder(gm)
    try:
        outs = rec.run(*args)
    except Exception as err:   # noqa: BLE001 - PyTorch's words, with where and what
        raise PlanError(
            f"context_parallel: region {info.name} fails on a device's share of the "
            f"sequence ({', '.join(f'{k} {list(t.shape)}' for k, t in share.items())}): "
            f"{type(err).__name__}: {str(err).splitlines()[0]}; compute its sizes from the "
            "tensors it reads, or capture the model with torch.fx",
            op="context_parallel") from err
    return rec.seen, outs


def _rank(gm) -> fx.Node:
    """A get_attr of the part's context rank buffer (made, as 0, on first use)."""
    if not hasattr(gm, CP_RANK):
        gm.register_buffer(CP_RANK, torch.tensor(0))
    return gm.graph.get_attr(CP_RANK)


def _global_positions(gm, traced: set, constant: set, layout: CPLayout) -> None:
    """Aranges over the sequence made this device's global positions: a traced one (its
    length the share's at run time) as `context_arange`, a constant one (the whole
    sequence's) cut to the device's share."""
    g = gm.graph
    for n in [n for n in g.nodes if n.name in traced | constant]:
        with g.inserting_before(n):
            rank = _rank(gm)
            if n.name in traced:
                new = g.call_function(context_arange, (layout.degree, rank, layout.balance,
                                                       *n.args), dict(n.kwargs))
            else:
                whole = g.call_function(n.target, n.args, dict(n.kwargs))
                new = g.call_function(take_share, (whole, layout.degree, rank,
                                                   layout.balance, 0))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
    g.lint()
    gm.recompile()


def _ring_attention(gm, info, layout: CPLayout, values: dict, full: dict) -> tuple:
    """Each attention made ring attention over the group's keys and values (see the module
    docstring; its whole shape recorded in `full` as the attention's); -> the padded keys
    and values, which the group gathers, or under the point-to-point ring the values it
    delivers and the first steps (`cp.ring.steps`). The mask it no longer reads goes."""
    g = gm.graph
    pads, ghosts, firsts = set(), {}, set()
    for att in attentions(gm, info):
        causal = att.causal
        mask = mask_input(att)
        if mask is not None:
            if not causal_mask(att, values[mask.name]):
                raise refused(info, att.mask, "its mask is not causal (a padding mask, a "
                              "sliding window), which context parallelism cannot cut; use "
                              "a causal mask or none")
            causal = True
        with g.inserting_before(att.out):
            rank = _rank(gm)
            if layout.rotate == "p2p":
                new = ring.steps(g, att, layout.degree, rank, layout.balance, causal, full,
                                 ghosts, firsts)
            else:
                new = _gathered(g, att, layout, rank, causal, pads)
                full[new.name] = full.get(att.out.name)
        _replace(g, att, new)
    g.lint()
    gm.recompile()
    return pads, ghosts, firsts


def _gathered(g: fx.Graph, att, layout: CPLayout, rank: fx.Node, causal: bool,
              pads: set) -> fx.Node:
    """Ring attention over every member's keys and values, each laid at its place in
    zeros of the whole (`pad_sequence`; the pads, which the group gathers, go in `pads`)."""
    whole = []
    for x in (att.k, att.v):
        pad = g.call_function(pad_sequence, (g.call_function(_T, (x, 1, 2)), layout.degree,
                                             rank))
        pads.add(pad)
        whole.append(g.call_function(_T, (pad, 1, 2)))
    return g.call_function(ring_attention, (att.q, *whole, layout.degree, rank,
                                            layout.balance, causal, att.scale, att.gqa))


def _replace(g: fx.Graph, att, new: fx.Node) -> None:
    """The attention's uses made `new`'s, and its nodes (random op or not) erased."""
    new.meta = dict(att.out.meta)
    att.out.replace_all_uses_with(new)
    inputs = []
    for n in reversed(att.nodes):
        inputs += n.all_input_nodes
        g.erase_node(n)
    prune(g, [a for a in inputs if a not in att.nodes and not a.users])

