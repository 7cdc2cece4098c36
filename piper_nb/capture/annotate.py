"""Annotations: which tags each part of a model carries (`pn.annotate`, `cut_stages`).

`annotate(model, {"blocks.[0-1]": {"PP": 0}, "head": {"PP": 1}})` maps module paths,
with shell patterns (`blocks.*`, `blocks.[0-3]`), to tags. A module inherits the tags of
its parents; a child's own tags extend or override them; for one module, later entries
override earlier ones. `cut_stages` proposes an even pipeline cut by parameters or FLOPs.
A pattern ending in `[lo:hi]` tags experts lo..hi-1 of a stacked-experts module
(`capture.experts`): such a slice becomes a region of its own.
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from piper_nb.capture.batch import PAIR, Batch
from piper_nb.capture.experts import check_slices, expert_count, split_slice
from piper_nb.capture.pipe_split import normalize_split_spec
from piper_nb.errors import PlanError

__all__ = ["Spec", "annotate", "cut_stages", "pipeline_units", "derived"]


@dataclass(frozen=True, eq=False)
class Spec:
    """A model plus its annotations (immutable); captured into regions lazily, once per loss
    function, batch names and front end (`capture`; the captures are kept beside the value,
    in `derived(spec)`, for as long as the spec lives)."""

    model: nn.Module
    module_tags: Mapping[str, Mapping[str, int]]
    annotations: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    expert_slices: Mapping[str, tuple] = field(default_factory=dict)  # module -> (lo, hi, tags)
    split_spec: Mapping[str, str] = field(default_factory=dict)   # module -> beginning | end

    def __post_init__(self):
        for name in ("module_tags", "annotations"):
            frozen = MappingProxyType({k: MappingProxyType(dict(v))
                                       for k, v in getattr(self, name).items()})
            object.__setattr__(self, name, frozen)
        object.__setattr__(self, "expert_slices", MappingProxyType(dict(self.expert_slices)))
        object.__setattr__(self, "split_spec", MappingProxyType(dict(self.split_spec)))

    def tags_of(self, path: str) -> dict[str, int]:
        """Effective tags of module `path`: its ancestors' tags, extended by its own."""
        tags: dict[str, int] = {}
        parts = path.split(".") if path else []
        for i in range(len(parts) + 1):
            tags.update(self.module_tags.get(".".join(parts[:i]), {}))
        return tags

    def capture(self, loss_fn: Callable | None = None, example=None, method: str = "auto",
                loss_mean: str = "microbatch"):
        """The model cut into regions, made once per loss function, batch names, front end,
        the modules' train/eval modes and `loss_mean` (`capture.loss`), and under torch.export
        once per sample shapes too. `example`, a batch ((inputs, targets) or a dict), lets
        models torch.fx cannot trace be exported, and names the batch's tensors."""
        from piper_nb.capture.loss import resolve_loss
        from piper_nb.capture.split import capture_regions
        loss_fn = resolve_loss(self.model, loss_fn, "pn.compile")
        named = Batch.of(example) if example is not None else None   # pn.compile's: as it is
        names = tuple(named) if named is not None else PAIR
        bound = getattr(loss_fn, "__self__", None), getattr(loss_fn, "__func__", loss_fn)
        modes = tuple(m.training for m in self.model.modules())   # eval/train is traced in
        key = ("capture", id(bound[0]), id(bound[1]), method, names, modes, loss_mean)
        cache = derived(self)
        hit = cache.get(key)
        if (hit is not None and hit[1].samples is not None and named is not None
                and hit[1].samples != named.samples):
            key = (*key, named.samples)   # an export is specialised to its samples' shapes
            hit = cache.get(key)
        if hit is None or hit[0] is not bound[1]:   # the function kept alive: ids stay its own
            hit = cache[key] = (bound[1], capture_regions(self, loss_fn, named, method,
                                                          loss_mean))
        return hit[1]

    def __repr__(self) -> str:
        return f"Spec({type(self.model).__name__}, {dict(self.annotations)})"


_DERIVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def derived(spec: Spec) -> dict:
    """What is made from `spec` and kept while it lives (its captures, its bf16 copy): a
    cache beside the immutable value, never part of it."""
    return _DERIVED.setdefault(spec, {})


def _check_tags(where: str, tags: Any) -> dict[str, int]:
    if not isinstance(tags, Mapping):
        raise PlanError(f"annotate: tags for {where!r} must be a {{tag: index}} dict, got {tags!r}")
    for k, v in tags.items():
        if not isinstance(k, str) or k in ("PASS", "MB"):
            raise PlanError(f"annotate: {k!r} on {where!r} is not a free tag name "
                            "(PASS and MB are set by piper_nb)")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise PlanError(f"annotate: tag {k} on {where!r} must be a non-negative int, got {v!r}")
    return dict(tags)


def annotate(model: nn.Module, mapping: Mapping[str, Mapping[str, int]] | None = None, *,
             split_spec: Mapping | None = None) -> Spec:
    """Tag the modules of `model`; patterns match dotted module paths (fnmatch syntax).
    A model with no tags at all (no mapping, no `pn.region` or `pipe_split()` in its code)
    is one region, `PP=0`: plain data parallelism is `pn.replicate({}, devices)`.

    `split_spec` is torch.distributed.pipelining's: `{"layers.4": SplitPoint.BEGINNING}`
    starts a new stage where `layers.4` is called (`.END`: after it returns), as
    `pipe_split()` calls in `forward` do (`capture.pipe_split`); the stages are then the
    `PP` tags, so the mapping may not also set `PP`."""
    if not isinstance(model, nn.Module):
        raise PlanError(f"annotate expects an nn.Module, got {type(model).__name__}")
    points = normalize_split_spec(model, split_spec)
    mapping = dict(mapping or {})
    paths = [p for p, _ in model.named_modules() if p]
    module_tags: dict[str, dict[str, int]] = {}
    slices: dict[str, list] = {}
    for pattern, tags in mapping.items():
        tags = _check_tags(pattern, tags)
        cut = split_slice(pattern)
        hits = _hits(model, paths, cut[0] if cut else pattern)
        for p in hits:
            if cut is None:
                module_tags.setdefault(p, {}).update(tags)
            elif expert_count(model.get_submodule(p)) is None:
                raise PlanError(f"annotate: {pattern!r} slices {p}, which is not a stacked-experts "
                                "module (num_experts and parameters stacked along dim 0); "
                                "annotate the module without [lo:hi]")
            else:
                slices.setdefault(p, []).append((cut[1], cut[2], tags))
    expert = {p: check_slices(p, expert_count(model.get_submodule(p)), s)
              for p, s in slices.items()}
    if points and any("PP" in t for t in module_tags.values()):
        raise PlanError("annotate: split_spec cuts the stages and the mapping sets PP too; "
                        "mark the stages one way (split_spec, or PP tags)")
    return Spec(model=model, module_tags=module_tags, annotations=mapping, expert_slices=expert,
                split_spec=points)


def _hits(model: nn.Module, paths: list[str], pattern: str) -> list[str]:
    hits = [pattern] if pattern in paths or pattern == "" else [
        p for p in paths if fnmatch.fnmatchcase(p, pattern)]
    if not hits:
        near = ", ".join(paths[:12]) + (" ..." if len(paths) > 12 else "")
        raise PlanError(f"annotate: {pattern!r} matches no module of {type(model).__name__}; "
                        f"its modules are {near}")
    return hits


_LISTS = (nn.ModuleList, nn.Sequential)


def pipeline_units(model: nn.Module) -> list[str]:
    """The model's top-level children in order, ModuleLists/Sequentials expanded once.

    A model with no such list at its top level wraps its pipeline (Hugging Face's
    `LlamaForCausalLM` holds `model` and `lm_head`, and `model` holds `embed_tokens`, the
    `layers` list and `norm`): a child that holds a list, directly or deeper, is expanded
    the same way, so the units read `model.embed_tokens, model.layers.0, ..., lm_head`."""
    wrapped = not any(isinstance(c, _LISTS) for c in model.children())
    return _units(model, "", wrapped)


