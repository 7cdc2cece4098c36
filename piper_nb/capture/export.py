"""Capture by `torch.export` (non-strict): the front end for models torch.fx cannot trace.

Hugging Face models branch on Python values inside `forward` (cache and mask handling),
which symbolic tracing cannot follow; `torch.export.export(..., strict=False)` runs the real
Python and records the ATen ops it reaches, each with the stack of modules it ran in
(`nn_module_stack`), so annotations by module path map onto it as they do onto an fx
graph. `export_graph` returns the exported program *unlifted* (`ep.module()`): parameters
and buffers are `get_attr` nodes on a root whose `.model` is the user's model, holding the
same tensors, which is the layout the rest of `capture` reads.

Cleaning after export: the input guards, the metadata asserts that pin the capture device,
and the pytree in/out handling go; `pn.region` scopes (kept by export in `meta["custom"]`)
become the node's tags; a symbolic batch size is read off the inputs rather than the
targets, so the first stage needs no targets. The batch dimension is dynamic, so one
capture serves every microbatch size. Values computed from the batch, buffers and
constants alone (attention masks, rotary tables, position ids) are recomputed in each
region that reads them instead of being sent between stages (`rematerialize`), for any
family (Llama's causal masks, Mistral's and Gemma2's sliding windows built in the root
`forward`); a cache `forward` builds and drops leaves no op behind (`_observable`).

Ops registered by libraries at import time (`torch.ops.transformers.*`) must be importable
where the regions are unpickled: `custom_op_modules` names the modules to import first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.nn.utils import parametrize

from piper_nb.capture.functions import exporting_functions, keep_exported_calls
from piper_nb.capture.pipe_split import number_stages
from piper_nb.capture.region import tracing_scope
from piper_nb.capture.stamp import find_stack, stamp, truncated
from piper_nb.errors import PlanError

__all__ = ["export_graph", "export_module_path", "export_size_nodes", "rematerialize",
           "custom_op_modules"]


def export_graph(root: nn.Module, example: dict[str, torch.Tensor], name: str,
                 stamped: bool = True) -> tuple[fx.GraphModule, dict[str, type]]:
    """`root` (model + loss) exported on the named batch `example` with a dynamic batch
    dimension, unlifted and cleaned (see the module docstring), and the custom autograd
    Functions it keeps whole (`capture.functions`); its inputs are the batch's tensors in
    order. `name` names the model in errors. With `stamped`, a stack of
    identical layers is exported once and stamped (`capture.stamp`)."""
    if next(iter(example.values())).shape[0] < 2:
        raise PlanError(f"capturing {name} by torch.export needs an example batch of at least "
                        "2 samples (a batch of 1 is specialised); use a larger batch")
    _check_parametrizations(root, name)
    batch = torch.export.Dim("batch", min=1, max=1 << 20)
    dims = {k: {0: batch} for k in example}
    if tuple(example) == ("inputs", "targets"):
        args, dynamic = tuple(example.values()), tuple(dims.values())
    else:
        args, dynamic = (dict(example),), (dims,)
    stack = find_stack(root) if stamped else None
    try:
        gm, seen = _exported(root, args, dynamic, name, stack)
    except PlanError:
        if stack is None:
            raise
        stack = None   # a forward that needs every layer (it counts them, say): export it whole
        gm, seen = _exported(root, args, dynamic, name, None)
    _clean(gm.graph)
    if stack is not None and not stamp(gm, root, stack):
        gm, seen = _exported(root, args, dynamic, name, None)   # not provably the same code
        _clean(gm.graph)
    gm.recompile()
    return gm, seen


def _exported(root, args, dynamic, name: str, stack) -> tuple[fx.GraphModule, set]:
    """(the unlifted export of `root`, cut to `stack`'s prefix, its custom autograd Functions
    kept whole as calls; those Functions by key)."""
    try:
        with (truncated(root, stack), tracing_scope(), fx_traceback.preserve_node_meta(),
              exporting_functions() as seen):
            program = torch.export.export(root, args, dynamic_shapes=dynamic, strict=False)
            gm = program.module()
            keep_exported_calls(gm, name)
    except PlanError:
        raise
    except Exception as err:  # export raises many kinds; the user needs the reason and where
        raise PlanError(_export_failure(name, err)) from err
    return gm, seen


def _check_parametrizations(root: nn.Module, name: str) -> None:
    """A parametrization that updates buffers under no_grad (spectral_norm's power
    iteration) cannot be exported faithfully: the export keeps the update but not the
    no_grad, so a worker's forward fails. Say so, with the fix."""
    for path, m in root.named_modules():
        if not parametrize.is_parametrized(m):
            continue
        for tensor, plist in m.parametrizations.items():
            for p in plist:
                if any(True for _ in p.buffers()):
                    where = path.removeprefix("model.")
                    raise PlanError(
                        f"{name}: {where}.{tensor} is parametrized by {type(p).__name__} "
                        "(spectral_norm), which updates its buffers under no_grad in every "
                        "forward; torch.export keeps the update but not the no_grad. Capture "
                        "with torch.fx (capture='fx', an (inputs, targets) batch), or remove "
                        "the parametrization (torch.nn.utils.parametrize.remove_parametrizations)")


