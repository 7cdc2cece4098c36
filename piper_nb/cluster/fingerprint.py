"""What wrote a checkpoint, as plain data, and what differs from the run resuming it.

`fingerprint(plan, spec)` records four sections, each JSON-able text and nothing pickled:

- `model`: per region (`PP=0`), its captured ops in order, each as `module.path: what` (a
  leaf module with its settings, `layers.1.1: GELU(approximate='none')`, `Dropout(p=0.1,
  inplace=False)`; a function or method with its constant arguments), and the parameters it
  holds with their shapes and dtypes;
- `plan`: the world, microbatches, precision, each directive of the program, a hash of the
  parameter layout (which `weights_only` needs unchanged) and a hash of the whole compiled
  plan;
- `optimizer` and `scheduler`: their factories by value (`cluster.by_value`): a partial's
  function and keywords, a lambda's code, constants and closure values, never its address.

`differences(old, new)` says, section by section, what changed: the first differing op of a
region with its module path, a setting's old and new value. The checkpoint resumes only
when it says nothing (`cluster.checkpoint`).
"""

from __future__ import annotations

import hashlib
import json

import torch.fx as fx

from piper_nb.cluster.by_value import flatten, join, no_address

__all__ = ["fingerprint", "differences", "plan_fingerprint", "SECTIONS"]

SECTIONS = ("model", "plan", "optimizer", "scheduler")
_SHOWN = 3   # differences named per section


def plan_fingerprint(plan) -> str:
    """sha256 of what decides where state lives: the plan's JSON without measured sizes."""
    obj = json.loads(plan.to_json())
    obj.pop("saved", None)
    return _sha(obj)


def _sha(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def fingerprint(plan, spec) -> dict:
    """The model, plan, optimizer and scheduler a run trains with, as plain data."""
    return {"model": model_record(plan), "plan": plan_record(plan),
            "optimizer": optimizer_record(spec), "scheduler": flatten(spec.scheduler)}


# -- the model ------------------------------------------------------------------------
def model_record(plan) -> dict[str, dict[str, list[str]]]:
    """Region name -> {"ops": [...], "params": [...]} of the captured model."""
    cap = plan.capture
    out = {}
    for info, gm in zip(cap.regions, cap.modules, strict=True):
        params = [f"{n} {list(plan.params[n][0])} {plan.params[n][1]}" if n in plan.params
                  else n for n in info.params]
        out[info.name] = {"ops": [t for n in gm.graph.nodes if (t := op_text(gm, n))],
                          "params": params}
    return out


def _path(text: str) -> str:
    """A module path of the model (`model` for the top level)."""
    for prefix in ("model.", "L['self']."):
        text = text.removeprefix(prefix)
    return "model" if text in ("", "model", "L['self']") else text


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "model"
    last = list(stack.values())[-1]
    return _path(str(last[0] if isinstance(last, tuple) else last))


def _arg(a) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg(v)}" for k, v in a.items()) + "}"
    return no_address(repr(a) if not callable(a) else getattr(a, "__qualname__", repr(a)))


def _target(t) -> str:
    if isinstance(t, str):
        return t
    name = getattr(t, "__name__", None)   # `relu`, not `_VariableFunctionsClass.relu`
    return str(t) if name is None else name


def whole_model(plan) -> dict:
    """The model as any plan of it holds it, for a resume on another plan (a DCP checkpoint):
    every region's ops in order however the regions are cut and placed, and the tensor-parallel
    layout, which rewrites the ops (so ops are compared only between equal layouts)."""
    cap = plan.capture
    ops = [t for gm in cap.modules for n in gm.graph.nodes if (t := op_text(gm, n))]
    return {"ops": ops, "tp": sorted([n, *v] for n, v in plan.tp_params.items())}


def model_changes(old: dict, new: dict, old_whole: dict, new_whole: dict) -> list[str]:
    """How the model of fingerprint `old` (and `whole_model` record `old_whole`) differs
    from the new one's, when another plan may have written it: region by region where
    both cut the model alike, else op by op; nothing where tensor parallelism lays it
    out otherwise (its rewrite changes the ops; the parameters' names and shapes are
    checked as they load)."""
    if not old_whole or old_whole.get("tp") != new_whole["tp"]:
        return []
    if list(old.get("model", {})) == list(new["model"]):
        return [c for c in differences(old, new) if c.startswith("the model")]
    if old_whole["ops"] == new_whole["ops"]:
        return []
    return [f"the model changed ({_first_change(old_whole['ops'], new_whole['ops'], 'op')})"]


