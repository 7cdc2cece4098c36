"""Capture at any depth: a stack of identical layers exported once and stamped.

`torch.export` costs about a third of a second per decoder layer, whatever its size, so an
80-layer Hugging Face model takes half a minute. Most of its layers are the same code on
their own weights: the model's longest `nn.ModuleList` is grouped by *signature* (the
layer's class, its parameters' and buffers' names, shapes and dtypes, and every plain
attribute of it and its submodules but `layer_idx`: Gemma2's and Mistral's alternating
`attention_type` and `sliding_window` split the stack into groups, a dense first layer of
DeepSeek-V3 is a group of its own). The model is exported with only the shortest prefix of
the stack that holds, past layer 0, two members of every group found later
(`prefix`), and each later layer is stamped into the graph as a copy of the last member of
its group in the prefix, reading its own parameters (`stamp`).

A stamp is made only when the export shows it is exact (`_Blocks`): each layer's ops form
one contiguous run; a layer reads only values made before the stack and the outputs of the
layer before it; the code after the stack reads only the last layer's outputs; every layer
hands on the same number of outputs; and the two members of each group compared op for op
(targets, constants, and where each argument comes from) are the same code, so an
attribute-free use of the layer index (GPT-2's `scale_attn_by_inverse_layer_idx`) shows as
a difference; and no `pn.region` scope or `pipe_split()` marks the layers (tags a copy
would take from its template). Otherwise the whole model is exported as before. Constants export lifted
(`lifted_tensor_*`, a cache's empty tensors) are compared by value and shared.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter

import torch
import torch.fx as fx
from torch import nn

__all__ = ["ENABLED", "Stack", "find_stack", "truncated", "stamp"]

ENABLED = True   # tests compare stamped captures with whole ones by turning this off
_SCALARS = (int, float, bool, str, type(None))


@dataclass(frozen=True)
class Stack:
    """The layer stack of a root module: its path (from the root), every layer's group,
    the prefix exported, and the template of each layer stamped after it."""

    path: str
    groups: tuple[int, ...]
    keep: int
    templates: dict[int, int]


def find_stack(root: nn.Module) -> Stack | None:
    """The stack to stamp: the longest ModuleList of `root` not inside another one, when
    stamping saves at least two layers; else None."""
    if not ENABLED:
        return None
    best, lists = None, []
    for path, m in root.named_modules():
        if not isinstance(m, nn.ModuleList):
            continue
        if any(path.startswith(p + ".") for p in lists):   # experts inside a layer: not a stack
            continue
        lists.append(path)
        if len(m) >= 4 and (best is None or len(m) > len(best[1])):
            best = (path, m)
    if best is None:
        return None
    path, layers = best
    sigs: dict[tuple, int] = {}
    groups = tuple(sigs.setdefault(_signature(layer), len(sigs)) for layer in layers)
    keep = prefix(groups)
    if keep is None or len(groups) - keep < 2:
        return None
    last = {g: i for i, g in enumerate(groups[:keep]) if i >= 1}
    return Stack(path, groups, keep, {j: last[groups[j]] for j in range(keep, len(groups))})


def prefix(groups: tuple[int, ...]) -> int | None:
    """The shortest prefix holding, at positions 1 on, two members of every group that
    appears after it; None when there is none shorter than the stack."""
    for keep in range(3, len(groups)):
        seen: dict[int, int] = {}
        for g in groups[1:keep]:
            seen[g] = seen.get(g, 0) + 1
        if all(seen.get(g, 0) >= 2 for g in groups[keep:]):
            return keep
    return None


def _signature(layer: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in layer.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    attrs = []
    for name, m in layer.named_modules():
        plain = tuple(sorted((k, _frozen(v)) for k, v in vars(m).items()
                             if k != "layer_idx" and not k.startswith("_") and _plain(v)))
        attrs.append((name, type(m).__qualname__, type(m).__module__, m.training, plain))
    return params, buffers, tuple(attrs)


def _plain(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(isinstance(e, _SCALARS) for e in v)
    return isinstance(v, _SCALARS)


def _frozen(v):
    return tuple(v) if isinstance(v, list) else v


@contextlib.contextmanager
def truncated(root: nn.Module, stack: Stack | None):
    """`root` with its stack cut to the prefix for the duration (restored after)."""
    if stack is None:
        yield
        return
    layers = root.get_submodule(stack.path)
    whole = layers._modules
    layers._modules = OrderedDict(list(whole.items())[:stack.keep])
    try:
        yield
    finally:
        layers._modules = whole


def stamp(gm: fx.GraphModule, root: nn.Module, stack: Stack) -> bool:
    """Stamp the layers after the prefix into `gm` (exported with the prefix only); False
    when the export does not show the stamp exact, and `gm` (its size arithmetic perhaps
    moved ahead of the stack) is then to be exported again whole."""
    if any(n.meta.get("pn_split") is not None for n in gm.graph.nodes):
        return False   # pipe_split() stages: numbered by position, a copy would keep its own
    blocks = _Blocks.read(gm, stack)
    if blocks is None or any(n.meta.get("pn_tags") for b in blocks.nodes for n in b):
        return False   # pn.region scopes around a layer: they may differ from layer to layer
    g = gm.graph
    after = blocks.after
    prev_outs = blocks.outs[stack.keep - 1]
    made: set[fx.Node] = set()
    for j in range(stack.keep, len(stack.groups)):
        t = stack.templates[j]
        copies: dict[fx.Node, fx.Node] = {}
        attrs: dict[fx.Node, fx.Node] = {}
        index_prev = {n: p for p, n in enumerate(blocks.outs[t - 1])}

        def arg(x, t=t, j=j, copies=copies, attrs=attrs, index_prev=index_prev,
                prev_outs=prev_outs):
            if x in copies:
                return copies[x]
            if x in index_prev:
                return prev_outs[index_prev[x]]
            if x.op == "get_attr" and x in blocks.attrs[t]:
                if x not in attrs:
                    with g.inserting_before(after):
                        attrs[x] = g.get_attr(_own_attr(gm, root, stack, x, t, j))
                return attrs[x]
            return x

        with g.inserting_before(after):
            for n in blocks.nodes[t]:
                c = g.node_copy(n, arg)
                c.meta["nn_module_stack"] = _renamed(n.meta.get("nn_module_stack"), stack, t, j)
                copies[n] = c
        made |= set(copies.values()) | set(attrs.values())
        prev_outs = [copies[o] for o in blocks.outs[t]]
    last = blocks.outs[stack.keep - 1]
    inside = {n for b in blocks.nodes for n in b}
    for p, old in enumerate(last):
        for u in list(old.users):
            if u not in inside and u not in made:
                u.replace_input_with(old, prev_outs[p])
    g.lint()
    return True


def _renamed(stack_meta, stack: Stack, t: int, j: int):
    if not stack_meta:
        return stack_meta
    old, new = f"{stack.path}.{t}", f"{stack.path}.{j}"

    def swap(path: str) -> str:
        return new + path[len(old):] if path == old or path.startswith(old + ".") else path
    return {f"L__self__{swap(path)}" if k.startswith("L__self__") else k: (swap(path), kind)
            for k, (path, kind) in stack_meta.items()}


def _own_attr(gm: fx.GraphModule, root: nn.Module, stack: Stack, x: fx.Node, t: int,
              j: int) -> str:
    """The target of layer j's counterpart of template t's get_attr `x`, registered in `gm`:
    layer j's own parameter or buffer, or the template's lifted constant under a new name."""
    old = str(x.target)
    target = f"{stack.path}.{j}" + old[len(f"{stack.path}.{t}"):]
    owner, _, leaf = target.rpartition(".")
    try:
        value = root.get_parameter(target)
    except AttributeError:
        try:
            value = root.get_buffer(target)
        except AttributeError:
            value = None
    if value is None:   # a constant export lifted: shared (compared equal by `_Blocks`)
        leaf = f"{leaf}_l{j}"
        target = f"{owner}.{leaf}"
        value = attrgetter(old)(gm)
    mod = gm
    for part in owner.split("."):
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value)
    return target


@dataclass
class _Blocks:
    """The prefix's layers as the export shows them: per layer its ops in order, its
    get_attr nodes, the values it hands on (`outs`), and the first op after the stack."""

    nodes: list[list[fx.Node]]
    attrs: list[set[fx.Node]]
    outs: list[list[fx.Node]]
    after: fx.Node

    @classmethod
    def read(cls, gm: fx.GraphModule, stack: Stack) -> _Blocks | None:
        keep = stack.keep
        shared = _hoist_sizes(gm, stack)
        order = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr")]
        layer_of: dict[fx.Node, int] = {}
        for n in order:
            k = _layer(n, stack.path)
            if k is not None and n not in shared:
                layer_of[n] = k
        nodes: list[list[fx.Node]] = [[] for _ in range(keep)]
        for n in order:
            if n in layer_of:
                nodes[layer_of[n]].append(n)
        if any(not b for b in nodes):
            return None
        pos = {n: i for i, n in enumerate(order)}
        start, end = pos[nodes[0][0]], pos[nodes[-1][-1]]
        run = order[start:end + 1]
        if [layer_of.get(n) for n in run] != sorted(layer_of.get(n, -1) for n in run):
            return None   # an op outside the layers between them, or layers interleaved
        attrs = [set() for _ in range(keep)]
        for n in gm.graph.nodes:
            if n.op == "get_attr":
                k = _layer_of_target(str(n.target), stack.path)
                if k is not None and k < keep:
                    attrs[k].add(n)
                    if any(layer_of.get(u) != k for u in n.users):
                        return None
        outs = []
        for k in range(keep):
            mine = set(nodes[k])
            out = [n for n in nodes[k] if any(u not in mine for u in n.users)]
            for n in out:
                for u in n.users:
                    if u in mine:
                        continue
                    if k < keep - 1 and layer_of.get(u) != k + 1:
                        return None   # read past the next layer (or by code after the stack)
                    if k == keep - 1 and u in layer_of:
                        return None
            outs.append(out)
        if len({len(o) for o in outs}) != 1:
            return None
        blocks = cls(nodes, attrs, outs, order[end + 1] if end + 1 < len(order) else None)
        if blocks.after is None:
            return None
        for k in range(1, keep):
            if not blocks._reads_ok(k, layer_of):
                return None
        for t in set(stack.templates.values()):
            first = next(i for i in range(1, keep) if stack.groups[i] == stack.groups[t])
            if first == t or not blocks._same(gm, first, t, stack):
                return None
        return blocks

    def _reads_ok(self, k: int, layer_of: dict) -> bool:
        """Layer k reads only its own ops, the layer before's outputs and values made
        before the stack."""
        mine, prev = set(self.nodes[k]), set(self.outs[k - 1])
        for n in self.nodes[k]:
            for a in n.all_input_nodes:
                if a in mine or a in prev or a.op in ("placeholder", "get_attr"):
                    continue
                if a in layer_of:
                    return False
        return True

    def _same(self, gm, a: int, b: int, stack: Stack) -> bool:
        """Layers a and b are the same code (see the module docstring)."""
        if len(self.nodes[a]) != len(self.nodes[b]):
            return False
        m: dict[fx.Node, fx.Node] = {}
        prev_a = {n: p for p, n in enumerate(self.outs[a - 1])}
        prev_b = self.outs[b - 1]
        for x, y in zip(self.nodes[a], self.nodes[b], strict=True):
            if x.op != y.op or x.target != y.target:
                return False
            m[x] = y

        def same(u, v) -> bool:
            if isinstance(u, fx.Node):
                if not isinstance(v, fx.Node):
                    return False
                if u in m:
                    return m[u] is v
                if u in prev_a:
                    return prev_b[prev_a[u]] is v
                if u.op == "get_attr" and u in self.attrs[a]:
                    return v in self.attrs[b] and _same_attr(gm, u, v, stack, a, b)
                return u is v
            if isinstance(u, (list, tuple)):
                return (isinstance(v, (list, tuple)) and len(u) == len(v)
                        and all(same(p, q) for p, q in zip(u, v, strict=True)))
            if isinstance(u, dict):
                return (isinstance(v, dict) and u.keys() == v.keys()
                        and all(same(u[k], v[k]) for k in u))
            return type(u) is type(v) and u == v

        return all(same(x.args, y.args) and same(x.kwargs, y.kwargs)
                   for x, y in zip(self.nodes[a], self.nodes[b], strict=True))



def _hoist_sizes(gm: fx.GraphModule, stack: Stack) -> set[fx.Node]:
    """Move before the stack the size arithmetic made inside it from values made before it
    (export computes `16 * batch` once, in the first layer that needs it, and later layers
    read it there): it belongs to no layer."""
    first, outside, moved = None, set(), []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            outside.add(n)
            continue
        inside = _layer(n, stack.path) is not None
        if first is None and inside:
            first = n
        if first is None:
            outside.add(n)
        elif inside and _is_size(n) and all(a in outside for a in n.all_input_nodes):
            outside.add(n)
            moved.append(n)
    for n in moved:
        first.prepend(n)
    return set(moved)


def _is_size(n: fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))


def _same_attr(gm, u: fx.Node, v: fx.Node, stack: Stack, a: int, b: int) -> bool:
    tu, tv = str(u.target), str(v.target)
    pa, pb = f"{stack.path}.{a}", f"{stack.path}.{b}"
    if tu[len(pa):] == tv[len(pb):]:
        return True
    x, y = attrgetter(tu)(gm), attrgetter(tv)(gm)   # lifted constants: numbered globally, compare values
    if isinstance(x, nn.Parameter) or isinstance(y, nn.Parameter):
        return False
    return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
            and x.dtype == y.dtype and (x.is_meta or y.is_meta or torch.equal(x, y))
            and tu.rpartition(".")[0][len(pa):] == tv.rpartition(".")[0][len(pb):])


def _layer(n: fx.Node, path: str) -> int | None:
    stack = n.meta.get("nn_module_stack") or {}
    for p, _ in stack.values():
        k = _layer_of_target(p + ".", path)
        if k is not None:
            return k
    return None


def _layer_of_target(target: str, path: str) -> int | None:
    head = path + "."
    if not target.startswith(head):
        return None
    idx = target[len(head):].split(".", 1)[0]
    return int(idx) if idx.isdigit() else None