def _export_failure(name: str, err: Exception) -> str:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = _user_frame(err)
    return (f"could not capture {name} with torch.export (non-strict): {type(err).__name__}: "
            f"{first[:400]}{f' (in {where})' if where else ''}. Regions are found by exporting "
            "model + loss on the example batch: keep Python branches on tensor values out of "
            "forward (torch.cond, or torch._check for sizes), or tag and call the offending "
            "module outside the captured forward")


def _user_frame(err: Exception) -> str:
    """The innermost frame of the traceback outside torch: where the model failed."""
    tb, found = err.__traceback__, ""
    while tb is not None:
        file = tb.tb_frame.f_code.co_filename
        if "/torch/" not in file and "piper_nb" not in file:
            found = f"{file}:{tb.tb_lineno} {tb.tb_frame.f_code.co_name}"
        tb = tb.tb_next
    return found


def _clean(g: fx.Graph) -> None:
    for n in list(g.nodes):
        if ((n.op == "call_module" and n.target == "_guards_fn")
                or n.target is torch.ops.aten._assert_tensor_metadata.default):
            g.erase_node(n)
    out = next(n for n in g.nodes if n.op == "output")
    out.args = (tuple(out.args[0]),)           # the flattened outputs: loss, count, metrics
    g._codegen = fx.graph.CodeGen()            # one plain input per batch tensor
    for n in g.nodes:                          # pn.region scopes -> the tags capture reads
        custom = n.meta.get("custom")
        if custom:
            n.meta["pn_tags"] = {k: v for k, v in custom.items()
                                 if not k.startswith("_") and type(v) is int}
    number_stages(g, g.owning_module)          # pipe_split() points -> PP tags
    _sizes_from_inputs(g)
    g.eliminate_dead_code(is_impure_node=_observable)


