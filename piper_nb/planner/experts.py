"""A model's experts as a search sees them: which modules hold them, how many each, and the
annotation that tags them for expert parallelism at a given degree.

Two forms are found: Hugging Face's stacked experts (a module with `num_experts` and
parameters stacked along dim 0, `capture.experts`), cut by `pn.expert_slices` into EP equal
slices; and a list of expert modules (`nn.ModuleList` named `experts`, as `pn.models.TinyMoE`
and older Mixtral ports keep them), expert e tagged `EP: e` (`pn.shard` runs it on the
group's device e mod EP).

Expert parallelism here is `pn.shard` over a stage's replicas: EP equals DP (DeepSpeed-MoE's
and Megatron's EP inside DP, at its largest). A degree is allowed when every module has at
least that many experts and, stacked, a multiple of it (equal slices).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from piper_nb.capture.experts import expert_count, expert_slices
from piper_nb.directives.shard import EP

__all__ = ["Experts", "find_experts", "EP"]

@dataclass(frozen=True)
class Experts:
    """The expert modules of a model: (path, experts, stacked) each."""

    modules: tuple[tuple[str, int, bool], ...]

    def allows(self, ep: int) -> bool:
        """Whether the experts spread over `ep` devices (each at least one, equal slices)."""
        return all(n >= ep and (not stacked or n % ep == 0) for _, n, stacked in self.modules)

    def tags(self, model: nn.Module, ep: int) -> dict[str, dict[str, int]]:
        """Annotation entries tagging the experts for `ep` devices (1: one region per
        stacked module, one per listed expert; the plan replicates them with their stage)."""
        out: dict[str, dict[str, int]] = {}
        if any(stacked for _, _, stacked in self.modules):
            out |= expert_slices(model, ep, EP)
        for path, n, stacked in self.modules:
            if not stacked:
                out |= {f"{path}.{e}": {EP: e} for e in range(n)}
        return out


def find_experts(model: nn.Module) -> Experts | None:
    """The model's experts, or None for a dense model."""
    found = []
    for path, mod in model.named_modules():
        n = expert_count(mod)
        if n:
            found.append((path, n, True))
        elif (isinstance(mod, nn.ModuleList) and path.rsplit(".", 1)[-1] == "experts"
              and len(mod) >= 2 and len({type(m) for m in mod}) == 1):
            found.append((path, len(mod), False))
    return Experts(tuple(found)) if found else None
