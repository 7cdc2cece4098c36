"""What the driver ships to every worker, once per plan: a `Bundle`.

A bundle holds the plan's tables (without the DAG, the program or the captured model), the
region GraphModules, the custom autograd Functions they call (`capture.functions`), the
initial value of every parameter under its canonical name (the first name
`named_parameters()` gives it) and an alias table for tied parameters, whose other names
(`head.proj.weight`) point at the canonical one (`embed.tok.weight`). Workers rebind each
region module's parameters to their own tensors with `bind_params`, so all regions on one
device share one tensor per parameter, as the original model did.
"""

from __future__ import annotations

import dataclasses
import importlib
import pickle
from dataclasses import dataclass

import cloudpickle
import torch
import torch.fx as fx
from torch import nn

from piper_nb.capture.functions import register
from piper_nb.capture.region_code import param_aliases
from piper_nb.errors import PlanError

__all__ = ["Bundle", "make_bundle", "load_bundle", "bind_params", "direct_calls",
           "param_aliases", "to_device"]


@dataclass
class Bundle:
    plan: object                        # Plan with dag/program/capture dropped
    modules: tuple[nn.Module, ...]      # one GraphModule per region
    init: dict[str, torch.Tensor]       # canonical name -> initial value
    aliases: dict[str, str]             # every parameter name -> canonical name


def make_bundle(plan) -> bytes:
    """Pickle what the workers need to run `plan` (raises PlanError without a capture)."""
    cap = plan.capture
    if cap is None:
        raise PlanError("this plan carries no captured model (it was loaded from JSON?); "
                        "compile it with pn.compile(spec, program, batch) to train it")
    tables = dataclasses.replace(plan, dag=None, program=None, capture=None, spec=None)
    # whole tensors: a tensor-parallel worker cuts its own shard (`layout.local_init`)
    init = {n: p.detach().clone() for n, p in cap.named_parameters(whole=True)}
    inner = pickle.dumps(Bundle(tables, tuple(cap.modules), init, param_aliases(cap.model)))
    # custom autograd Functions the regions call, by value where they are not importable
    # (a notebook's): cloudpickle, and registered before the regions are unpickled
    functions = cloudpickle.dumps(dict(getattr(cap, "functions", {})))
    return pickle.dumps((tuple(getattr(cap, "imports", ())), functions, inner))


def load_bundle(blob: bytes) -> Bundle:
    imports, functions, inner = pickle.loads(blob)
    for name in imports:
        try:
            importlib.import_module(name)
        except ImportError as err:
            raise PlanError(f"the plan's regions call ops registered by {name}, which this "
                            f"worker cannot import ({err}); install the same packages on "
                            "every worker") from None
    register(pickle.loads(functions))
    return pickle.loads(inner)


def to_device(module: nn.Module, device: torch.device, region: str = "") -> nn.Module:
    """`module.to(device)`, and the capture machine's devices in a region's graphs made
    `device`, so a region captured on the CPU runs on a GPU.

    torch.export writes the device of the capture as a literal: into factory ops
    (`arange(..., device=cpu)`, `full`, `zeros`, `empty`, `ones`, `scalar_tensor`), into
    `to`/`_to_copy` and into `_assert_tensor_metadata`; in the top-level graph and in nested
    ones (the `submod_1` of a `with torch.autocast(..., enabled=False)` block, as Hugging
    Face's rotary embeddings write it). Its tensor constants (`_tensor_constant1`) can be
    plain attributes (torch 2.11 leaves them so), which `module.to` does not move. So every
    GraphModule inside `module` has its CPU device arguments and constants moved, and a CPU
    device that is left (where the rewrite cannot reach) is a PlanError naming `region`, the
    node and its op: on the GPU it would fail the first step with "Tensor device mismatch".
    To the CPU, nothing changes."""
    module = module.to(device)
    if device.type == "cpu":
        return module
    graphs = {path: m for path, m in module.named_modules() if isinstance(m, fx.GraphModule)}
    for gm in graphs.values():
        _move_constants(gm, device)
        if _retarget(gm.graph, device):
            gm.recompile()
    _check_retargeted(graphs, device, region)
    return module


