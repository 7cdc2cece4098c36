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
from piper_nb.errors import PlanError

__all__ = ["Bundle", "make_bundle", "load_bundle", "bind_params", "direct_calls",
           "param_aliases", "to_device"]


@dataclass
class Bundle:
    plan: object                        # Plan with dag/program/capture dropped
    modules: tuple[nn.Module, ...]      # one GraphModule per region
    init: dict[str, torch.Tensor]       # canonical name -> initial value
    aliases: dict[str, str]             # every parameter name -> canonical name


def param_aliases(model: nn.Module) -> dict[str, str]:
    """Every parameter path of `model` -> the canonical (first) name of that tensor."""
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


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


def to_device(module: nn.Module, device: torch.device) -> nn.Module:
    """`module.to(device)`, and in a region graph the devices the capture wrote into its
    ops (torch.export records `arange(..., device=cpu)`, `x.to(cpu)`) rewritten to
    `device`, so a region captured on the CPU runs on a GPU."""
    module = module.to(device)
    graph = getattr(module, "graph", None)
    if graph is None or device.type == "cpu":
        return module
    def move(a):
        return device if isinstance(a, torch.device) and a.type == "cpu" else a

    changed = False
    for node in graph.nodes:
        if node.op == "call_function":
            args, kwargs = fx.node.map_aggregate(node.args, move), fx.node.map_aggregate(
                node.kwargs, move)
            if args != node.args or kwargs != node.kwargs:
                node.args, node.kwargs, changed = args, kwargs, True
    if changed:
        module.recompile()
    return module


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
