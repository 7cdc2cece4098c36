"""What the fidelity tests compare with: a plain PyTorch loop, a result against its losses
and state dict, and the tiny transformers models they train (random weights, ids inside
their vocabulary)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from piper_nb.models.gpt import LanguageModel

RTOL, ATOL = 1e-5, 4e-5


def assert_like(result, want_losses, want_state) -> None:
    """`result`'s losses and every state-dict entry equal the plain loop's (fp32 rounding)."""
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want_losses),
                               rtol=RTOL, atol=ATOL)
    got = result.state_dict()
    assert got.keys() == want_state.keys()
    for k in want_state:
        torch.testing.assert_close(got[k].float(), want_state[k].float(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")


def tiny_llama(transformers):
    """A 2-layer Llama of 32 tokens with random weights (seeded)."""
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def tiny_family(transformers, family: str):
    """A 2-layer model of a transformers family (llama, qwen3, mixtral, qwen3moe): 32
    tokens, hidden 32, 4 heads sharing 2 key/value heads, random weights (seeded)."""
    common = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=2)
    moe = dict(num_experts_per_tok=2)
    made = {"llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)),
            "qwen3": lambda: transformers.Qwen3ForCausalLM(
                transformers.Qwen3Config(**common, head_dim=8)),
            "mixtral": lambda: transformers.MixtralForCausalLM(
                transformers.MixtralConfig(**common, num_local_experts=4, **moe)),
            "qwen3moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
                **common, head_dim=8, num_experts=4, moe_intermediate_size=32,
                decoder_sparse_step=1, mlp_only_layers=[], **moe))}
    torch.manual_seed(0)
    return made[family]()


def chunks(batch, n: int) -> list:
    if isinstance(batch, dict):
        parts = {k: t.chunk(n) for k, t in batch.items()}
        return [{k: parts[k][i] for k in batch} for i in range(n)]
    return list(zip(batch[0].chunk(n), batch[1].chunk(n), strict=True))


def plain_loop(model, batches, microbatches: int, lr: float, loss_fn=None):
    """SGD over each batch, `microbatches` equal slices accumulated, each loss / M: the
    loop a user writes (a dict batch: `model(**batch)["loss"]`). The model's modes are left
    as the user set them."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        opt.zero_grad()
        total = 0.0
        for mb in chunks(batch, microbatches):
            out = model(**mb)["loss"] if isinstance(mb, dict) else loss_fn(model(mb[0]), mb[1])
            loss = out / microbatches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses, model.state_dict()


class Attend(LanguageModel):
    """A one-layer model: its attention fused with a mask tensor (`mask="sdpa"`, causal;
    `"sdpa-window"`, a sliding window) or with dropout, or eager (`eager=True`) with a mask
    (`"causal"`, `"window"`: a sliding window of 4 tokens); `embed_dropout` after the
    embedding, `noise` adds `torch.rand_like` there (a random op other than dropout)."""

    def __init__(self, mask: str | None = None, dropout: float = 0.0, eager: bool = False,
                 seq: int = 16, embed_dropout: float = 0.0, noise: bool = False):
        super().__init__()
        self.config, self.name = dict(vocab=32, seq=seq), "Attend"
        self.embed, self.qkv, self.head = nn.Embedding(32, 16), nn.Linear(16, 48), nn.Linear(16, 32)
        self.mask, self.dropout, self.eager = mask, dropout, eager
        self.embed_dropout, self.noise = embed_dropout, noise

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.embed_dropout:
            x = F.dropout(x, self.embed_dropout, self.training)
        if self.noise:
            x = x + torch.rand_like(x)
        b, t = x.size(0), x.size(1)
        q, k, v = self.qkv(x).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4).unbind(0)
        if self.eager:
            s = q @ k.transpose(-2, -1) / 8 ** 0.5
            if self.mask:
                i = torch.arange(t, device=x.device)
                above = i[None, :] > i[:, None]
                if self.mask == "window":
                    above = above | (i[None, :] < i[:, None] - 4)
                s = s.masked_fill(above, float("-inf"))
            y = torch.softmax(s, dim=-1) @ v
        elif self.mask:   # "sdpa": causal as a tensor; "sdpa-window": 4 tokens back at most
            m = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            if self.mask == "sdpa-window":
                m = m & ~torch.ones(t, t, dtype=torch.bool, device=x.device).tril(-5)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
        else:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return self.head(y.transpose(1, 2).reshape(b, t, 16))
