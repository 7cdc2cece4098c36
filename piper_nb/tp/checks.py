"""What a tensor-parallel cut cannot be, said before anything runs: heads or widths a
degree cannot divide (`check_heads`), a weight tied to a module the plan cuts otherwise
(`check_tied`), and a region reading whole a weight another region shards (`check_readers`).
Each is a PlanError naming the module, the sizes or the regions, and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from piper_nb.errors import PlanError
from piper_nb.ir.filters import tags_text
from piper_nb.tp.styles import style_of

__all__ = ["check_heads", "check_tied", "check_readers"]

_HEADS = ("heads", "kv_heads", "num_heads", "n_heads", "num_attention_heads",
          "num_key_value_heads", "n_head")


def check_readers(regions, cut_of: dict, params: dict, aliases: dict) -> None:
    """A region that reads a weight another region shards, without sharding it alike (a
    tied LM head in a stage no tensor_parallel filter matches): PlanError."""
    where = {p: r for r in regions for p in cut_of[r.index]}
    for r in regions:
        for name in r.params:
            p = aliases.get(name, name)
            if p in params and cut_of[r.index].get(p) != params[p]:
                raise PlanError(
                    f"tensor_parallel: region {r.name} reads {name} whole, which region "
                    f"{where[p].name} shards (it is tied to a weight there); put region "
                    f"{r.name} under a tensor_parallel filter whose plan cuts it alike, or "
                    "untie the weights")


def check_tied(params: dict, aliases: dict, plan: Mapping[str, str], info) -> None:
    """A sharded weight tied to a module the plan does not shard alike: PlanError."""
    def cut(sh):   # the weight's dimension and blocks a style cuts, None for whole
        return None if sh is None or sh.dim is None else (sh.dim, sh.blocks)

    def said(sh):
        return "kept whole" if sh is None else "colwise_gather_output" if sh.gather \
            else str(sh.style)

    for alias, p in aliases.items():
        if p in params and alias != p:
            mine, other = (style_of(plan, n.rsplit(".", 1)[0]) for n in (p, alias))
            if cut(mine) != cut(other):
                raise PlanError(
                    f"tensor_parallel: {p} ({said(mine)}) is tied to {alias} ({said(other)}) "
                    f"in region {info.name}; cut both alike (a tied embedding and LM head: "
                    "vocab and colwise_gather_output), or untie them")


def check_heads(model: nn.Module, chosen: dict, regions) -> None:
    """Attention heads, grouped KV heads and widths a degree cannot divide: PlanError."""
    degrees = {q.degree for q in chosen.values()}
    config = getattr(model, "config", None)
    for d in sorted(degrees):
        for attr in ("num_attention_heads", "num_key_value_heads"):
            n = getattr(config, attr, None)
            if isinstance(n, int) and n % d:
                raise PlanError(f"tensor_parallel: the model's {attr}={n} cannot be divided "
                                f"over {d} devices; use a degree that divides {n}")
    for r in regions:
        if r.index not in chosen:
            continue
        d = chosen[r.index].degree
        paths = {p.rsplit(".", k)[0] for p in r.modules for k in range(p.count(".") + 1)}
        for path in sorted(paths):
            mod = model.get_submodule(path) if path else model
            for attr in _HEADS:
                n = getattr(mod, attr, None)
                if isinstance(n, int) and not isinstance(n, bool) and n % d:
                    raise PlanError(f"tensor_parallel: {path} has {attr}={n}, which {d} devices "
                                    f"cannot divide (region {tags_text(r.tags)}); use a degree "
                                    f"that divides {n}")
