"""TinyMoE: TinyGPT with a mixture-of-experts feed-forward, the example for expert parallelism.

Each block's MLP is replaced by `moe`: a learned `router` picks the top-k experts per token
(Switch/GShard/Mixtral-style routing, renormalised top-k weights) and only those tokens are
gathered, run through the expert, weighted and scattered back with `index_add`. It is
dropless (no capacity) and has no auxiliary load-balancing loss, so the training loss stays
a plain mean over tokens and splitting a batch into microbatches gives the same gradients.
The dispatch is written without data-dependent Python control flow, so torch.fx traces it.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import init_small, seeded
from .gpt import CausalSelfAttention, Embed, Head, LanguageModel, ffn

__all__ = ["TinyMoE", "MoE", "MoEBlock"]


class MoE(nn.Module):
    """Top-k routed experts over [..., dim] activations: `router` and `experts.e`."""

    def __init__(self, dim: int, experts: int, top_k: int, hidden: int):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be between 1 and experts={experts}")
        self.top_k = top_k
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList([ffn(dim, hidden) for _ in range(experts)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.size(-1))
        probs = torch.softmax(self.router(flat), dim=-1)
        topv, topi = probs.topk(self.top_k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            mask = topi == e  # [N, k]; at most one True per row
            idx = mask.any(-1).nonzero().squeeze(-1)  # the tokens routed to expert e
            weight = (topv * mask).sum(-1)[idx]
            out = out.index_add(0, idx, expert(flat[idx]) * weight.unsqueeze(-1))
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    """Pre-LayerNorm block whose feed-forward is a `MoE`: x + attn(ln1(x)), x + moe(ln2(x))."""

    def __init__(self, dim: int, heads: int, experts: int, top_k: int, hidden: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.moe = MoE(dim, experts, top_k, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class TinyMoE(LanguageModel):
    """Decoder-only MoE transformer: `embed` -> `blocks` (MoE blocks) -> `head`."""

    # how `pn.tensor_parallel` shards it when given no plan: the attention as TinyGPT's; the
    # experts stay whole on each device (`pn.shard` spreads them instead)
    tp_plan = {"blocks.*.attn.qkv": "colwise:3", "blocks.*.attn.out": "rowwise"}

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        layers: int = 2,
        experts: int = 4,
        top_k: int = 2,
        heads: int = 2,
        seq: int = 16,
        hidden: int | None = None,
        tie_embeddings: bool = False,
        seed: int = 0,
    ):
        super().__init__()
        hidden = 2 * dim if hidden is None else hidden
        self.config = dict(vocab=vocab, dim=dim, layers=layers, experts=experts, top_k=top_k,
                           heads=heads, seq=seq, hidden=hidden, tie_embeddings=tie_embeddings,
                           seed=seed)
        self.name = f"TinyMoE-{layers}x{dim}-E{experts}k{top_k}"
        with seeded(seed):
            self.embed = Embed(vocab, dim, seq)
            self.blocks = nn.ModuleList(
                [MoEBlock(dim, heads, experts, top_k, hidden) for _ in range(layers)]
            )
            self.head = Head(vocab, dim)
            init_small(self)
        if tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight
