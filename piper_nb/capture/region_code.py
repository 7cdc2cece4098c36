"""A region as code: the GraphModule of one region's ops, what its code calls besides ops
(sizes packed as tensors, op overloads taking lists of traced values, custom autograd
Functions), and the tracer that re-creates it from that code when a worker unpickles it.

`region_module` builds it from the captured graph: the region's nodes, reading its input
values and returning its outputs (values for other regions, the loss and its count and
metrics); an input an op changes in place is copied first. Sizes crossing regions travel as
one-byte tensors of that shape (`pack_size` / `unpack_size`), since only tensors flow
between regions.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch import nn

from piper_nb.capture.functions import apply_function
from piper_nb.capture.ring_attention import context_arange, ring_attention, take_share
from piper_nb.capture.ring_steps import ring_out, ring_shift, ring_step
from piper_nb.capture.sequence_ops import narrow_sequence, pad_sequence, whole_like, with_params
from piper_nb.capture.slice_dropout import share_dropout, share_slice_dropout, slice_dropout

__all__ = ["region_module", "RegionTracer", "pack_size", "unpack_size", "call_op", "own_copy",
           "param_aliases"]


_SIZE_DTYPE, _INT_DTYPE = torch.uint8, torch.int8


def pack_size(v) -> torch.Tensor:
    """A size crossing regions as a tensor: a torch.Size (or tuple of ints) becomes a uint8
    tensor *of that shape*, a non-negative int n an int8 tensor of shape (n,); both are one
    byte expanded (stride 0), and a tensor of zeros of the recorded shape and dtype decodes
    to the same size (so profiling with synthetic inputs works). Other numbers travel by
    value in a 0-d tensor."""
    one = torch.zeros((), dtype=_SIZE_DTYPE)
    if isinstance(v, bool):
        return torch.tensor(v)
    if isinstance(v, (int, torch.SymInt)):   # a SymInt: a routed count, sized symbolically
        return one.to(_INT_DTYPE).expand(v) if v >= 0 else torch.tensor(v)
    if isinstance(v, float):
        return torch.tensor(v, dtype=torch.float64)
    return one.expand(tuple(v))


def call_op(name: str, *args, **kwargs):
    """`torch.ops.<name>(*args, **kwargs)`: how a region calls an op overload that takes a
    list holding a traced value (torch.export's `zeros([1, sym_size, 8])`, a GRU's initial
    state). Re-tracing the region's code (unpickling) keeps this call as one node; calling
    the overload itself there fails, since its schema refuses a list holding a Proxy."""
    ns, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)(*args, **kwargs)


def _nested_values(node: fx.Node) -> bool:
    """An op overload call with a traced value inside a list argument."""
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    return any(isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a)
               for a in (*node.args, *node.kwargs.values()))


def _op_name(op: torch._ops.OpOverload) -> str:
    ns, name = op._schema.name.split("::")
    return f"{ns}.{name}.{op._overloadname}"


class RegionTracer(fx.Tracer):
    """Re-creates a region GraphModule from its code (as unpickling does): the size helpers
    `pack_size` and `unpack_size`, and the calls of custom autograd Functions
    (`capture.functions.apply_function`) and op overloads taking lists of traced values
    (`call_op`) stay calls instead of being traced through, and
    buffers are proxied: an op on a buffer alone (torch.export's `num_batches_tracked.add_(1)`)
    stays an op instead of running once, at unpickling."""

    proxy_buffer_attributes = True

    def __init__(self, autowrap_modules=(math,), autowrap_functions=()):
        super().__init__(autowrap_modules, (*autowrap_functions, pack_size, unpack_size,
                                            apply_function, call_op, slice_dropout,
                                            narrow_sequence, pad_sequence, whole_like,
                                            with_params, context_arange, ring_attention,
                                            take_share, share_dropout, share_slice_dropout,
                                            ring_step, ring_out, ring_shift))


def unpack_size(t: torch.Tensor):
    """Inverse of `pack_size`."""
    if t.dtype == _SIZE_DTYPE:
        return t.shape
    if t.dtype == _INT_DTYPE:
        return t.shape[0]
    return t.item()


def region_module(gm: fx.GraphModule, r: int, mine: list[fx.Node], in_names: list[str],
                  out_names: list[str], by_name: dict[str, fx.Node], name_map: dict[str, str],
                  sizes: set[fx.Node], ends: dict[str, fx.Node]) -> fx.GraphModule:
    """The GraphModule of region `r`: its ops, reading `in_names` and returning `out_names`."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for v in in_names:   # every placeholder first: a call's name never takes an input's
        env[by_name[v]] = g.placeholder(name_map.get(v, v))
    for v in in_names:
        if by_name[v] in sizes:  # a shape crossing regions travels as a tensor
            env[by_name[v]] = g.call_function(unpack_size, (env[by_name[v]],))

    def arg(a: fx.Node) -> fx.Node:
        if a not in env and a.op == "get_attr":
            env[a] = g.get_attr(a.target)
        return env[a]

    for n in mine:
        env[n] = g.node_copy(n, arg)
        if _nested_values(n):
            copy = env[n]
            copy.args, copy.target = (_op_name(n.target), *copy.args), call_op
    outs = [env[ends[v]] if v in ends else
            g.call_function(pack_size, (env[by_name[v]],)) if by_name[v] in sizes else
            env[by_name[v]] for v in out_names]
    g.output(tuple(outs))
    _copy_inputs_changed_in_place(g, gm)
    g.lint()
    g._tracer_cls = RegionTracer  # unpickling re-traces the code: keep the size helpers calls
    return fx.GraphModule(gm, g, class_name=f"Region{r}")


def _copy_inputs_changed_in_place(g: fx.Graph, root: nn.Module) -> None:
    """A region input that an op changes in place (`nn.ReLU(inplace=True)` first in a
    stage) is copied first: on a worker the input is a leaf that requires grad, which
    autograd lets no in-place op touch, where in one process it was an intermediate value."""
    for ph in [n for n in g.nodes if n.op == "placeholder"]:
        if any(_changes_in_place(u, ph, root) for u in ph.users):
            with g.inserting_after(ph):
                copy = g.call_method("clone", (ph,))
            ph.replace_all_uses_with(copy, delete_user_cb=lambda u, c=copy: u is not c)


def _changes_in_place(user: fx.Node, value: fx.Node, root: nn.Module) -> bool:
    first = user.args[0] if user.args else None
    if isinstance(user.target, torch._ops.OpOverload):
        args = user.target._schema.arguments
        bound = [*zip(args, user.args, strict=False),
                 *((a, user.kwargs[a.name]) for a in args if a.name in user.kwargs)]
        return any(v is value and a.alias_info is not None and a.alias_info.is_write
                   for a, v in bound)
    if first is not value:
        return False
    if user.op == "call_module":
        return bool(getattr(root.get_submodule(str(user.target)), "inplace", False))
    if user.op == "call_method":
        return str(user.target).endswith("_")
    if user.op == "call_function":
        name = getattr(user.target, "__name__", "")
        return bool(user.kwargs.get("inplace")) or (name.endswith("_") and not
                                                    name.startswith("_"))
    return False




def own_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule over `gm`'s module tree with a graph of its own: a rewrite of it leaves
    `gm` (the capture's region) as it was."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return fx.GraphModule(gm, g)


def param_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter path of `model` -> the canonical (first) name of that tensor."""
    first: dict[int, str] = {}
    return {n: first.setdefault(id(p), n)
            for n, p in model.named_parameters(remove_duplicate=False)}
