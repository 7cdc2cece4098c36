"""Megatron-LM's GPT layer, the one Korthikanti et al. 2022 count activation bytes for:
pre-LayerNorm, a fused q, k, v projection, softmax attention with dropout on the
probabilities, a 4h GeLU MLP, and dropout after the attention and after the MLP. The
memory model is checked against their Table 2 on it (`benchmarks/bench_layer_memory.py`),
and selective recompute's attention core is its scores-to-context block.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ._common import seeded
from .gpt import LanguageModel

__all__ = ["MegatronGPT", "MegatronLayer", "keep_mask_dropout"]


def keep_mask_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout that saves a 1-byte keep mask for the backward (Megatron's CUDA dropout),
    where `F.dropout` on CPU and meta saves noise of the input's dtype."""
    if not training or p == 0:
        return x
    keep = torch.rand_like(x) >= p            # bool: autograd saves it, 1 byte per element
    return x * keep * (1.0 / (1.0 - p))       # the scalar multiply saves nothing


class MegatronLayer(nn.Module):
    """x + drop(out(attn(ln1 x))), then + drop(fc2(gelu(fc1(ln2 x)))); the attention drops
    its probabilities too. `keep_mask`: dropout saving a bool mask (refused under TP)."""

    def __init__(self, dim: int, heads: int, p: float = 0.1, keep_mask: bool = False):
        super().__init__()
        self.head_dim, self.p = dim // heads, p
        self.drop = keep_mask_dropout if keep_mask else F.dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]   # heads as -1: a device's share under TP
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, s, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        probs = self.drop(torch.softmax(scores, dim=-1), self.p, self.training)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
        x = x + self.drop(self.out(y), self.p, self.training)
        return x + self.drop(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class MegatronGPT(LanguageModel):
    """embed -> MegatronLayer x layers -> head, with its TP plan (Megatron's pairs)."""

    tp_plan = {"blocks.*.qkv": "colwise:3", "blocks.*.out": "rowwise",
               "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 2, heads: int = 4,
                 seq: int = 8, p: float = 0.1, keep_mask: bool = False, seed: int = 0):
        super().__init__()
        self.config = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, seq=seq, p=p,
                           keep_mask=keep_mask, seed=seed)
        with seeded(seed):
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([MegatronLayer(dim, heads, p, keep_mask)
                                         for _ in range(layers)])
            self.head = nn.Linear(dim, vocab, bias=False)
