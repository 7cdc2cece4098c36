"""torch.distributed.pipelining's split points read as stage tags: `pipe_split()`, `split_spec`.

A model written for PyTorch's pipelining marks its stage boundaries in `forward` with
`pipe_split()` (the no-op operator `pippy::_pipe_split`), or is given
`split_spec={"layers.4": SplitPoint.BEGINNING}` by the caller. Both mean: what runs from
this point on belongs to the next stage. Capture records each point as a node in trace
order (torch.export keeps the operator; under torch.fx `marking_splits` adds it), and
`number_stages` then gives every operation after the k-th point that computes with the
weights the tag `PP=k` and drops the markers, so the regions are those of the equivalent
`pn.annotate` (operations on parameters of the root module, as in torch's own model zoo,
go with the stage they run in; masks and rotary tables are recomputed where read).
A `split_spec` is applied by hooks around the named modules for the time of one capture
(`split_points`), so the model is left as it was.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Mapping

import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode

from piper_nb.errors import PlanError

__all__ = ["POINTS", "counting_splits", "has_split_point", "marking_splits",
           "normalize_split_spec", "number_stages", "split_points"]

POINTS = ("beginning", "end")
_MARK = "_pn_split_point"       # set on a module a split_spec names, for one capture


def _op():
    """`torch.ops.pippy._pipe_split.default`, registered by importing torch's pipelining."""
    import torch.distributed.pipelining  # noqa: F401 - registers pippy::_pipe_split
    return torch.ops.pippy._pipe_split.default


def _is_split(target) -> bool:
    """The operator itself or its overload packet (`torch.ops.pippy._pipe_split`)."""
    schema = getattr(target, "_schema", None)
    name = schema.name if schema is not None else getattr(target, "_qualified_op_name", None)
    return name == "pippy::_pipe_split"


def normalize_split_spec(model: nn.Module, split_spec: Mapping | None) -> dict[str, str]:
    """{module path: "beginning" | "end"} from torch's SplitPoint values or those strings;
    PlanError for a path the model does not have or a point of another kind."""
    if not split_spec:
        return {}
    if not isinstance(split_spec, Mapping):
        raise PlanError(f"split_spec must map module paths to SplitPoint.BEGINNING or "
                        f".END, got {type(split_spec).__name__}")
    names = dict(model.named_modules())
    out = {}
    for path, point in split_spec.items():
        if path not in names or path == "":
            near = [n for n in names if n and n.rsplit(".", 1)[-1] == path.rsplit(".", 1)[-1]]
            hint = f" (did you mean {', '.join(near[:3])}?)" if near else ""
            raise PlanError(f"split_spec: {type(model).__name__} has no submodule "
                            f"{path!r}{hint}; name a module of model.named_modules()")
        kind = str(getattr(point, "name", point)).lower()
        if kind not in POINTS:
            raise PlanError(f"split_spec[{path!r}] = {point!r}: use SplitPoint.BEGINNING or "
                            "SplitPoint.END (torch.distributed.pipelining), or 'beginning'/'end'")
        out[path] = kind
    return out


@contextlib.contextmanager
def split_points(model: nn.Module, split_spec: Mapping[str, str]) -> Iterator[None]:
    """Hooks calling `pipe_split()` before (beginning) or after (end) each named module,
    removed on exit; the modules are marked so torch.fx traces through them."""
    if not split_spec:
        yield
        return
    op, handles, marked = _op(), [], []
    try:
        for path, kind in split_spec.items():
            m = model.get_submodule(path)
            if kind == "beginning":
                handles.append(m.register_forward_pre_hook(lambda *_: op()))
            else:
                handles.append(m.register_forward_hook(lambda *_: op()))
            setattr(m, _MARK, kind)
            marked.append(m)
        yield
    finally:
        for h in handles:
            h.remove()
        for m in marked:
            delattr(m, _MARK)


def has_split_point(m: nn.Module) -> bool:
    return hasattr(m, _MARK)


class _Marks(TorchFunctionMode):
    """Under torch.fx, `pipe_split()` runs eagerly and leaves no node: add one."""

    def __init__(self, tracer: fx.Tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_split(func):
            self.tracer.create_node("call_function", _op(), (), {})
            return None
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def marking_splits(tracer: fx.Tracer) -> Iterator[None]:
    """Record `pipe_split()` calls as nodes while `tracer` traces (only when torch's
    pipelining is imported: nothing else can call it)."""
    if "torch.distributed.pipelining" not in sys.modules:
        yield
        return
    with _Marks(tracer):
        yield


class _Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _is_split(func):
            self.calls += 1
            return None
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_splits() -> Iterator[_Count]:
    """Count the `pipe_split()` calls of an eager run (`.calls`)."""
    with _Count() as count:
        yield count


def number_stages(graph: fx.Graph, root: nn.Module) -> int:
    """Tag each operation after the k-th split point that computes with a parameter, or
    with what one computed, `PP=k` (in `pn_tags`, beside any `pn.region` tags), and erase
    the points; returns how many there were. What depends only on the batch, buffers and
    constants (masks, rotary tables, position ids) stays untagged, so it is recomputed in
    each stage that reads it, as under the equivalent annotation."""
    nodes = list(graph.nodes)
    if not any(n.op == "call_function" and _is_split(n.target) for n in nodes):
        return 0
    k, weighted = 0, set()
    for n in nodes:
        if n.op == "call_function" and _is_split(n.target):
            k += 1
            graph.erase_node(n)
            continue
        if _reads_parameters(n, root) or any(a in weighted for a in n.all_input_nodes):
            weighted.add(n)
        if n.op in ("call_function", "call_method", "call_module") and n in weighted:
            tags = n.meta.get("pn_tags") or {}
            if "PP" in tags and tags["PP"] != k:
                raise PlanError(f"operation {n.name} is in pn.region('PP', {tags['PP']}) but "
                                f"after {k} pipe_split() calls: mark the stages one way, "
                                "pipe_split() or pn.region('PP')")
            n.meta["pn_tags"] = {**tags, "PP": k}
            n.meta["pn_split"] = k
    return k


def _reads_parameters(n: fx.Node, root: nn.Module) -> bool:
    if n.op == "get_attr":
        try:
            return isinstance(root.get_parameter(str(n.target)), nn.Parameter)
        except AttributeError:
            return False
    if n.op == "call_module":
        return any(True for _ in root.get_submodule(str(n.target)).parameters())
    return False
