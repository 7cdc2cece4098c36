"""Llama: a Llama-shaped decoder in plain PyTorch that `torch.fx` traces in seconds.

The layer of Meta's Llama 2/3 (Touvron et al. 2023; Hugging Face's `LlamaForCausalLM`
computes the same thing): RMSNorm before attention and before the MLP, rotary position
embeddings (RoPE) on queries and keys, grouped-query attention (`kv_heads` key/value heads
shared by `heads // kv_heads` query heads each), a SwiGLU MLP (`down(silu(gate(x)) *
up(x))`), no biases, untied input embedding and output projection. The top-level children
are `embed`, `blocks` and `head`, as in `TinyGPT`, so the same annotations cut it.

Why a second Llama next to Hugging Face's: planning a 70B model on the meta device needs a
capture per stage count, and `torch.export` of 80 Hugging Face layers takes about half a
minute on a laptop-class CPU, where symbolic tracing of this one takes about a second.
Parameter counts match (`Llama(vocab=128256, dim=8192, layers=80, heads=64, kv_heads=8,
hidden=28672)` has Llama 3 70B's 70.55 B parameters).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import init_small, seeded
from .gpt import LanguageModel

__all__ = ["Llama", "LlamaBlock", "GQAttention", "SwiGLU", "rope"]


def rope(x: torch.Tensor, head_dim: int, theta: float = 500000.0) -> torch.Tensor:
    """Rotary position embedding of x [batch, heads, time, head_dim], in Hugging Face's
    layout: channel i pairs with channel i + head_dim/2 (`rotate_half`)."""
    freqs = torch.pow(theta, -torch.arange(0, head_dim, 2, device=x.device,
                                           dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(x.size(2), device=x.device, dtype=torch.float32), freqs)
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _flash_kernel(device: torch.device):
    """The flash-attention op for `device` (meta planning counts what a GPU's saves)."""
    if device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return torch.ops.aten._scaled_dot_product_flash_attention


class GQAttention(nn.Module):
    """Causal grouped-query attention with RoPE: `heads` query heads, `kv_heads` shared
    key/value heads; projections `q`, `k`, `v`, `o` without bias.

    `attention` picks the kernel, and so what autograd saves: "sdpa" (PyTorch's
    `scaled_dot_product_attention`; on the meta device and CPU its math path keeps the
    time x time attention matrix) or "flash" (the flash-attention op, which keeps only q, k,
    v, the output and a log-sum-exp per row, as training on GPUs does; on the device the
    model is built on)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, attention: str = "sdpa"):
        super().__init__()
        if dim % heads or heads % kv_heads:
            raise ValueError(f"dim={dim} must be divisible by heads={heads}, and heads by "
                             f"kv_heads={kv_heads}")
        if attention not in ("sdpa", "flash"):
            raise ValueError(f"attention={attention!r}: use 'sdpa' or 'flash'")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.flash = _flash_kernel(self.q.weight.device) if attention == "flash" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)   # heads as -1: a device's share under tensor parallelism
        q = self.q(x).reshape(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(x).reshape(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).reshape(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = rope(q, self.head_dim), rope(k, self.head_dim)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self.flash is not None:
            y = self.flash(q, k, v, 0.0, True)[0]
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)), RMSNorm throughout."""

    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int,
                 attention: str = "sdpa"):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=1e-5)
        self.attn = GQAttention(dim, heads, kv_heads, attention)
        self.norm2 = nn.RMSNorm(dim, eps=1e-5)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class LlamaHead(nn.Module):
    """Final RMSNorm `norm` and output projection `proj` (dim -> vocab, no bias)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


class Llama(LanguageModel):
    """Llama-shaped decoder: `embed` -> `blocks` -> `head`, tokens [B, T] -> logits.

    `hidden` is the MLP's width (Llama's intermediate_size); `seq` only sizes
    `example_batch` (RoPE has no table); `attention` is "sdpa" or "flash" (see
    `GQAttention`)."""

    # how `pn.tensor_parallel` shards it when given no plan (torchtitan's Llama plan): the
    # embedding and the head cut by vocabulary, the head's logits never gathered when only a
    # cross-entropy reads them (a vocabulary-parallel loss; gathered otherwise)
    tp_plan = {"embed": "vocab", "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
               "blocks.*.attn.v": "colwise", "blocks.*.attn.o": "rowwise",
               "blocks.*.mlp.gate": "colwise", "blocks.*.mlp.up": "colwise",
               "blocks.*.mlp.down": "rowwise", "head.proj": "colwise_gather_output"}

    def __init__(self, vocab: int = 64, dim: int = 32, layers: int = 4, heads: int = 4,
                 kv_heads: int = 2, hidden: int = 64, seq: int = 16, attention: str = "sdpa",
                 seed: int = 0):
        super().__init__()
        self.config = dict(vocab=vocab, dim=dim, layers=layers, heads=heads, kv_heads=kv_heads,
                           hidden=hidden, seq=seq, attention=attention, seed=seed)
        self.name = f"Llama-{layers}x{dim}"
        with seeded(seed):
            self.embed = nn.Embedding(vocab, dim)
            self.blocks = nn.ModuleList([LlamaBlock(dim, heads, kv_heads, hidden, attention)
                                         for _ in range(layers)])
            self.head = LlamaHead(vocab, dim)
            init_small(self)
