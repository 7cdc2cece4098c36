"""Stacked experts cut into slices: expert parallelism on Hugging Face MoE models.

Transformers 5 keeps all experts of a block in one `*Experts` module whose parameters are
stacked along dim 0 (`gate_up_proj` of shape [experts, 2 x intermediate, hidden],
`down_proj` likewise), called as `experts(hidden_states, top_k_index, top_k_weights)` by
the block, with the router beside it. There is no module per expert to tag with EP, so an
annotation names a *slice* of the experts instead: `"model.layers.0.mlp.experts[0:2]":
{"EP": 0}` (`expert_slices(model, 2)` writes one entry per slice of every such module).

While the model is captured, each sliced module runs `sliced_forward` in place of its own:
per slice [lo, hi) it gathers the (token, expert) pairs routed into the slice (rows of the
hidden states, expert ids relative to lo, routing weights: the dispatch, in the region of
the router), runs the module's own experts implementation on them with the slice's
parameters inside a `pn.region` scope of the slice's tags (the expert region), and adds
the weighted rows back into the output with `index_add` (the combine, one segment later).
So a slice is an expert region like a TinyMoE expert, and `pn.shard` spreads the slices
over a device group with the all-to-all on either side.

Each slice reads its parameters as `param[lo:hi]`; `cut_pieces` then replaces every such
slice of a stacked parameter in the graph by a parameter of its own, a *piece* named
`<param>[lo:hi]` (a view of the model's tensor), so the device running a slice holds,
updates and checkpoints only its piece; `runtime.layout.assemble_state` concatenates the
pieces back into the stacked tensor.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections.abc import Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn

from piper_nb.capture.region import region
from piper_nb.errors import PlanError

__all__ = ["expert_count", "split_slice", "expert_slices", "check_slices", "sliced_forwards",
           "cut_pieces", "piece_name"]

_SLICE = re.compile(r"^(.*)\[(\d+):(\d+)\]$")
Slice = tuple[int, int, dict]          # (first expert, end, the slice's tags)


def expert_count(mod: nn.Module) -> int | None:
    """The number of experts of a stacked-experts module (an int `num_experts`, every
    parameter of its own stacked along dim 0, weights 3-d), else None (a router is 2-d)."""
    n = getattr(mod, "num_experts", None)
    own = list(mod._parameters.values())
    if (isinstance(n, int) and not isinstance(n, bool) and n > 0 and own
            and all(p is not None and p.dim() >= 1 and p.shape[0] == n for p in own)
            and any(p.dim() == 3 for p in own)):
        return n
    return None


def split_slice(pattern: str) -> tuple[str, int, int] | None:
    """`"path[lo:hi]"` -> (path, lo, hi); None for a plain module pattern."""
    m = _SLICE.match(pattern)
    return (m.group(1), int(m.group(2)), int(m.group(3))) if m else None


def expert_slices(model: nn.Module, parts: int, tag: str = "EP") -> dict[str, dict[str, int]]:
    """Annotation entries cutting every stacked-experts module of `model` into `parts` equal
    slices, slice s tagged `{tag: s}`: merge them into the mapping given to `pn.annotate`."""
    found = [(p, expert_count(m)) for p, m in model.named_modules() if expert_count(m)]
    if not found:
        raise PlanError(f"expert_slices: {type(model).__name__} has no stacked-experts module "
                        "(a module with num_experts and parameters stacked along dim 0); tag "
                        "its expert modules with EP instead")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise PlanError(f"expert_slices: parts must be a positive integer, got {parts!r}")
    out: dict[str, dict[str, int]] = {}
    for path, n in found:
        if n % parts:
            raise PlanError(f"expert_slices: the {n} experts of {path} do not split into {parts} "
                            f"equal slices; shard them over a divisor of {n} devices")
        size = n // parts
        out.update({f"{path}[{s * size}:{(s + 1) * size}]": {tag: s} for s in range(parts)})
    return out


def check_slices(path: str, n: int, slices: list[Slice]) -> tuple[Slice, ...]:
    """The slices of module `path` (n experts), sorted; they must tile 0..n-1, each with
    tags of its own."""
    slices = sorted(slices, key=lambda s: s[0])
    end = 0
    for lo, hi, _ in slices:
        if lo != end or hi <= lo or hi > n:
            raise PlanError(f"annotate: the expert slices of {path} "
                            f"{[f'[{a}:{b}]' for a, b, _ in slices]} must cover its {n} experts "
                            f"0..{n - 1} once each, in non-empty slices; e.g. "
                            f"pn.expert_slices(model, parts) writes them")
        end = hi
    if end != n:
        raise PlanError(f"annotate: the expert slices of {path} stop at expert {end} of {n}; "
                        f"annotate slices up to [..:{n}]")
    tags = [tuple(sorted(t.items())) for _, _, t in slices]
    if not all(tags) or len(set(tags)) != len(tags):
        raise PlanError(f"annotate: each expert slice of {path} needs tags of its own (its "
                        f"region), e.g. {{'EP': s}} for slice s; got {[dict(t) for t in tags]}")
    return tuple(slices)


class _SliceView:
    """The experts module seen through slice [lo, hi): `num_experts` is the slice's size,
    stacked parameters are read as `param[lo:hi]`, methods run on the view."""

    def __init__(self, mod: nn.Module, lo: int, hi: int):
        object.__setattr__(self, "_pn", (mod, lo, hi, {}))

    def __getattr__(self, name: str):
        mod, lo, hi, cache = object.__getattribute__(self, "_pn")
        if name == "num_experts":
            return hi - lo
        if name in mod._parameters:
            if name not in cache:
                cache[name] = mod._parameters[name][lo:hi]
            return cache[name]
        value = getattr(mod, name)
        if isinstance(value, types.MethodType) and value.__self__ is mod:
            return types.MethodType(value.__func__, self)
        return value


def _scope(tags: Mapping[str, int]) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for k, v in tags.items():
        stack.enter_context(region(k, v))
    return stack


def sliced_forward(self: nn.Module, slices: tuple[Slice, ...], hidden_states: torch.Tensor,
                   top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts of `self` slice by slice: dispatch, the slice's experts, combine."""
    run = type(self).forward      # the class's own forward (and experts implementation)
    out = torch.zeros_like(hidden_states)
    for lo, hi, tags in slices:
        tok, pos = ((top_k_index >= lo) & (top_k_index < hi)).nonzero(as_tuple=True)
        rows, ids = hidden_states[tok], (top_k_index[tok, pos] - lo).unsqueeze(-1)
        weights = top_k_weights[tok, pos].unsqueeze(-1)
        with _scope(tags):
            y = run(_SliceView(self, lo, hi), rows, ids, weights)
        out = out.index_add(0, tok, y.to(out.dtype))
    return out


@contextlib.contextmanager
def sliced_forwards(model: nn.Module, slices: Mapping[str, tuple[Slice, ...]]) -> Iterator[None]:
    """Run each sliced experts module of `model` by `sliced_forward` while capturing."""
    patched = []
    try:
        for path, cuts in slices.items():
            mod = model.get_submodule(path)
            mod.forward = types.MethodType(
                lambda self, h, i, w, *rest, _c=cuts: sliced_forward(self, _c, h, i, w), mod)
            patched.append(mod)
        yield
    finally:
        for mod in patched:
            del mod.forward


def piece_name(param: str, lo: int, hi: int) -> str:
    return f"{param}[{lo}:{hi}]"


def cut_pieces(gm: fx.GraphModule, slices: Mapping[str, tuple[Slice, ...]], prefix: str = "model."
               ) -> dict[str, tuple[str, int, int]]:
    """Replace each `param[lo:hi]` of a sliced module's stacked parameters in `gm` by a
    parameter of its own (a view of the same storage); -> piece -> (param, lo, hi), names
    as the model's (without `prefix`)."""
    g = gm.graph
    pieces: dict[str, tuple[str, int, int]] = {}
    targets = {f"{prefix}{path}.{name}": (path, name, {(lo, hi) for lo, hi, _ in cuts})
               for path, cuts in slices.items()
               for name in gm.get_submodule(prefix + path)._parameters}
    for n in list(g.nodes):
        if n.op != "get_attr" or n.target not in targets:
            continue
        path, name, allowed = targets[n.target]
        owner = gm.get_submodule(prefix + path)
        full = owner._parameters[name]
        for u in list(n.users):
            args = tuple(u.args) + (None,) * 4
            lo, hi = (args[2] or 0, min(args[3], full.shape[0])) if isinstance(args[3], int) \
                else (None, None)
            if (u.target is not torch.ops.aten.slice.Tensor or args[1] != 0
                    or (lo, hi) not in allowed):
                raise PlanError(f"{path}.{name} is read other than by its expert slices "
                                f"({u.format_node()}); slice stacked experts only where each "
                                "slice runs, as pn.expert_slices sets up")
            leaf = piece_name(name, lo, hi)
            if leaf not in owner._parameters:
                owner.register_parameter(leaf, nn.Parameter(full.detach()[lo:hi],
                                                             requires_grad=full.requires_grad))
            with g.inserting_before(u):
                new = g.get_attr(f"{prefix}{path}.{leaf}")
            new.meta.update({k: v for k, v in u.meta.items() if k != "pn_tags"})
            u.replace_all_uses_with(new)
            g.erase_node(u)
            pieces[f"{path}.{leaf}"] = (f"{path}.{name}", lo, hi)
        g.erase_node(n)
    g.lint()
    gm.recompile()
    return pieces
