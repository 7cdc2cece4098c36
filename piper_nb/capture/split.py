"""Trace a model (with its loss) by torch.fx and split the graph into one GraphModule per region.

A region is the part of the model that one unique tag combination selects. Operations
inherit the tags of the module they run in (and of any `pn.region` scope); glue outside
every tagged module (residual adds, reshapes, the loss, an untagged module without
parameters such as `nn.ReLU()`) joins the region of its latest input. Values that cross
regions become named dataflow edges, so a skip connection from region 0 to region 2 is an
edge 0 -> 2; a parameter read by two regions (tied embeddings) is recorded so its gradient
can be summed.

A tag combination re-entered after a region that depends on it starts a new *segment*:
in a mixture of experts, {PP: 0} dispatches tokens to the experts {PP: 0, EP: e} and then
combines their outputs, so the combine is region {PP: 0, SEG: 1}. An op tagged T reading
region a takes a's segment when a is tagged T, else one past every segment of T that a
depends on (0 if none). Regions are numbered in dependency order, so the region graph is
acyclic and running the regions by index is a valid order; models without re-entry keep
their regions (no SEG tag). Sizes (`x.shape`, `x.size(-1)`) that cross regions travel as
one-byte tensors of that shape (`pack_size`), since only tensors flow between regions.
Assigning ops to regions (tags, segment) lives in `capture.segments`. Stacked experts
annotated by slices (`capture.experts`) are captured through piper_nb's sliced forward and
their parameters cut into pieces, which the regions then hold (`Capture.named_parameters`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from piper_nb.capture.batch import PAIR, Batch
from piper_nb.capture.experts import cut_pieces, sliced_forwards
from piper_nb.capture.export import custom_op_modules, rematerialize
from piper_nb.capture.front_ends import FrontEnd, front_end
from piper_nb.capture.pipe_split import split_points
from piper_nb.capture.region_code import region_module
from piper_nb.capture.segments import assign_regions
from piper_nb.errors import PlanError
from piper_nb.ir.filters import SEG, Tags, freeze_tags, tags_text
from piper_nb.ir.loss_outputs import LOSS, is_loss_output, loss_output_label

__all__ = ["RegionInfo", "Capture", "capture_regions", "BATCH_INPUT", "BATCH_TARGET", "LOSS",
           "SEG"]

BATCH_INPUT, BATCH_TARGET = PAIR


@dataclass(frozen=True)
class RegionInfo:
    """What one region reads, writes and owns (names refer to the original model)."""

    index: int
    tags: Tags
    modules: tuple[str, ...]
    params: tuple[str, ...]
    buffers: tuple[str, ...]
    inputs: tuple[str, ...]   # value names it reads: batch names or other regions' outputs
    outputs: tuple[str, ...]  # value names it produces for other regions (LOSS for the loss)
    # cut over a context: (degree, load balance, the batch inputs it reads cut along the
    # sequence) (`cp.rewrite`); () when the region runs on whole sequences
    context: tuple = ()

    @property
    def name(self) -> str:
        return tags_text(self.tags) or "all"

    @property
    def has_loss(self) -> bool:
        return LOSS in self.outputs


@dataclass(eq=False)
class Capture:
    model: nn.Module
    loss_fn: Callable
    regions: tuple[RegionInfo, ...]
    modules: tuple[fx.GraphModule, ...]
    producer: dict[str, int]                   # value -> region index (-1: the batch)
    consumers: dict[str, tuple[int, ...]]      # value -> reading regions
    tied: dict[str, tuple[int, ...]] = field(default_factory=dict)  # param -> regions
    # expert piece -> (stacked parameter, first expert, end, the piece's tensor)
    pieces: dict[str, tuple] = field(default_factory=dict)
    method: str = "fx"                         # the front end: "fx" or "export"
    functions: dict = field(default_factory=dict)   # custom autograd Functions kept, by key
    batch: tuple[str, ...] = PAIR              # the batch's tensors, as the graph reads them
    imports: tuple[str, ...] = ()              # modules registering custom ops the regions call
    samples: tuple | None = None               # export: the sample shapes it is specialised to
    loss_mean: str = "microbatch"              # what the loss region returns (`capture.loss`)
    tp: Any = None                             # `tp.rewrite.TPLayout`, if sharded
    tp_local: dict = field(default_factory=dict)   # sharded parameter -> device 0's shard
    cp: Any = None                             # `cp.rewrite.CPLayout`, if cut over a context

    def named_parameters(self, whole: bool = False) -> list[tuple[str, torch.Tensor]]:
        """The parameters the regions hold: the model's, each stacked parameter of sliced
        experts replaced by its pieces (`capture.experts`), read from the model's tensor
        now (a view: its current values, device and requires_grad), and each
        tensor-parallel one as device 0's shard (`whole`: the whole tensor, which workers
        cut their own shards from). A frozen parameter no region reads is not among them."""
        held = {p for r in self.regions for p in r.params}
        cut: dict[str, list[tuple[str, int, int]]] = {}
        for p, (full, lo, hi, _) in self.pieces.items():
            cut.setdefault(full, []).append((p, lo, hi))
        out = []
        for name, t in self.model.named_parameters():
            out += [(p, t[lo:hi]) for p, lo, hi in cut[name]] if name in cut else [(name, t)]
        local = {} if whole else self.tp_local
        return [(n, local.get(n, t)) for n, t in out if n in held]

    def with_regions(self, regions, modules, **fields) -> Capture:
        """This capture with other regions and modules (parts that tensor or context
        parallelism cut): who makes and who reads each value and which regions hold each
        tied weight follow them; `fields` replace others (the layout of the cut)."""
        producer: dict[str, int] = {v: -1 for v, p in self.producer.items() if p < 0}
        consumers: dict[str, list[int]] = {}
        for r in regions:
            for v in r.outputs:
                producer[v] = r.index
            for v in r.inputs:
                consumers.setdefault(v, []).append(r.index)
        tied = {p: holders for p in self.tied
                if len(holders := tuple(r.index for r in regions if p in r.params)) > 1}
        return dataclasses.replace(self, regions=tuple(regions), modules=tuple(modules),
                                   producer=producer, tied=tied,
                                   consumers={v: tuple(cs) for v, cs in consumers.items()},
                                   **fields)

    def region_of_tags(self, tags: dict) -> int:
        key = freeze_tags(tags)
        for r in self.regions:
            if r.tags == key:
                return r.index
        raise KeyError(tags)


def _strip(target: str) -> str:
    """A module path of the traced root as a path of the model."""
    return target.removeprefix("model.")


def capture_regions(spec, loss_fn: Callable, example: Batch | None = None,
                    method: str = "auto", loss_mean: str = "microbatch") -> Capture:
    """Capture `spec.model` with `loss_fn` and split it into one GraphModule per region;
    `example` is the named batch (`capture.batch.Batch`)."""
    model = spec.model
    names = tuple(example) if example is not None else PAIR
    slices = getattr(spec, "expert_slices", {})
    if slices and method == "fx":
        raise PlanError("expert slices ([lo:hi] annotations) are captured by torch.export: "
                        "use capture='auto' or 'export'")
    with sliced_forwards(model, slices), split_points(model, getattr(spec, "split_spec", {})):
        # slices and split points are per layer: a stamp would copy one layer's to the rest
        front = front_end(model, loss_fn, example, "export" if slices else method, names,
                          loss_mean, stamped=not slices and not getattr(spec, "split_spec", {}))
    gm = front.gm
    pieces = cut_pieces(gm, slices) if slices else {}
    nodes = list(gm.graph.nodes)
    own = _own_tags(spec, gm, nodes, front.module_path)
    # a tag combination re-entered after a region that depends on it (MoE: dispatch ->
    # experts -> combine) starts a new segment, so the region graph stays acyclic
    region_of, tags_of_region = assign_regions(nodes, own)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update({p: gm.get_parameter("model." + p) for p in pieces})
    # masks, rotary tables and position ids are recomputed where read, not sent
    if front.method == "export" and rematerialize(gm, region_of, {"model." + n for n in params}):
        nodes = list(gm.graph.nodes)
        own = _own_tags(spec, gm, nodes, front.module_path)
        region_of, tags_of_region = assign_regions(nodes, own)
    holdings = _region_holdings(model, params, gm, nodes, region_of, tags_of_region, front,
                                {full for full, _, _ in pieces.values()})
    flow = _cross_region_values(nodes, region_of, front.size_nodes, names, front.outputs)
    regions, modules = _build_regions(gm, nodes, region_of, tags_of_region, holdings, flow)
    name_map = flow.name_map
    return Capture(model=model, loss_fn=loss_fn, regions=tuple(regions), modules=tuple(modules),
                   producer={name_map.get(v, v): p for v, p in flow.producer.items()},
                   consumers={name_map.get(v, v): tuple(sorted(cs))
                              for v, cs in flow.consumers.items()},
                   tied=holdings.tied, method=front.method, batch=names,
                   functions=dict(front.functions), loss_mean=loss_mean,
                   samples=example.samples if front.method == "export" else None,
                   imports=custom_op_modules(modules) if front.method == "export" else (),
                   pieces={p: (full, lo, hi, params[p]) for p, (full, lo, hi) in pieces.items()})


def _own_tags(spec, gm: fx.GraphModule, nodes: list[fx.Node],
              module_path: Callable[[fx.Node], str]) -> dict[fx.Node, dict]:
    """Own tags of each op (module annotations + pn.region scopes); untagged params fail. A
    model with neither is one region, `PP=0` (plain data parallelism needs no tags)."""
    own: dict[fx.Node, dict] = {}
    untagged: set[str] = set()
    whole = not spec.module_tags and not any(n.meta.get("pn_tags") for n in nodes)
    cut = next((p for p, t in spec.module_tags.items() if "PP" in t), None)
    if cut is not None and any("pn_split" in n.meta for n in nodes):
        raise PlanError(f"{type(spec.model).__name__} calls pipe_split() in forward and the "
                        f"annotation gives {cut or 'the root'} a PP tag too: mark the stages one "
                        "way (pipe_split(), or PP tags)")
    for n in nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        path = module_path(n)
        tags = {"PP": 0} if whole else {**spec.tags_of(path), **n.meta.get("pn_tags", {})}
        if tags:
            own[n] = tags
        elif n.op == "call_module" and any(True for _ in gm.get_submodule(str(n.target))
                                           .parameters()):
            untagged.add(path)
    if untagged:
        raise PlanError(f"modules {', '.join(sorted(untagged))} have parameters but no tags: "
                        "annotate them (or a parent module) so every parameter is in a region")
    if not own:
        raise PlanError("no operation of the model carries a tag: annotate at least one module, "
                        "e.g. pn.annotate(model, {'': {'PP': 0}}) for a single region")
    return own


@dataclass
class _Holdings:
    """What each region owns (module paths, parameters, buffers) and the tied parameters."""

    modules: dict[int, dict[str, None]]
    params: dict[int, dict[str, None]]
    buffers: dict[int, dict[str, None]]
    tied: dict[str, tuple[int, ...]]


def _region_holdings(model: nn.Module, params: dict[str, nn.Parameter], gm: fx.GraphModule,
                     nodes: list[fx.Node], region_of: dict[fx.Node, int],
                     tags_of_region: dict[int, Tags], front: FrontEnd, pieced: set[str],
                     ) -> _Holdings:
    """Modules, parameters (call_module + get_attr) and buffers of each region, tied params.
    A get_attr that is neither (a constant made in forward) stays with the region's code.
    `params` are the model's and its expert pieces; `pieced` the ones held as pieces only."""
    buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
    param_ids: dict[int, list[str]] = {}
    for name, p in params.items():
        param_ids.setdefault(id(p), []).append(name)
    region_params: dict[int, dict[str, None]] = {i: {} for i in tags_of_region}
    region_buffers: dict[int, dict[str, None]] = {i: {} for i in tags_of_region}
    region_modules: dict[int, dict[str, None]] = {i: {} for i in tags_of_region}
    canonical = {id(p): names[0] for p_id, names in param_ids.items() for p in [params[names[0]]]}
    for n in nodes:
        if n.op == "call_module":
            r = region_of[n]
            region_modules[r][_strip(str(n.target))] = None
            sub = gm.get_submodule(str(n.target))
            for p in sub.parameters():
                region_params[r][canonical[id(p)]] = None
            for b_name, _ in sub.named_buffers():
                region_buffers[r][f"{_strip(str(n.target))}.{b_name}"] = None
        elif n.op == "get_attr":
            target = _strip(str(n.target))
            users = {region_of[u] for u in n.users if u in region_of}
            obj = gm.get_parameter(str(n.target)) if target in params else None
            for r in users:
                if obj is not None:
                    region_params[r][canonical[id(obj)]] = None
                elif target in buffers:
                    region_buffers[r][target] = None
        elif front.method == "export" and n in region_of and front.module_path(n):
            region_modules[region_of[n]][front.module_path(n)] = None
    # a frozen parameter forward never reads (a spare head) is left out, as PyTorch leaves it
    used = {k: v for k, v in param_ids.items() if v[0] not in pieced
            and (params[v[0]].requires_grad or any(v[0] in ps for ps in region_params.values()))}
    return _Holdings(region_modules, region_params, region_buffers,
                     _tied_params(used, region_params))


def _tied_params(param_ids: dict[int, list[str]], region_params: dict[int, dict[str, None]],
                 ) -> dict[str, tuple[int, ...]]:
    """Parameters held by more than one region; fails on trainable parameters no region
    uses (their gradient would be None, which PyTorch's DDP refuses as well)."""
    holders: dict[str, list[int]] = {}
    for r, ps in region_params.items():
        for p in ps:
            holders.setdefault(p, []).append(r)
    tied = {p: tuple(rs) for p, rs in holders.items() if len(rs) > 1}
    unused = [name for name in (names[0] for names in param_ids.values()) if name not in holders]
    if unused:
        raise PlanError(f"parameters {', '.join(unused[:6])} are never used by forward(); "
                        "remove them or use them, so every parameter belongs to a region")
    return tied


@dataclass
class _Dataflow:
    """Values crossing regions: producer and readers of each, batch names, sizes, the loss."""

    producer: dict[str, int]          # value -> region index (-1: the batch)
    consumers: dict[str, set[int]]    # value -> reading regions
    name_map: dict[str, str]          # placeholder name -> the batch tensor's name
    sizes: set[fx.Node]               # nodes computing sizes: packed when they cross
    ends: dict[str, fx.Node]          # LOSS, COUNT, metrics (`ir.loss_outputs`) -> node


