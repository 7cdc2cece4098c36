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


class PickedMLP(nn.Module):
    """gate and up in one linear layer, taken apart otherwise than by a split: viewed into
    (2, hidden) and each indexed, selected or unbound, or sliced `h[..., :hidden]` (as Phi3
    takes q from its qkv); `whole` slices the whole range, which is no part."""

    def __init__(self, how: str, dim: int = 16, hidden: int = 12):
        super().__init__()
        self.how, self.hidden = how, hidden
        self.gate_up = nn.Linear(dim, 2 * hidden)
        self.down = nn.Linear(2 * hidden if how == "whole" else hidden, dim)

    def forward(self, x):
        h = self.gate_up(x)
        if self.how == "whole":
            return self.down(F.silu(h[..., :]))
        if self.how == "slice":
            gate, up = h[..., :self.hidden], h[..., self.hidden:]
        else:
            v = h.view(x.shape[0], 2, self.hidden)
            gate, up = (v[:, 0], v[:, 1]) if self.how == "index" else \
                (v.select(1, 0), v.select(1, 1)) if self.how == "select" else v.unbind(1)
        return self.down(F.silu(gate) * up)

    example_batch = FusedMLP.example_batch


PICKED = {"gate_up": "colwise", "down": "rowwise"}


@pytest.mark.parametrize("how, taken", [("index", "indexed"), ("select", "indexed"),
                                        ("slice", "sliced"), ("unbind", "unbind")])
def test_a_fused_output_viewed_into_parts_or_sliced_needs_colwise_k(how, taken):
    with pytest.raises(pn.PlanError, match=f"gate_up's output is {taken} .*along the dimension "
                       "it is sharded on .*give gate_up 'colwise:2'"):
        _compile(PickedMLP(how), PICKED)
    fixed = _compile(PickedMLP(how), {**PICKED, "gate_up": "colwise:2"})
    assert fixed.tp_params["gate_up.weight"] == (0, 2, 2)


def test_a_view_into_parts_the_degree_divides_is_found_too():
    """Three devices and q, k, v viewed into (3, d): each device's (1, d) is a third of the
    features, not q; before, the view passed the divisibility check."""
    class QKV(PickedMLP):
        def __init__(self):
            super().__init__("index", hidden=6)
            self.gate_up = nn.Linear(16, 18)

        def forward(self, x):
            v = self.gate_up(x).view(x.shape[0], 3, self.hidden)
            return self.down(v[:, 0] * v[:, 1] + v[:, 2])

    batch = QKV().example_batch(batch_size=4, seed=0)
    with pytest.raises(pn.PlanError, match="gate_up's output is indexed .* 'colwise:3'"):
        pn.compile(pn.annotate(QKV(), ONE), [pn.tensor_parallel({}, [0, 1, 2], plan=PICKED)],
                   batch, loss_fn=F.mse_loss)


def test_a_slice_of_the_whole_range_is_no_part():
    assert _compile(PickedMLP("whole"), PICKED).tp_params["gate_up.weight"] == (0, 2, 1)


def test_a_slice_across_blocks_of_colwise_k_is_refused():
    class Across(PickedMLP):
        def forward(self, x):
            return self.down(self.gate_up(x)[..., 6:18])

    with pytest.raises(pn.PlanError, match=r"sliced .*\[6:18:1\] of 24.*whole blocks"):
        _compile(Across("slice"), {**PICKED, "gate_up": "colwise:2"})


class NarrowedMLP(PickedMLP):
    """gate and up taken by `narrow` (torch's, the method, or aten's), as a slice is."""

    def forward(self, x):
        h, n = self.gate_up(x), self.hidden
        if self.how == "method":
            gate, up = h.narrow(-1, 0, n), h.narrow(-1, n, n)
        elif self.how == "aten":
            gate, up = torch.ops.aten.narrow(h, 1, 0, n), torch.ops.aten.narrow(h, 1, n, n)
        elif self.how == "across":
            return self.down(F.silu(torch.narrow(h, -1, n // 2, n)))
        else:
            gate, up = torch.narrow(h, -1, 0, n), torch.narrow(h, 1, n, n)
        return self.down(F.silu(gate) * up)


@pytest.mark.parametrize("how", ["torch", "method", "aten"])
def test_a_narrow_of_a_fused_output_is_a_slice(how):
    """Before, a narrow along the sharded dimension compiled: device 0's gate was the first
    half of its own share, a different model from one process."""
    with pytest.raises(pn.PlanError, match="gate_up's output is sliced .*along the dimension "
                       r"it is sharded on .*\[0:12:1\] of 24.*give gate_up 'colwise:2'"):
        _compile(NarrowedMLP(how), PICKED)
    fixed = _compile(NarrowedMLP(how), {**PICKED, "gate_up": "colwise:2"})
    assert fixed.tp_params["gate_up.weight"] == (0, 2, 2)


def test_a_narrow_across_blocks_of_colwise_k_is_refused():
    with pytest.raises(pn.PlanError, match=r"sliced .*\[6:18:1\] of 24.*whole blocks"):
        _compile(NarrowedMLP("across"), {**PICKED, "gate_up": "colwise:2"})


class UnflattenedMLP(PickedMLP):
    """gate and up unflattened into (2, hidden) (the method, torch's, or aten's) and each
    indexed or unbound, as the view is."""

    def forward(self, x):
        h, n = self.gate_up(x), self.hidden
        v = h.unflatten(-1, (2, n)) if self.how == "method" else \
            torch.unflatten(h, 1, (2, n)) if self.how == "torch" else \
            torch.ops.aten.unflatten.int(h, -1, [2, n]) if self.how == "aten" else \
            h.unflatten(-1, (2, -1))
        gate, up = v.unbind(1) if self.how == "unbind" else (v[:, 0], v[:, 1])
        return self.down(F.silu(gate) * up)


@pytest.mark.parametrize("how, taken", [("method", "indexed"), ("torch", "indexed"),
                                        ("aten", "indexed"), ("unbind", "unbind")])
def test_an_unflatten_of_a_fused_output_is_a_view(how, taken):
    """Before, each failed with a RuntimeError on a device's share naming no module."""
    with pytest.raises(pn.PlanError, match=f"gate_up's output is {taken} .*along the dimension "
                       "it is sharded on .*give gate_up 'colwise:2'"):
        _compile(UnflattenedMLP(how), PICKED)
    fixed = _compile(UnflattenedMLP(how), {**PICKED, "gate_up": "colwise:2"})
    assert fixed.tp_params["gate_up.weight"] == (0, 2, 2)


class TracedBoundsMLP(PickedMLP):
    """gate taken by a slice or narrow whose bounds are traced sizes, not constants."""

    def forward(self, x):
        h = self.gate_up(x)
        n = x.shape[-1] - 4   # 12, a traced size
        gate = h[..., :n] if self.how == "slice" else h.narrow(-1, 0, n)
        return self.down(F.silu(gate))


@pytest.mark.parametrize("how", ["slice", "narrow"])
def test_a_slice_by_traced_bounds_along_the_sharded_dimension_is_refused(how):
    with pytest.raises(pn.PlanError, match="gate_up's output is sliced along the dimension it "
                       "is sharded on .*bounds .*constants"):
        _compile(TracedBoundsMLP(how), PICKED)
