"""TinyGPT: a nanoGPT-sized decoder-only transformer, the main example for pipeline schedules.

Follows Karpathy's nanoGPT (pre-LayerNorm blocks, causal self-attention, tied token
embedding and output projection), cut down so a notebook can train it in seconds. The
top-level children are exactly `embed`, `blocks` and `head`, so annotations can name stages
("embed", "blocks.0", ..., "head"); with tied embeddings the first and last stages share one
Parameter, which capture sees as a real dataflow edge.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import init_small, seeded

__all__ = ["TinyGPT", "Embed", "Head", "CausalSelfAttention", "Block", "ffn", "lm_batch", "lm_loss"]


class Embed(nn.Module):
    """Token embedding `tok` plus learned positional embedding `pos`."""

    def __init__(self, vocab: int, dim: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class Head(nn.Module):
    """Final LayerNorm `norm` and output projection `proj` (dim -> vocab, no bias)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)   # heads as -1: a device's share under tensor parallelism
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = ffn(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def ffn(dim: int, hidden: int) -> nn.Sequential:
    """The transformer feed-forward: Linear -> GELU -> Linear."""
    return nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


def lm_batch(batch_size: int, vocab: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic-progression sequences mod `vocab`; targets are the next tokens.

    Each row starts at a random token and steps by a random stride in 1..4, so the model
    must look back (attention) to infer the stride: learnable, but not trivial.
    """
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 5, (batch_size, 1), generator=g)
    seqs = (start + stride * torch.arange(seq + 1)) % vocab
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy averaged over every token (plain mean: microbatch-splittable)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class LanguageModel(nn.Module):
    """embed -> blocks -> head, trained with next-token cross-entropy (shared by the LMs)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy mean over all B*T tokens (no auxiliary loss)."""
        return lm_loss(logits, targets)

    def example_batch(self, batch_size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, seq] int64, targets [B, seq] int64), see `lm_batch`."""
        return lm_batch(batch_size, self.config["vocab"], self.config["seq"], seed)

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.config.items())


class TinyGPT(LanguageModel):
    """Decoder-only transformer: `embed` -> `blocks` -> `head`, tokens [B, T] -> logits."""

    # how `pn.tensor_parallel` shards it when given no plan (Megatron's pairs: the fused
    # q, k, v projection and the MLP's first layer by output, the layers after by input)
    tp_plan = {"blocks.*.attn.qkv": "colwise:3", "blocks.*.attn.out": "rowwise",
               "blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise"}

    def __init__(
        self,
        vocab: int = 64,
        dim: int = 32,
        layers: int = 4,
        heads: int = 2,
        seq: int = 16,
        tie_embeddings: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        self.config = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, seq=seq,
                           tie_embeddings=tie_embeddings, seed=seed)
        self.name = f"TinyGPT-{layers}x{dim}"
        with seeded(seed):
            self.embed = Embed(vocab, dim, seq)
            self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
            self.head = Head(vocab, dim)
            init_small(self)
        if tie_embeddings:
            self.head.proj.weight = self.embed.tok.weight
