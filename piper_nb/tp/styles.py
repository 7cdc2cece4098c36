"""Tensor-parallel plans: which linear layers of a model shard how (`colwise`, `rowwise`,
`replicate`), given by the user or read from the model itself.

A plan maps module patterns to styles, as Hugging Face's `base_model_tp_plan` and
torchtitan's `parallelize_module` do: `"layers.*.self_attn.q_proj": "colwise"`. A pattern
matches a module path at component boundaries, anchored at its end (`*` is one
component), so the base model's plan (`layers.*.mlp.up_proj`) matches the full path
(`model.layers.0.mlp.up_proj`). The styles:

- `colwise`: the output features are cut into one block per device (the weight's rows and
  the bias); `colwise:3` cuts each of three stacked blocks (a fused q, k, v projection),
  so every device holds its share of each.
- `rowwise`: the input features are cut (the weight's columns); the device's partial
  outputs are summed by an all-reduce, and the bias is added once, after it.
- `vocab`: an embedding's vocabulary is cut (the weight's rows): each device looks up the
  tokens in its range, zeros for the others, and the devices' lookups are summed by an
  all-reduce (Megatron's vocabulary-parallel embedding). On a linear layer, an LM head
  whose logits only a cross-entropy reads: cut as `colwise`, with the vocabulary-parallel
  loss (`tp.loss`), which any colwise head read only by the loss gets.
- `replicate`: the weights are kept whole on every device.

Hugging Face's other spellings read as one of these: `colwise_rep` and `local_colwise` as
`colwise`, `local_rowwise` and `rowwise_rep` as `rowwise`,
`embedding_rowwise` as `vocab`, and the LM head's `colwise_gather_output` as `colwise`
with its output gathered where more than the loss reads it (each device's share of the
logits written into its columns of zeros and all-reduced: whole logits on every device);
read only by a cross-entropy, it gets the vocabulary-parallel loss instead. The rest of
its styles (`rowwise_split_input`, `packed_colwise`, `mla_kv_a_proj`, ...) are refused by
name, each saying what to write instead (`REFUSED`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from torch import nn

from piper_nb.errors import PlanError

__all__ = ["Style", "Sharding", "ACCEPTED", "REFUSED", "parse_style", "model_tp_plan",
           "style_of", "check_plan", "matches_path"]


class Style(StrEnum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    VOCAB = "vocab"
    REPLICATE = "replicate"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Sharding:
    """How one linear layer is cut: its style, for `colwise:n` the stacked blocks, and for
    Hugging Face's `colwise_gather_output` (an LM head) whether its output is gathered."""

    style: Style
    blocks: int = 1
    gather: bool = False

    @property
    def dim(self) -> int | None:
        """The weight's dimension it cuts (0: output features or vocabulary rows, 1: input
        features), None for a weight kept whole."""
        return None if self.style == Style.REPLICATE else 1 if self.style == Style.ROWWISE else 0


_ALIASES = {"colwise_rep": Style.COLWISE, "local_colwise": Style.COLWISE,
            "local_rowwise": Style.ROWWISE,
            "rowwise_rep": Style.ROWWISE, "embedding_rowwise": Style.VOCAB,
            "local_replicate": Style.REPLICATE, "replicated_with_grad_allreduce": Style.REPLICATE,
            "sequence_parallel": Style.REPLICATE, "isolated": Style.REPLICATE,
            "local": Style.REPLICATE, "gather": Style.REPLICATE,
            "moe_tp_experts": Style.REPLICATE, "ep_router": Style.REPLICATE}

