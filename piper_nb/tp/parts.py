"""A sharded region's ops by status and part, and its parts as regions (the analysis of
`tp.rewrite`, whose docstring says what the statuses and parts are).

`levels` gives every op its status (replicated, sharded, partial) and part number;
`close_partials` sums a partial value the region returns before it leaves;
`route_aliases` gives each replicated value that needs a gradient inside a sharded part
an alias of its own in the part before (its gradient is then all-reduced); `build_parts`
cuts the graph into one GraphModule and `RegionInfo` per part, named values crossing
between them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from piper_nb.capture.region_code import region_module
from piper_nb.errors import PlanError
from piper_nb.ir.filters import freeze_tags

__all__ = ["PART", "R", "S", "P", "Info", "Cut", "levels", "close_partials", "route_aliases",
           "build_parts"]

PART = "PART"
R, S, P = "replicated", "sharded", "partial"
_ALIAS = torch.ops.aten.alias.default
_CLONE = torch.ops.aten.clone.default


@dataclass
class Info:
    """What one run recorded of an op: a tensor?, needing a gradient?, its shape, and
    whether it is a floating-point tensor."""

    tensor: bool
    grad: bool
    shape: tuple | None = None
    floating: bool = False


@dataclass
class Cut:
    """One sharded region cut into parts: (info, module) per part, each sharded
    parameter's (dim, degree, blocks), the partial and gradient-summed values, and
    device 0's shard of each sharded parameter."""

    parts: list
    params: dict
    partial: set
    grad_sum: set
    local: dict = dataclasses.field(default_factory=dict)
    sums: dict = dataclasses.field(default_factory=dict)   # value -> its forward sum's kind
    ghosts: dict = dataclasses.field(default_factory=dict)  # delivered value -> its source


