"""The two front ends that turn model + loss into one graph: torch.fx and torch.export.

fx symbolic tracing is fast and serves the models written for it (and `pn.region` scopes);
`torch.export` (non-strict, `capture.export`) runs the real forward on the example batch
and serves models whose Python branches fx cannot follow, Hugging Face models among them.
Each front end also says how to read its graph: the module path a node ran in, and which
nodes compute sizes rather than tensors. `capture="auto"` (the default) tries fx first and
falls back to export, so a model fx handles is captured as before, in milliseconds.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn
from torch.nn.utils import parametrize

from piper_nb.capture.batch import PAIR
from piper_nb.capture.export import export_graph, export_module_path, export_size_nodes
from piper_nb.capture.functions import keeping_functions
from piper_nb.capture.loss import compute_loss
from piper_nb.capture.pipe_split import has_split_point, marking_splits, number_stages
from piper_nb.capture.region import current_region_tags, tracing_scope
from piper_nb.errors import PlanError

__all__ = ["FrontEnd", "front_end", "METHODS"]


_TOKENS = itertools.count()
_RECORDED: dict[int, tuple[str, ...]] = {}   # wrapper token -> its outputs' names


class _WithLoss(nn.Module):
    """model + loss on an (inputs, targets) batch: what the graph computes. The graph returns
    `LossParts.flat()`: the loss, then the count ("global") and the metrics, whose names
    tracing records in `outputs`."""

    def __init__(self, model: nn.Module, loss_fn: Callable, loss_mean: str):
        super().__init__()
        self.model = model
        self._loss_fn, self._loss_mean = loss_fn, loss_mean
        # what tracing records, kept outside the module: export traces a copy of it
        self._token = next(_TOKENS)

    @property
    def outputs(self) -> tuple[str, ...]:
        return _RECORDED.pop(self._token, ())

    def forward(self, inputs, targets):
        return self._flat({"inputs": inputs, "targets": targets})

    def _flat(self, batch: dict) -> tuple:
        parts = compute_loss(self.model, self._loss_fn, batch, self._loss_mean)
        _RECORDED[self._token] = parts.names()
        return parts.flat()


class _WithLossOnDict(_WithLoss):
    """model + loss on a dict batch (export flattens it into one input per key, in order)."""

    def forward(self, batch):
        return self._flat(batch)


class _Tracer(fx.Tracer):
    """fx's tracer, tagging each node with the `pn.region` it was made in. A module with
    parametrizations (`weight_norm`, `spectral_norm`) is traced through, not called as a
    leaf: its weight is then computed in the graph from the parametrization's parameters
    (`a.parametrizations.weight.original0`), which are what trains, as in one process, and
    the region holds no parametrized module (those pickle only through a state_dict)."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if parametrize.is_parametrized(m) or has_split_point(m):
            return False
        return super().is_leaf_module(m, qualname)

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta["pn_tags"] = current_region_tags()
        return node


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack), "") if stack else ""
    if node.op == "call_module":
        path = str(node.target)
    return path.removeprefix("model.").removeprefix("model") if path.startswith("model") else path


def _trace(root: nn.Module, name: str) -> tuple[fx.GraphModule, dict[str, type]]:
    """The traced graph and the custom autograd Functions kept in it (`capture.functions`)."""
    tracer = _Tracer()
    with tracing_scope(), keeping_functions(tracer) as functions, marking_splits(tracer):
        try:
            graph = tracer.trace(root)
            number_stages(graph, root)
        except PlanError:   # the model's own words (a loss of the wrong form)
            raise
        except Exception as err:  # fx raises many kinds; the user needs the reason
            raise PlanError(f"could not trace {name} with torch.fx: {err}. "
                            "Regions are found by tracing; avoid Python control flow on tensor "
                            "values inside forward(), or give pn.compile the batch so it can "
                            "capture by torch.export (capture='export')") from err
    return fx.GraphModule(root, graph), functions


@dataclass(frozen=True)
class FrontEnd:
    """A captured graph and how to read it: module path of a node, which nodes are sizes."""

    method: str
    gm: fx.GraphModule
    module_path: Callable[[fx.Node], str]
    size_nodes: Callable[[list[fx.Node]], set[fx.Node]]
    functions: dict = field(default_factory=dict)   # key -> autograd.Function class kept
    outputs: tuple[str, ...] = ()   # the graph's outputs after the loss (`LossParts.names`)


METHODS = ("auto", "fx", "export")


def front_end(model: nn.Module, loss_fn: Callable, example: dict | None,
              method: str, names: tuple[str, ...] = PAIR, loss_mean: str = "microbatch",
              stamped: bool = True) -> FrontEnd:
    """fx symbolic tracing (fast: the models written for it), or torch.export (any model
    whose forward runs on the example batch); "auto" tries fx, then export. A dict batch
    (`names` other than inputs, targets) is always exported; `stamped` lets the export
    stamp a stack of identical layers (`capture.stamp`)."""
    if method not in METHODS:
        raise PlanError(f"capture={method!r}: choose one of {', '.join(METHODS)}")
    name = type(model).__name__
    if names != PAIR:
        if method == "fx":
            raise PlanError("capture='fx' takes (inputs, targets) batches; a dict batch is "
                            "captured by torch.export (capture='auto' or 'export')")
        method = "export"
    if method != "export":
        try:
            root = _WithLoss(model, loss_fn, loss_mean)
            gm, functions = _trace(root, name)
            return FrontEnd("fx", gm, _module_path, _size_nodes, functions, root.outputs)
        except PlanError:
            if method == "fx" or example is None:
                raise
    if example is None:
        raise PlanError("capture='export' needs the example batch: pass it to spec.capture")
    root = (_WithLoss if names == PAIR else _WithLossOnDict)(model, loss_fn, loss_mean)
    gm, functions = export_graph(root, example, name, stamped)
    return FrontEnd("export", gm, export_module_path, export_size_nodes, functions,
                    root.outputs)


_SIZE_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})
_SIZE_ATTRS = frozenset({"shape", "ndim"})
_ARITH = frozenset({operator.getitem, operator.add, operator.sub, operator.mul,
                    operator.floordiv, operator.truediv, operator.mod, operator.neg, operator.pow})


def _size_nodes(nodes: list[fx.Node]) -> set[fx.Node]:
    """Nodes that surely compute sizes (ints, torch.Size), not tensors: `x.shape`,
    `x.size(-1)`, `x.shape[0] * 2`. When one crosses regions it is packed into a tensor."""
    out: set[fx.Node] = set()
    for n in nodes:
        if ((n.op == "call_method" and n.target in _SIZE_METHODS)
                or (n.op == "call_function" and n.target is getattr
                    and len(n.args) == 2 and n.args[1] in _SIZE_ATTRS)
                or (n.op == "call_function" and n.target in _ARITH and n.all_input_nodes
                    and all(a in out for a in n.all_input_nodes))):
            out.add(n)
    return out