# Hugging Face styles with no equivalent here, each with what to write instead
_REFUSED = {
    "rowwise_split_input": "a rowwise layer whose input is whole on every device (after a "
    "colwise_gather_output, as Phi3 and GLM fuse q, k, v or gate and up): give the layer "
    "before it colwise:k (k its fused blocks) and this one rowwise",
    "packed_colwise": "a fused projection: use colwise:k, k its fused blocks (colwise:2 for "
    "gate and up)",
    "packed_rowwise": "fused expert weights: keep the experts whole (replicate) and shard "
    "them with pn.shard (expert parallelism)",
    "embedding_colwise": "an embedding cut along its features: use vocab (cut by vocabulary) "
    "or replicate",
    "mla_kv_a_proj": "DeepSeek's MLA kv_a projection: keep it whole (replicate)",
    "unit_colwise": "colwise that repeats heads when devices outnumber them: use colwise with a "
    "degree that divides the heads",
    "unit_rowwise": "rowwise that repeats heads when devices outnumber them: use rowwise with a "
    "degree that divides the heads",
    "all_reduce": "an all-reduce of a module's partial output: shard the layers inside it "
    "colwise and rowwise instead",
    "local_params": "a module's bare parameters sharded by their own entries: keep them whole "
    "(replicate)",
}


ACCEPTED = frozenset({*map(str, Style), *_ALIASES, "colwise_gather_output"})
REFUSED = frozenset(_REFUSED)


def parse_style(text: str, where: str = "tensor_parallel") -> Sharding:
    """`"colwise"`, `"colwise:3"`, `"rowwise"`, `"replicate"` (or a Hugging Face spelling)."""
    if not isinstance(text, str):
        raise PlanError(f"{where}: a style is a string such as 'colwise', got {text!r}")
    name, _, blocks = text.partition(":")
    if name == "colwise_gather_output":
        return Sharding(Style.COLWISE, gather=True)
    if name in _ALIASES:
        return Sharding(_ALIASES[name])
    if name in _REFUSED:
        raise PlanError(f"{where}: Hugging Face's style {text!r} is not supported: "
                        f"{_REFUSED[name]}")
    try:
        style = Style(name)
    except ValueError:
        raise PlanError(f"{where}: unknown style {text!r}; use colwise, colwise:<blocks>, "
                        "rowwise, vocab or replicate") from None
    if not blocks:
        return Sharding(style)
    if style != Style.COLWISE or not blocks.isdigit() or int(blocks) < 1:
        raise PlanError(f"{where}: {text!r}: only colwise takes a block count, "
                        "as in 'colwise:3' for a fused q, k, v projection")
    return Sharding(style, int(blocks))


def check_plan(plan: Mapping[str, str] | None, where: str = "tensor_parallel") -> dict[str, str]:
    """A user's plan as a {pattern: style} dict, every style checked."""
    if plan is None:
        return {}
    if not isinstance(plan, Mapping) or not all(isinstance(k, str) and k for k in plan):
        raise PlanError(f"{where}: plan maps module patterns to styles, "
                        f"as {{'layers.*.mlp.up': 'colwise'}}; got {plan!r}")
    for style in plan.values():
        parse_style(style, where)
    return dict(plan)


def model_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's own plan: `tp_plan` (piper_nb's models), Hugging Face's `_tp_plan` (full
    paths) or its config's `base_model_tp_plan` (under the base model's prefix); {} if none."""
    own = getattr(model, "tp_plan", None)
    if isinstance(own, Mapping) and own:
        return dict(own)
    hf = getattr(model, "_tp_plan", None)
    if isinstance(hf, Mapping) and hf:
        return dict(hf)
    base = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if isinstance(base, Mapping) and base:
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and isinstance(getattr(model, prefix, None), nn.Module):
            return {f"{prefix}.{k}": v for k, v in base.items()}
        return dict(base)
    return {}


def _regex(pattern: str) -> re.Pattern:
    body = re.escape(pattern).replace(r"\*", r"[^.]+")
    return re.compile(rf"(?:^|.*\.){body}$")


def matches_path(pattern: str, path: str) -> bool:
    """Whether plan `pattern` matches module or parameter `path`."""
    return bool(_regex(pattern).match(path))


def style_of(plan: Mapping[str, str], path: str) -> Sharding | None:
    """The sharding `plan` gives module `path` (the last matching pattern wins), or None."""
    found = None
    for pattern, style in plan.items():
        if _regex(pattern).match(path):
            found = parse_style(style)
    return found