def _observable(n: fx.Node) -> bool:
    """Impure for dead-code elimination, except an in-place op whose every written
    argument is a fresh tensor nothing else reads: a cache `forward` builds and drops (a
    sliding-window `DynamicCache`'s `lift_fresh_copy(...).detach_()`) leaves no trace."""
    t = n.target
    if not (n.is_impure() and isinstance(t, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in t.tags):
        return n.is_impure()
    written = [a for spec, a in zip(t._schema.arguments, n.args, strict=False)
               if spec.alias_info is not None and spec.alias_info.is_write]
    return not written or not all(_fresh(a) and set(a.users) == {n} for a in written)


def _fresh(a) -> bool:
    """A node whose value is a new tensor (an op returning no alias of its inputs)."""
    t = getattr(a, "target", None)
    return (isinstance(a, fx.Node) and a.op == "call_function"
            and isinstance(t, torch._ops.OpOverload)
            and all(r.alias_info is None for r in t._schema.returns))


def _sizes_from_inputs(g: fx.Graph) -> None:
    """Export reads a symbolic batch size off whichever input it met last (often the
    targets); read it off the inputs, so a region that needs only the size reads those."""
    first = next(n for n in g.nodes if n.op == "placeholder")
    dims = list(first.meta["val"].shape) if "val" in first.meta else []
    for n in g.nodes:
        if (n.target is torch.ops.aten.sym_size.int and n.args[0] is not first
                and n.args[0].op == "placeholder"):
            for d, s in enumerate(dims):
                if isinstance(s, torch.SymInt) and str(s) == str(n.meta.get("val")):
                    n.args = (first, d)
                    break


def export_module_path(node: fx.Node) -> str:
    """The model path of the innermost module `node` ran in (from `nn_module_stack`)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    if path.startswith("_empty_nn_module_stack") or path == "model":
        return ""
    return path.removeprefix("model.")


def export_size_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes whose value is a number or a list of sizes, not a tensor (from export's meta)."""
    out = set()
    scalars = (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, scalars) or (isinstance(v, (list, tuple)) and v and all(
                isinstance(e, (int, torch.SymInt)) for e in v)):
            out.add(n)
    return out


def _pure(n: fx.Node) -> bool:
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return not (torch.Tag.nondeterministic_seeded in t.tags or t._schema.is_mutable)
    return n.op == "call_function"


def _free_values(g: fx.Graph, params: set[str]) -> set[fx.Node]:
    """Values computed from the batch, buffers and constants only, by pure ops."""
    free: set[fx.Node] = set()
    for n in g.nodes:
        if n.op == "placeholder" or (n.op == "get_attr" and n.target not in params):
            free.add(n)
        elif n.op == "call_function" and _pure(n) and all(a in free for a in n.all_input_nodes):
            free.add(n)
    return free


def rematerialize(gm: fx.GraphModule, region_of: dict[fx.Node, int], params: set[str]) -> int:
    """Give each region its own copy of every free value (see `_free_values`) it reads
    from another region; returns the number of nodes copied. Sizes stay shared."""
    g = gm.graph
    free = _free_values(g, params)
    order = {n: i for i, n in enumerate(g.nodes)}
    copies = 0

    def shared(v: fx.Node) -> bool:
        return (v.op in ("placeholder", "get_attr") or v not in free
                or isinstance(v.meta.get("val"), (torch.SymInt, int)))

    for n in list(g.nodes):
        if shared(n) or n not in region_of:
            continue
        users: dict[int, list[fx.Node]] = {}
        for u in n.users:
            r = region_of.get(u)
            if r is not None and r != region_of[n]:
                users.setdefault(r, []).append(u)
        for readers in users.values():
            memo: dict[fx.Node, fx.Node] = {}
            anchor = min(readers, key=order.__getitem__)

            def clone(v: fx.Node, memo=memo, anchor=anchor) -> fx.Node:
                if shared(v):
                    return v
                if v not in memo:
                    with g.inserting_before(anchor):
                        memo[v] = g.node_copy(v, clone)
                return memo[v]

            copy = clone(n)
            copies += len(memo)
            for u in readers:
                u.replace_input_with(n, copy)
    g.lint()
    gm.recompile()
    return copies


def custom_op_modules(modules: list[fx.GraphModule]) -> tuple[str, ...]:
    """Python modules that register the custom ops (`torch.ops.<lib>.*`, not aten/prims)
    the region graphs call: a worker imports them before unpickling the regions."""
    found: dict[str, None] = {}
    for gm in modules:
        for n in gm.graph.nodes:
            target = n.target
            if not isinstance(target, torch._ops.OpOverload):
                continue
            if target.namespace in ("aten", "prims", "prim", "_c10d_functional", "profiler"):
                continue
            defined = _definer(target)
            if defined:
                found[defined] = None
    return tuple(found)


def _definer(op: torch._ops.OpOverload) -> str | None:
    registry = getattr(torch._library.custom_ops, "OPDEFS", {})
    opdef = registry.get(f"{op.namespace}::{op._opname}")
    fn: Callable | None = getattr(opdef, "_init_fn", None)
    return getattr(fn, "__module__", None)
