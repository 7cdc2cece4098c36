"""Custom `torch.autograd.Function`s in a captured model: kept whole, backward included.

Tracing a model that calls `MyFn.apply(x)` would record only the operations of
`MyFn.forward`: the region would then train with autograd's gradient of those operations,
not `MyFn.backward`'s (a straight-through rounding would get zero gradient, silently).
Under torch.fx, `keeping_functions(tracer)` records the call itself instead: a node calling
`apply_function(key, *args)`, which runs `MyFn.apply` when the region runs, so its backward
is the one autograd uses. The classes are kept by key (`FUNCTIONS`, filled while tracing and
by `register` in every worker, which gets them with the plan's bundle).

torch.export (non-strict) would trace through `forward` and keep no backward. So while it
runs (`exporting_functions`), a Function applied to tensors is one opaque op,
`piper_nb::apply_function(key, call, tensors)`, whose fake kernel runs the Function's
forward for the output shapes; right after the export, `keep_exported_calls` turns each such
op back into the same `apply_function(key, *args)` node the fx tracer makes, with the
call's own non-tensor arguments. Functions that torch itself applies (its own
checkpointing, for instance) are traced through, as the model ran them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from piper_nb.errors import PlanError

__all__ = ["FUNCTIONS", "apply_function", "keeping_functions", "exporting_functions",
           "keep_exported_calls", "register", "function_key"]

FUNCTIONS: dict[str, type] = {}     # key -> the autograd.Function class it names

_APPLY = torch.autograd.Function.__dict__["apply"]   # the classmethod, as torch defines it


def function_key(cls: type) -> str:
    """The key a Function is recorded under: its qualified name (and identity when two
    classes share one, as Functions defined in a loop or a notebook cell may)."""
    key = f"{cls.__module__}.{cls.__qualname__}"
    known = FUNCTIONS.get(key)
    return key if known is None or known is cls else f"{key}#{id(cls):x}"


def apply_function(key: str, *args, **kwargs):
    """What a captured region calls where the model called `FUNCTIONS[key].apply`."""
    cls = FUNCTIONS.get(key)
    if cls is None:
        raise RuntimeError(f"the region calls torch.autograd.Function {key}, which this process "
                           "was not given (it travels with the plan's bundle)")
    return cls.apply(*args, **kwargs)


def register(functions: dict[str, type]) -> None:
    """Make the Functions a capture recorded callable here (a worker, after loading)."""
    FUNCTIONS.update(functions)


@contextlib.contextmanager
def keeping_functions(tracer: fx.Tracer) -> Iterator[dict[str, type]]:
    """While `tracer` traces: a Function applied to traced values becomes one call node
    (`apply_function`); yields the Functions met, by key."""
    met: dict[str, type] = {}

    def apply(cls, *args, **kwargs):
        if any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            key = function_key(cls)
            FUNCTIONS[key] = met[key] = cls
            return tracer.create_proxy("call_function", apply_function, (key, *args), kwargs)
        return _APPLY.__func__(cls, *args, **kwargs)
    with _applying(apply):
        yield met


_CALLS: dict[int, tuple[str, pytree.TreeSpec, tuple]] = {}   # an export's calls, by id
_SINGLE: dict[int, bool] = {}   # call id -> its Function returned one tensor, not a tuple
_IDS = itertools.count()


_SLOT = object()   # where a tensor goes among a call's leaves


@torch.library.custom_op("piper_nb::apply_function", mutates_args=())
def _apply_op(key: str, call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One custom Function call as torch.export sees it (see the module docstring): only
    its fake kernel runs. Run for real, it would train without the Function's backward."""
    raise RuntimeError(f"piper_nb::apply_function ({key}) ran outside torch.export: the "
                       "capture left it in a region instead of calling the Function")


@_apply_op.register_fake
def _(key: str, call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in _run(call, tensors)]


def _run(call: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The Function's outputs for `call` given its tensors (its forward, without autograd)."""
    key, spec, consts = _CALLS[call]
    args, kwargs = pytree.tree_unflatten(_merge(tensors, consts), spec)
    with torch.no_grad():
        out = _APPLY.__func__(FUNCTIONS[key], *args, **kwargs)
    _SINGLE[call] = isinstance(out, torch.Tensor)
    return [out] if _SINGLE[call] else list(out)


def _merge(tensors, consts: tuple) -> list:
    """The call's leaves: `consts` with its `_SLOT`s filled by `tensors` in order."""
    it = iter(tensors)
    return [next(it) if c is _SLOT else c for c in consts]


@contextlib.contextmanager
def exporting_functions() -> Iterator[dict[str, type]]:
    """While torch.export runs a forward: each custom Function applied to tensors is one
    `piper_nb::apply_function` op (its forward run for shapes only); yields the Functions
    met, by key. `keep_exported_calls` must then turn the ops into calls."""
    met: dict[str, type] = {}
    _CALLS.clear()
    _SINGLE.clear()

    def apply(cls, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        if cls.__module__.startswith("torch.") or not tensors:
            return _APPLY.__func__(cls, *args, **kwargs)
        key = function_key(cls)
        FUNCTIONS[key] = met[key] = cls
        call = next(_IDS)
        _CALLS[call] = (key, spec, tuple(_SLOT if isinstance(x, torch.Tensor) else x
                                         for x in leaves))
        outs = torch.ops.piper_nb.apply_function(key, call, tensors)
        return outs[0] if _SINGLE[call] else tuple(outs)
    with _applying(apply):
        yield met


def keep_exported_calls(gm: fx.GraphModule, name: str) -> None:
    """Every `piper_nb::apply_function` op of an export made the `apply_function(key,
    *args, **kwargs)` call it stands for (the node's metadata kept), so the region runs the
    Function, backward included. One inside a nested graph (a `torch.autocast` block, which
    export makes a higher-order op whose autograd does not run the Function's backward) is
    a PlanError naming it, not a silently different gradient."""
    for path, sub in gm.named_modules():
        if path and isinstance(sub, fx.GraphModule):
            op = torch.ops.piper_nb.apply_function.default
            key = next((n.args[0] for n in sub.graph.nodes if n.target is op), None)
            if key is not None:
                raise PlanError(
                    f"{name} applies the custom torch.autograd.Function {key} inside a "
                    f"`torch.autocast` block (export's {path}), where its backward would not "
                    "run: apply it outside the block, or capture with torch.fx "
                    "(capture='fx', with an (inputs, targets) batch)")
    _keep_calls(gm.graph)


def _keep_calls(graph: fx.Graph) -> bool:
    """`keep_exported_calls` on one graph; True if it changed."""
    op, changed = torch.ops.piper_nb.apply_function.default, False
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not op:
            continue
        key, call, tensors = node.args
        _, spec, consts = _CALLS[call]
        single = _SINGLE[call]
        args, kwargs = pytree.tree_unflatten(_merge(tensors, consts), spec)
        with graph.inserting_before(node):
            new = graph.call_function(apply_function, (key, *args), kwargs)
        new.meta = dict(node.meta)
        if single:
            for user in list(node.users):   # getitem(node, 0): the one output
                new.meta["val"] = user.meta.get("val")
                user.replace_all_uses_with(new)
                graph.erase_node(user)
        else:
            node.replace_all_uses_with(new)
        graph.erase_node(node)
        changed = True
    return changed


@contextlib.contextmanager
def _applying(apply) -> Iterator[None]:
    """`torch.autograd.Function.apply` replaced by `apply` (a classmethod's function) for the
    block, torch's own put back after it, whatever happens."""
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY
