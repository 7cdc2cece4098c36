"""Custom `torch.autograd.Function`s in a captured model: kept whole, backward included.

Tracing a model that calls `MyFn.apply(x)` would record only the operations of
`MyFn.forward`: the region would then train with autograd's gradient of those operations,
not `MyFn.backward`'s (a straight-through rounding would get zero gradient, silently).
Under torch.fx, `keeping_functions(tracer)` records the call itself instead: a node calling
`apply_function(key, *args)`, which runs `MyFn.apply` when the region runs, so its backward
is the one autograd uses. The classes are kept by key (`FUNCTIONS`, filled while tracing and
by `register` in every worker, which gets them with the plan's bundle).

torch.export (non-strict) traces through `forward` and keeps no backward, so a capture by
export that meets a custom Function is a `PlanError` naming it (`seen_functions`).
Functions that torch itself applies (its own checkpointing, for instance) are treated the
same way: a region runs them as the model did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx

__all__ = ["FUNCTIONS", "apply_function", "keeping_functions", "seen_functions", "register",
           "function_key"]

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


@contextlib.contextmanager
def seen_functions() -> Iterator[list[type]]:
    """While a forward runs (torch.export's): the custom Functions it applies, in order."""
    seen: list[type] = []

    def apply(cls, *args, **kwargs):
        if not cls.__module__.startswith("torch.") and cls not in seen:
            seen.append(cls)
        return _APPLY.__func__(cls, *args, **kwargs)
    with _applying(apply):
        yield seen


@contextlib.contextmanager
def _applying(apply) -> Iterator[None]:
    """`torch.autograd.Function.apply` replaced by `apply` (a classmethod's function) for the
    block, torch's own put back after it, whatever happens."""
    torch.autograd.Function.apply = classmethod(apply)
    try:
        yield
    finally:
        torch.autograd.Function.apply = _APPLY