def _units(mod: nn.Module, prefix: str, descend: bool) -> list[str]:
    units = []
    for name, child in mod.named_children():
        path = prefix + name
        if isinstance(child, _LISTS):
            units.extend(f"{path}.{i}" for i, _ in enumerate(child))
        elif descend and _wraps_list(child):
            units.extend(_units(child, path + ".", True))
        else:
            units.append(path)
    return units


def _wraps_list(mod: nn.Module) -> bool:
    """`mod` holds a ModuleList/Sequential, directly or deeper."""
    return any(isinstance(c, _LISTS) or _wraps_list(c) for c in mod.children())


def _example_call(model: nn.Module, example) -> tuple[tuple, dict]:
    """How to run `model` once to count FLOPs: on the inputs of an (inputs, targets) batch,
    on an inputs tensor, on a dict batch less its labels; with no example, on the model's
    `example_batch` or (Hugging Face) `dummy_inputs`."""
    if example is None:
        if hasattr(model, "example_batch"):
            example = model.example_batch(batch_size=2, seed=0)
        elif isinstance(getattr(model, "dummy_inputs", None), Mapping):
            example = dict(model.dummy_inputs)
        else:
            raise PlanError("cut_stages(by='flops') runs the model once: pass example=(inputs, "
                            "targets), the inputs tensor, or a dict batch")
    if isinstance(example, Batch):   # a pair is a mapping too: its own call
        return example.model_args()
    if isinstance(example, Mapping):
        return (), {k: v for k, v in example.items() if k != "labels"}
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, (tuple, list)) and example:
        return (example[0],), {}
    raise PlanError(f"cut_stages: example must be a batch or an inputs tensor, got "
                    f"{type(example).__name__}")


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """A grouped matmul (Hugging Face's stacked experts): 2 * rows * K * N, the rows of
    every group of `a` (all rows of a 2-D `a`, whose groups are given by offsets)."""
    rows = a_shape[0] * (a_shape[1] if len(a_shape) == 3 else 1)
    return 2 * rows * a_shape[-1] * b_shape[-1]


def _cpu_attention_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """Scaled dot-product attention on the CPU's flash kernel: torch's own count for SDPA
    (which the meta device's math path matches)."""
    from torch.utils.flop_counter import sdpa_flop_count
    return sdpa_flop_count(q_shape, k_shape, v_shape)


def _cpu_attention_backward_flops(grad_shape, q_shape, k_shape, v_shape, *args,
                                  out_shape=None, **kwargs) -> int:
    from torch.utils.flop_counter import sdpa_backward_flop_count
    return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


# ops torch's FlopCounterMode has no formula for: (namespace, op name) -> formula. Grouped
# matmuls (Hugging Face's experts, eager and exported), and SDPA's CPU kernel, which it
# counted as 0 FLOPs: a CPU model's attention was free to the analytic cost model
_UNCOUNTED = {("aten", "_grouped_mm"): _grouped_mm_flops,
              ("transformers", "grouped_mm_fallback"): _grouped_mm_flops,
              ("aten", "_scaled_dot_product_flash_attention_for_cpu"): _cpu_attention_flops,
              ("aten", "_scaled_dot_product_flash_attention_for_cpu_backward"):
                  _cpu_attention_backward_flops}


