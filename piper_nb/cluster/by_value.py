"""Settings and callables as plain text, by value: what a checkpoint records of the optimizer
and scheduler factories a run was given, so that a resume can say what changed.

`flatten(obj)` turns a value into a flat `{key: text}` map. Numbers, strings and containers
are their `repr`; a `functools.partial` is its function, positional arguments and keywords
(`lr` below it); a dataclass is its fields; a class or builtin its qualified name. A function
or lambda is its code (a hash of `co_code` and the names it uses, and its constants, nested
code objects included), its defaults, the values its closure cells hold and the numbers or
strings it reads from module globals (a notebook's `lr = 0.01`). So the same lambda in a
new process gives the same text, and a lambda whose learning rate changed does not. No text
holds a memory address (`<function <lambda> at 0x7f...>`): such texts are what made a
legitimate resume look changed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import types

import torch

__all__ = ["flatten", "join", "no_address"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_DEPTH = 4   # nesting below which an object is its type's name only


def no_address(text: str) -> str:
    """`text` without memory addresses (` at 0x7f3a...`)."""
    return _ADDRESS.sub("", text)


def join(key: str, name: str) -> str:
    return f"{key}.{name}" if key else name


def flatten(obj, key: str = "") -> dict[str, str]:
    """`obj` as `{key: text}`, by value (see the module's docstring)."""
    out: dict[str, str] = {}
    _flat(obj, key, out, 0)
    return out


def _name(obj) -> str:
    module = getattr(obj, "__module__", None) or "?"
    return f"{module}.{getattr(obj, '__qualname__', None) or type(obj).__qualname__}"


def _flat(obj, key: str, out: dict, depth: int) -> None:
    if isinstance(obj, _SCALARS) or isinstance(obj, (torch.dtype, torch.device)):
        out[key] = repr(obj) if isinstance(obj, _SCALARS) else str(obj)
    elif isinstance(obj, torch.Tensor):
        values = f" {obj.tolist()}" if obj.numel() <= 16 and obj.device.type != "meta" else ""
        out[key] = f"tensor{list(obj.shape)} {obj.dtype}{values}"
    elif isinstance(obj, (list, tuple)) and all(isinstance(v, _SCALARS) for v in obj):
        out[key] = repr(obj)
    elif depth >= _DEPTH or isinstance(obj, (torch.nn.Module, types.ModuleType)):
        out[key] = _name(obj) if isinstance(obj, type) else type(obj).__qualname__
    elif isinstance(obj, (list, tuple)):
        out[key] = f"{type(obj).__name__} of {len(obj)}"
        for i, v in enumerate(obj):
            _flat(v, f"{key}[{i}]", out, depth + 1)
    elif isinstance(obj, dict):
        out[key] = f"dict of {len(obj)}"
        for k in sorted(obj, key=repr):
            _flat(obj[k], join(key, str(k)), out, depth + 1)
    elif isinstance(obj, functools.partial):
        out[key] = "partial"
        _flat(obj.func, join(key, "func"), out, depth + 1)
        for i, a in enumerate(obj.args):
            _flat(a, f"{key}[{i}]", out, depth + 1)
        for k, v in sorted(obj.keywords.items()):
            _flat(v, join(key, k), out, depth + 1)
    elif isinstance(obj, types.MethodType):
        _flat(obj.__func__, key, out, depth)
        _flat(obj.__self__, join(key, "self"), out, depth + 1)
    elif isinstance(obj, types.FunctionType):
        _function(obj, key, out, depth)
    elif isinstance(obj, (type, types.BuiltinFunctionType)) or (
            callable(obj) and not hasattr(obj, "__dict__")):
        out[key] = _name(obj)
    elif dataclasses.is_dataclass(obj):
        out[key] = _name(type(obj))
        for f in dataclasses.fields(obj):
            _flat(getattr(obj, f.name), join(key, f.name), out, depth + 1)
    elif hasattr(obj, "__dict__"):
        out[key] = _name(type(obj))
        for k, v in sorted(vars(obj).items()):
            if not k.startswith("_"):
                _flat(v, join(key, k), out, depth + 1)
    else:
        out[key] = no_address(repr(obj))


def _function(fn: types.FunctionType, key: str, out: dict, depth: int) -> None:
    """A function by its code, defaults, closure values and the scalar globals it reads."""
    out[key] = f"function {_name(fn)}"
    label = join(key, fn.__name__)
    _code(fn.__code__, label, out)
    if fn.__defaults__:
        _flat(fn.__defaults__, f"{label} defaults", out, depth + 1)
    for k, v in sorted((fn.__kwdefaults__ or {}).items()):
        _flat(v, f"{label} default {k}", out, depth + 1)
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
        try:
            value = cell.cell_contents
        except ValueError:   # a cell not yet filled
            value = "<empty cell>"
        _flat(value, join(label, name), out, depth + 1)
    for name in sorted(_global_names(fn.__code__)):
        value = fn.__globals__.get(name)
        if isinstance(value, _SCALARS) and value is not None:
            out[join(label, name)] = repr(value)


def _code(code: types.CodeType, label: str, out: dict) -> None:
    """The code's instructions and names (hashed) and its constants, nested code in turn."""
    h = hashlib.sha256(code.co_code)
    for names in (code.co_names, code.co_varnames, code.co_freevars):
        h.update(repr(names).encode())
    out[f"{label} code"] = h.hexdigest()[:16]
    consts = tuple(c for c in code.co_consts if not isinstance(c, types.CodeType))
    out[f"{label} constants"] = no_address(repr(consts))
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code(c, join(label, c.co_name), out)


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _global_names(c)
    return names