def loss_ends(nodes: list[fx.Node], outputs: tuple[str, ...]) -> dict[str, fx.Node]:
    """The graph's outputs by name: LOSS, then `outputs` (`FrontEnd.outputs`); PlanError
    when one is not computed by the model (a constant count, an input returned)."""
    out_node = next(n for n in nodes if n.op == "output")
    flat = out_node.args[0]
    flat = tuple(flat) if isinstance(flat, (tuple, list)) else (flat,)
    ends = dict(zip((LOSS, *outputs), flat, strict=True))
    for name, n in ends.items():
        if not isinstance(n, fx.Node) or n.op in ("placeholder", "get_attr"):
            what = loss_output_label(name)
            raise PlanError(f"{what} is not computed from the model's output (a constant or "
                            "a batch tensor returned as is); compute it with tensor operations "
                            "on the output and targets, e.g. (labels != -100).sum()")
    return ends


def _cross_region_values(nodes: list[fx.Node], region_of: dict[fx.Node, int],
                         size_nodes: Callable[[list[fx.Node]], set[fx.Node]],
                         names: tuple[str, ...], outputs: tuple[str, ...]) -> _Dataflow:
    """The values that cross regions (batch inputs included), who produces and reads them."""
    producer: dict[str, int] = {}
    consumers: dict[str, set[int]] = {}
    ends = loss_ends(nodes, outputs)
    for n in nodes:
        if n.op == "placeholder":
            producer[n.name] = -1
    for n in nodes:
        if n not in region_of:
            continue
        r = region_of[n]
        for a in n.all_input_nodes:
            if a.op == "get_attr":
                continue
            if a.op == "placeholder" or region_of.get(a) != r:
                producer.setdefault(a.name, region_of.get(a, -1))
                consumers.setdefault(a.name, set()).add(r)
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    clash = set(names) & {n.name for n in nodes if n.op != "placeholder"}
    if clash:
        raise PlanError(f"batch key {sorted(clash)[0]!r} is also the name of a value inside the "
                        "model; rename that batch entry")
    name_map = dict(zip(placeholders, names, strict=True))
    return _Dataflow(producer, consumers, name_map, size_nodes(nodes), ends)