def flop_counter():
    """`FlopCounterMode` that also counts what torch's has no formula for (`_UNCOUNTED`):
    grouped matmuls, and attention on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode
    custom = {}
    for (namespace, name), formula in _UNCOUNTED.items():
        try:
            custom[getattr(getattr(torch.ops, namespace), name)] = formula
        except (AttributeError, RuntimeError):
            pass
    return FlopCounterMode(display=False, custom_mapping=custom)


def _unit_costs(model: nn.Module, units: list[str], by: str, example) -> list[float]:
    if by == "params":
        seen: set[int] = set()
        costs = []
        for u in units:
            mod = model.get_submodule(u)
            c = 0
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    c += p.numel()
            costs.append(float(c))
        return costs
    if by == "flops":
        args, kwargs = _example_call(model, example)
        from piper_nb.capture.untouched import untouched
        counter = flop_counter()
        with untouched(model), counter, torch.no_grad():
            model(*args, **kwargs)
        counts = counter.get_flop_counts()
        root = type(model).__name__
        costs = []
        for u in units:
            key = f"{root}.{u}"
            costs.append(float(sum(counts.get(key, {}).values())) or 1.0)
        return costs
    raise PlanError(f"cut_stages: by must be 'params' or 'flops', got {by!r}")


def _linear_partition(costs: list[float], n: int) -> list[int]:
    """Contiguous split of costs into n parts minimising the largest part; returns part ids."""
    m = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = 0.0
    for k in range(1, n + 1):
        for i in range(k, m + 1):
            for j in range(k - 1, i):
                v = max(best[j][k - 1], prefix[i] - prefix[j])
                if v < best[i][k]:
                    best[i][k], cut[i][k] = v, j
    parts = [0] * m
    i = m
    for k in range(n, 0, -1):
        j = cut[i][k]
        for t in range(j, i):
            parts[t] = k - 1
        i = j
    return parts


def cut_stages(model: nn.Module, n: int, *, by: str = "params", tag: str = "PP",
               example=None) -> dict[str, dict[str, int]]:
    """An annotation mapping that cuts `model` into `n` contiguous stages of even cost.

    The units are `pipeline_units(model)` that own parameters, in the order the forward
    first calls them (OPT declares its final norm before its layers); the others (rotary
    tables, dropout, activations) stay untagged and run with the stage of their input.
    The order comes from one run of the model on `example`, its `example_batch` or its
    `dummy_inputs` (see `_example_call`; a meta-device model runs on meta tensors), else
    the definition order. `by="flops"` counts each unit's FLOPs in a run too."""
    units = pipeline_units(model)
    units = [u for u in units if _owns_params(model, u)] or units
    units = _execution_order(model, units, example)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise PlanError(f"cut_stages: n must be a positive int, got {n!r}")
    if n > len(units):
        raise PlanError(f"cut_stages: cannot cut {len(units)} units ({', '.join(units)}) into "
                        f"{n} stages; use at most {len(units)}")
    parts = _linear_partition(_unit_costs(model, units, by, example), n)
    return {u: {tag: s} for u, s in zip(units, parts, strict=True)}


def split_count(model: nn.Module, example) -> int:
    """How many `pipe_split()` calls one forward on `example` makes (0 when torch's
    pipelining is not imported, or the model cannot run on it)."""
    import sys
    if "torch.distributed.pipelining" not in sys.modules:
        return 0
    from piper_nb.capture.pipe_split import counting_splits
    from piper_nb.capture.untouched import untouched
    try:
        args, kwargs = _example_call(model, example)
        with untouched(model), torch.no_grad(), counting_splits() as count:
            model(*args, **kwargs)
    except Exception:   # noqa: BLE001 - a forward that cannot run here makes no claim
        return 0
    return count.calls


def _execution_order(model: nn.Module, units: list[str], example) -> list[str]:
    """`units` in the order one forward first calls them (units it never calls last, in
    definition order); the definition order when the model cannot run on its example."""
    try:
        args, kwargs = _example_call(model, example)
    except PlanError:
        return units
    home = next((p.device for p in model.parameters()), torch.device("cpu"))
    move = lambda v: v.to(home) if isinstance(v, torch.Tensor) else v   # noqa: E731
    args, kwargs = tuple(map(move, args)), {k: move(v) for k, v in kwargs.items()}
    order: dict[str, None] = {}
    hooks = [model.get_submodule(u).register_forward_pre_hook(
        lambda _m, _a, u=u: order.setdefault(u)) for u in units]
    from piper_nb.capture.untouched import untouched
    try:
        with untouched(model), torch.no_grad():
            model(*args, **kwargs)
    except Exception:   # noqa: BLE001 - any failure of the user's forward: keep their order
        return units
    finally:
        for h in hooks:
            h.remove()
    return [*order, *(u for u in units if u not in order)]


def _owns_params(model: nn.Module, unit: str) -> bool:
    return next(model.get_submodule(unit).parameters(), None) is not None
