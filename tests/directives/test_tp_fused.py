"""A fused projection given plain `colwise` is a PlanError naming the module and
`colwise:k`, found from the split of its output: TinyGPT's qkv `chunk(3)`, a fused gate
and up `chunk(2)`, a user's `torch.split(out, [d, d, d], -1)`. Before, each compiled and
trained a different model from one process. The fix, `colwise:k`, compiles."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn

ONE = {"": {"PP": 0}}


class FusedMLP(nn.Module):
    """gate and up in one linear layer, chunked; or q, k, v split by sizes (`sizes`)."""

    def __init__(self, dim: int = 16, hidden: int = 32, fuse: str = "chunk"):
        super().__init__()
        self.fuse, self.hidden = fuse, hidden
        k = 3 if fuse == "split" else 2
        self.gate_up = nn.Linear(dim, k * hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.gate_up(x)
        if self.fuse == "split":
            a, b, c = torch.split(h, [self.hidden] * 3, -1)
            return self.down(F.silu(a) * b + c)
        gate, up = h.chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)

    def example_batch(self, batch_size, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 16, generator=g), torch.randn(batch_size, 16, generator=g)


def _compile(model, plan):
    batch = model.example_batch(batch_size=4, seed=0)
    kw = {} if hasattr(model, "loss_fn") else {"loss_fn": F.mse_loss}
    return pn.compile(pn.annotate(model, ONE), [pn.tensor_parallel({}, [0, 1], plan=plan)],
                      batch, **kw)


def tinygpt():
    return pn.models.TinyGPT(vocab=32, dim=32, layers=1, heads=4, seq=8)


@pytest.mark.parametrize("make, plan, module, k", [
    (tinygpt, {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.out": "rowwise"},
     "blocks.0.attn.qkv", 3),
    (lambda: FusedMLP(fuse="chunk"), {"gate_up": "colwise", "down": "rowwise"}, "gate_up", 2),
    (lambda: FusedMLP(fuse="split"), {"gate_up": "colwise", "down": "rowwise"}, "gate_up", 3),
])
def test_a_fused_projection_given_plain_colwise_is_told_its_blocks(make, plan, module, k):
    with pytest.raises(pn.PlanError, match=f"{module}'s output is (chunk|split) into {k} parts "
                       f"along the dimension it is sharded on .* give {module} 'colwise:{k}'"):
        _compile(make(), plan)
    fixed = _compile(make(), {**plan, next(iter(plan)): f"colwise:{k}"})   # the fix
    assert fixed.tp_params[f"{module}.weight"] == (0, 2, k)