def _build_regions(gm: fx.GraphModule, nodes: list[fx.Node], region_of: dict[fx.Node, int],
                   tags_of_region: dict[int, Tags], holdings: _Holdings, flow: _Dataflow,
                   ) -> tuple[list[RegionInfo], list[fx.GraphModule]]:
    """One RegionInfo and one GraphModule per region, in region order."""
    regions, modules = [], []
    by_name = {n.name: n for n in nodes}
    for r in sorted(tags_of_region):
        mine = [n for n in nodes if region_of.get(n) == r]
        in_names = [v for v, cs in flow.consumers.items() if r in cs]
        in_names.sort(key=lambda v: nodes.index(by_name[v]))
        out_names = [v for v, p in flow.producer.items() if p == r]
        out_names.sort(key=lambda v: nodes.index(by_name[v]))
        out_names += [name for name, n in flow.ends.items() if n in mine]
        modules.append(region_module(gm, r, mine, in_names, out_names, by_name, flow.name_map,
                                     flow.sizes, flow.ends))
        regions.append(RegionInfo(
            index=r, tags=tags_of_region[r], modules=tuple(holdings.modules[r]),
            params=tuple(holdings.params[r]), buffers=tuple(holdings.buffers[r]),
            inputs=tuple(flow.name_map.get(v, v) for v in in_names),
            outputs=tuple(out_names)))
    return regions, modules


def run_reference(capture: Capture, inputs, targets: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """Run the regions in order on one process (used to check the split is faithful): on
    `(inputs, targets)`, or on a dict batch given as `inputs`."""
    values = dict(inputs) if targets is None else {BATCH_INPUT: inputs, BATCH_TARGET: targets}
    loss = None
    for info, mod in zip(capture.regions, capture.modules, strict=True):
        outs = mod(*(values[v] for v in info.inputs))
        for name, val in zip(info.outputs, outs, strict=True):
            if name == LOSS:
                loss = val
            elif not is_loss_output(name):
                values[name] = val
    return loss