def levels(gm, col: set, row: set, info) -> tuple[dict, dict]:
    """Status and part number of every op (see the module docstring); get_attr and ops on
    constants only float to the earliest part that reads them."""
    status, level, floating = {}, {}, []
    for n in gm.graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            status[n], level[n] = R, 0
            continue
        ins = [a for a in n.all_input_nodes if a in status]
        if n in col:
            x = n.args[0]
            if status.get(x, R) != R:
                _fail(n, info, "a colwise layer reads a value that is already sharded; pair "
                      "each colwise layer with a rowwise one")
            status[n], level[n] = S, (level.get(x, 0) // 2) * 2 + 1
        elif n in row:
            x = n.args[0]
            if status.get(x) != S:
                _fail(n, info, "a rowwise layer reads a replicated value; put a colwise layer "
                      "before it, or replicate it")
            status[n], level[n] = P, level[x]
        elif not ins:
            floating.append(n)
        else:
            kinds = {status[a] for a in ins}
            if S in kinds:
                lvl = max(level[a] for a in ins if status[a] == S)
                if P in kinds or any(level[a] > lvl for a in ins if status[a] == R):
                    _fail(n, info, "it mixes a device's share with values made after the "
                          "all-reduce")
                status[n], level[n] = S, lvl
            else:
                status[n] = R
                level[n] = max(level[a] + (status[a] == P) for a in ins)
    out = next(n for n in gm.graph.nodes if n.op == "output")
    for a in out.all_input_nodes:
        if status.get(a) == S:
            _fail(a, info, "a device's share leaves the region without a rowwise layer")
    for n in reversed(floating):
        users = [level[u] for u in n.users if u in level]
        status[n], level[n] = R, min(users, default=0)
    return status, level


def close_partials(gm, status: dict, level: dict, infos: dict) -> None:
    """A partial value the region returns (it ends at a rowwise layer, or a vocab
    embedding is a stage of its own) goes out through an alias in a replicated part after
    its sharded one, so the all-reduce completes it before anything outside reads it."""
    g = gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    for a in list(dict.fromkeys(out.all_input_nodes)):
        if status.get(a) != P:
            continue
        with g.inserting_before(out):
            al = g.call_function(_ALIAS, (a,))
        status[al], level[al] = R, level[a] + 1
        infos[al.name] = infos.get(a.name, Info(True, True))
        out.replace_input_with(a, al)


def _fail(n: fx.Node, info, why: str):
    raise PlanError(f"tensor_parallel: region {info.name} cannot be sharded at {n.name} "
                    f"({n.format_node()}): {why}")


def route_aliases(gm, status: dict, level: dict, infos: dict, sharded: set) -> set[str]:
    """Route each replicated value needing a gradient into a sharded part through an alias
    made in the part before; -> the aliases' names (their gradients are all-reduced)."""
    g, made = gm.graph, set()
    for n in list(g.nodes):
        if status.get(n) != R or n.op == "output":
            continue
        if n.op == "get_attr":
            name = str(n.target).removeprefix("model.")
            needs = (_is_param(gm, str(n.target)) and name not in sharded
                     and gm.get_parameter(str(n.target)).requires_grad)
        else:
            i = infos.get(n.name)
            needs = i is not None and i.grad
        if not needs:
            continue
        by_part: dict[int, list[fx.Node]] = {}
        for u in list(n.users):
            if status.get(u) == S:
                by_part.setdefault(level[u], []).append(u)
        for part, users in sorted(by_part.items()):
            with g.inserting_after(n):   # a parameter's is a copy: ZeRO-3 frees the gathered
                a = g.call_function(_CLONE if n.op == "get_attr" else _ALIAS, (n,))
            status[a], level[a] = R, part - 1
            infos[a.name] = Info(True, True)
            for u in users:
                u.replace_input_with(n, a)
            made.add(a.name)
    return made


def _is_param(gm, target: str) -> bool:
    try:
        gm.get_parameter(target)
        return True
    except AttributeError:
        return False


def build_parts(gm, info, status, level, infos, names: set, grad_sum: set, params, aliases,
                sums: dict | None = None, ghosts=frozenset()) -> Cut:
    """The parts of `gm` (see the module docstring); `ghosts`: ops no part runs, whose
    values come from outside the region (context parallelism's delivered keys and values,
    `cp.ring`): inputs of the parts that read them, with `Cut.ghosts` naming each and the
    value of its input."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")
             and n not in ghosts]
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    ends = dict(zip(info.outputs, out.args[0], strict=True))
    value_of = {ph: v for ph, v in zip(phs, info.inputs, strict=True)}
    taken = set(names)
    for n in nodes:
        if n.name in grad_sum or any(level[u] != level[n] for u in n.users if u in level):
            value_of[n] = _fresh(n.name, taken, info.index)
    for n in ghosts:
        value_of[n] = _fresh(n.name, taken, info.index)
    count = max(level[n] for n in nodes) + 1
    by_name = {value_of[n]: n for n in value_of}
    sizes = {n for n in value_of if n.op != "placeholder" and not infos.get(n.name, Info(True, 0)).tensor}
    partial = {value_of[n] for n in value_of if status.get(n) == P}
    parts = []
    for k in range(count):
        mine = [n for n in nodes if level[n] == k]
        reads = {a for n in mine for a in n.all_input_nodes
                 if a in value_of and (a.op == "placeholder" or level[a] != k or a in ghosts)}
        outs_here = [v for v, e in ends.items() if e in mine or (k == 0 and e.op == "placeholder")]
        reads |= {e for v, e in ends.items() if k == 0 and e.op == "placeholder"}
        crossing = [value_of[n] for n in mine if n in value_of and n.op != "placeholder"]
        in_names = [value_of[a] for a in sorted(reads, key=_order(gm))]
        out_names = crossing + outs_here
        pgm = region_module(gm, info.index, mine, in_names, out_names, by_name, {},
                            sizes, {v: ends[v] for v in outs_here})
        read = _read_names(pgm, aliases)
        pinfo = dataclasses.replace(
            info, tags=freeze_tags({**dict(info.tags), PART: k}),
            params=tuple(p for p in info.params if p in read),
            buffers=tuple(b for b in info.buffers if b in read),
            inputs=tuple(in_names), outputs=tuple(out_names))
        parts.append((pinfo, pgm))
    sums = sums or {}
    return Cut(parts, params, partial, {value_of[n] for n in value_of if n.name in grad_sum},
               sums={value_of[n]: sums[n.name] for n in value_of if n.name in sums},
               ghosts={value_of[n]: value_of[n.args[0]] for n in ghosts})


def _fresh(name: str, taken: set, index: int) -> str:
    """A value's name no region uses yet (its op's, else with the region's index: a part
    cut again, by CP after TP, names its values apart from the first cut's); taken."""
    out, k = name, 0
    while out in taken:
        k += 1
        out = f"{name}_r{index}" + (f"_{k - 1}" if k > 1 else "")
    taken.add(out)
    return out


def _order(gm):
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    return lambda n: pos[n]


def _read_names(pgm: fx.GraphModule, aliases: dict) -> set[str]:
    """The parameters (canonical names) and buffers a part's code reads."""
    out = set()
    for n in pgm.graph.nodes:
        if n.op == "get_attr":
            out.add(str(n.target).removeprefix("model."))
        elif n.op == "call_module":
            path = str(n.target)
            mod = pgm.get_submodule(path)
            out |= {f"{path}.{k}".removeprefix("model.")
                    for k, _ in (*mod.named_parameters(remove_duplicate=False),
                                 *mod.named_buffers(remove_duplicate=False))}
    return out | {aliases[n] for n in out if n in aliases}