def op_text(gm: fx.GraphModule, node: fx.Node) -> str | None:
    """One op as `module.path: what`, by value; None for inputs and the output."""
    if node.op in ("placeholder", "output"):
        return None
    if node.op == "call_module":
        try:
            mod = gm.get_submodule(node.target)
            what = f"{type(mod).__name__}({no_address(mod.extra_repr())})"
        except AttributeError:
            what = "module"
        return f"{_path(node.target)}: {what}"
    args = ", ".join([*(_arg(a) for a in node.args),
                      *(f"{k}={_arg(v)}" for k, v in node.kwargs.items())])
    if node.op == "get_attr":
        return f"{_where(node)}: {_path(node.target)}"
    dot = "." if node.op == "call_method" else ""
    return f"{_where(node)}: {dot}{_target(node.target)}({args})"


# -- the plan and the optimizer ---------------------------------------------------------
def plan_record(plan) -> dict[str, str]:
    """The plan's settings, each directive, and hashes of its parameter layout and of the
    whole compiled plan."""
    obj = json.loads(plan.to_json())
    layout = {k: obj.get(k) for k in ("world", "params", "buckets", "tp_groups", "tp_params",
                                      "pieces", "frozen")}
    out = {k: str(getattr(plan, k)) for k in ("world", "microbatches", "batch_size",
                                              "precision", "loss_mean", "clip_grad_norm")}
    for i, (_, d) in enumerate(plan.program or ()):
        out[f"directive {i}"] = json.dumps(d.to_json(), sort_keys=True)
    out["parameter layout"] = _sha(layout)[:16]
    out["compiled plan"] = plan_fingerprint(plan)[:16]
    return out


def optimizer_record(spec) -> dict[str, str]:
    """The factory by value, then each parameter group's patterns and settings."""
    out = flatten(spec.factory)
    for i, (patterns, opts) in enumerate(spec.groups):
        key = f"param_groups[{i}]"
        out[key] = repr(list(patterns))
        for k, v in opts:
            out.update(flatten(v, join(key, k)))
    return out


# -- what differs ---------------------------------------------------------------------
def differences(old: dict, new: dict) -> list[str]:
    """One line per section that differs, naming what (empty: the same run)."""
    lines = []
    old_m, new_m = old.get("model", {}), new.get("model", {})
    if list(old_m) != list(new_m):
        lines.append(f"the model's regions changed ({', '.join(old_m)} -> {', '.join(new_m)})")
    else:
        for name, rec in new_m.items():
            for part in ("ops", "params"):
                if old_m[name][part] != rec[part]:
                    noun = "op" if part == "ops" else "parameter"
                    lines.append(f"the model's region {name} changed "
                                 f"({_first_change(old_m[name][part], rec[part], noun)})")
                    break
    for section in SECTIONS[1:]:
        changed = _changed(old.get(section, {}), new.get(section, {}))
        if section == "plan" and len(changed) > 1:
            changed = [c for c in changed if not c.startswith("compiled plan")]
        if changed:
            more = f", and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
            lines.append(f"the {section} changed: {'; '.join(changed[:_SHOWN])}{more}")
    return lines


def _first_change(old: list[str], new: list[str], noun: str) -> str:
    """The first differing op (or parameter) of two lists, with its module path."""
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            pa, _, wa = a.partition(": ")
            pb, _, wb = b.partition(": ")
            if pa == pb and wb:
                return f"{wa} -> {wb} at {pa}, {noun} {i}"
            return f"{noun} {i}: {a} -> {b}"
    if len(old) > len(new):
        return f"{len(old) - len(new)} {noun}s fewer, the first gone: {old[len(new)]}"
    return f"{len(new) - len(old)} {noun}s more, the first new: {new[len(old)]}"


def _changed(old: dict[str, str], new: dict[str, str]) -> list[str]:
    keys = list(new) + [k for k in old if k not in new]
    return [f"{k or 'factory'} {old.get(k, '(none)')} -> {new.get(k, '(none)')}"
            for k in keys if old.get(k) != new.get(k)]