_AUTOCAST = torch.ops.higher_order.wrap_with_autocast


def _retarget(graph: fx.Graph, device: torch.device) -> bool:
    """Every CPU `torch.device` in the nodes' arguments made `device`, and an autocast block
    captured for the CPU (`wrap_with_autocast('cpu', ...)`, an HF rotary embedding's
    `enabled=False` block) made one for `device`'s type, so it turns off the autocast that
    is on there; True if anything changed. (The meta device has no autocast: kept.)"""
    def move(a):
        return device if isinstance(a, torch.device) and a.type == "cpu" else a

    changed = False
    for node in graph.nodes:
        args, kwargs = (fx.node.map_aggregate(node.args, move),
                        fx.node.map_aggregate(node.kwargs, move))
        if node.target is _AUTOCAST and args[0] == "cpu" and device.type != "meta":
            args = (device.type, *args[1:])
        if args != node.args or kwargs != node.kwargs:
            node.args, node.kwargs, changed = args, kwargs, True
    return changed


def _move_constants(gm: fx.GraphModule, device: torch.device) -> None:
    """The CPU tensors the graph reads by `get_attr` that are plain attributes (export's
    `_tensor_constant0`), not parameters or buffers, moved to `device`."""
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        owner, _, leaf = node.target.rpartition(".")
        holder = gm.get_submodule(owner) if owner else gm
        value = vars(holder).get(leaf)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            setattr(holder, leaf, value.to(device))


_CPU = repr(torch.device("cpu"))   # device(type='cpu'): how FX writes it into the code


def _check_retargeted(graphs: dict[str, fx.GraphModule], device: torch.device,
                      region: str) -> None:
    """No CPU device left in any node's arguments. FX writes every argument into the
    forward's code by its `repr`, so the text is read, not a walk like `_retarget`'s: a
    device the rewrite missed (inside a set, say) still shows."""
    for path, gm in graphs.items():
        for node in gm.graph.nodes:
            if _CPU in repr((node.args, node.kwargs)):
                where = f"graph {path}" if path else "the top-level graph"
                op = getattr(node.target, "__name__", node.target)   # arange.default
                raise PlanError(
                    f"region {region or '?'}: node {node.name} ({node.op} {op}) in "
                    f"{where} still says device=cpu after retargeting to {device}, and would "
                    "fail there with a device mismatch; pass the device as a plain argument "
                    "(`device=x.device`, not inside another object) so the retargeting "
                    "reaches it, or capture the model on the device it trains on")


def direct_calls(module: nn.Module) -> nn.Module:
    """Make a region GraphModule call its submodules by one attribute each: FX's code
    reaches `model.layers.0.0` through four `nn.Module.__getattr__` lookups per call, which
    cost a half-MLP stage 35 us of its 1.2 ms forward on this CPU (3%). Each called
    submodule is also registered under a flat name on the root (the same object: its
    parameters, hooks and bindings are untouched) and the code recompiled to use it."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return module
    changed = False
    for node in graph.nodes:
        if node.op == "call_module" and "." in node.target:
            flat = "_call_" + node.target.replace(".", "_")
            if not hasattr(module, flat):
                module.add_module(flat, module.get_submodule(node.target))
            node.target = flat
            changed = True
    if changed:
        module.recompile()
    return module


def bind_params(module: nn.Module, params: dict[str, nn.Parameter], aliases: dict[str, str],
                prefix: str = "model.") -> None:
    """Point every parameter of a region module at the device's tensor of the same name."""
    for qual, _ in list(module.named_parameters(remove_duplicate=False)):
        canonical = aliases.get(qual.removeprefix(prefix), qual.removeprefix(prefix))
        if canonical not in params:
            continue
        owner, _, leaf = qual.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        setattr(sub, leaf, params[canonical])
