"""Dropout in a sharded part: each device's mask is its slice of the mask one process draws
(`capture.slice_dropout`), found and placed by the TP rewrite (`tp.dropout`); any other
random op on a device's share is refused by name; and TP 2 and 4 with dropout train as one
process does with the same seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.capture.slice_dropout import slice_dropout


@pytest.mark.parametrize("shape, dim", [((2, 3, 8), -1), ((2, 4, 5, 5), -3)])
@pytest.mark.parametrize("degree", [2, 4])
def test_each_share_draws_its_slice_of_one_process_mask(shape, dim, degree):
    whole = torch.randn(shape)
    torch.manual_seed(7)
    want = F.dropout(whole, 0.5, True)
    after = torch.rand(3)   # the generator is left where one process leaves it
    n = shape[dim] // degree
    for rank in range(degree):
        torch.manual_seed(7)
        got = slice_dropout(whole.narrow(dim, rank * n, n), 0.5, True, dim, degree,
                         torch.tensor(rank))
        assert torch.equal(got, want.narrow(dim, rank * n, n))
        assert torch.equal(torch.rand(3), after)


def test_off_in_eval_and_at_zero():
    x = torch.randn(2, 4)
    assert slice_dropout(x, 0.5, False, -1, 2, torch.tensor(1)) is x
    assert slice_dropout(x, 0.0, True, -1, 2, torch.tensor(1)) is x


class Block(nn.Module):
    """Attention over 4 heads and an MLP, with dropout on the attention probabilities and
    the MLP's hidden activation (both on a device's share under TP) and after each
    projection (replicated)."""

    def __init__(self, dim=16, heads=4, p=0.5, noise=False):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.noise = heads, noise
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.o, self.up, self.down = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(
            2 * dim, dim)
        self.drop = nn.Dropout(p)

    def split(self, t):
        b, s, _ = t.shape
        return t.view(b, s, self.heads, -1).transpose(1, 2)

    def forward(self, x):
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        att = self.drop(torch.softmax(q @ k.transpose(-1, -2) / 2.0, -1))
        h = (att @ v).transpose(1, 2).flatten(2)
        x = x + self.drop(self.o(h))
        hidden = torch.relu(self.up(x))
        if self.noise:
            hidden = hidden + torch.rand_like(hidden)
        return x + self.drop(self.down(self.drop(hidden)))

    def loss_fn(self, out, y):
        return F.mse_loss(out, y)


PLAN = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "up": "colwise",
        "down": "rowwise"}


def batch():
    return torch.randn(4, 6, 16), torch.randn(4, 6, 16)


def test_sharded_dropouts_become_slices_and_replicated_ones_stay():
    model = Block()
    plan = pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                      [pn.tensor_parallel({}, [0, 1], plan=PLAN)], batch())
    calls = [str(n.target) for gm in plan.capture.modules for n in gm.graph.nodes
             if n.op in ("call_function", "call_module")]
    assert sum("slice_dropout" in c for c in calls) == 2      # the probabilities, the hidden
    assert calls.count("model.drop") == 2                   # after o and after down


def test_another_random_op_on_a_share_is_refused_by_name():
    model = Block(noise=True)
    with pytest.raises(pn.PlanError, match=r"rand_like.*draws random numbers on a device's "
                                           r"share.*replicate"):
        pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                   [pn.tensor_parallel({}, [0, 1], plan=PLAN)], batch())


@pytest.mark.dist
@pytest.mark.parametrize("degree", [2, 4])
def test_dropout_under_tp_trains_as_one_process_with_the_seed(request, degree, one_thread):
    """Dropout p = 0.5 on the attention probabilities and the MLP's hidden activation (each
    device's share) and after both projections (replicated): TP 2 and 4 train exactly as the
    same model in one process (`pn.reference_train`) with the same seed. Before, every
    device drew its share's mask from the same seed: features i and i + n/t were always
    dropped together."""
    model, (x, y), sgd = Block(p=0.5), batch(), pn.optim.SGD(lr=0.1)
    spec = pn.annotate(model, {"": {"PP": 0}})
    tp = pn.compile(spec, [pn.tensor_parallel({}, list(range(degree)), plan=PLAN)], (x, y))
    want = pn.reference_train(spec, (x, y), 3, 1, sgd, seed=11)
    got = pn.train(tp, (x, y), 3, sgd, seed=11,
                   cluster=request.getfixturevalue(f"cluster{degree}"))
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(want.losses),
                               rtol=1e-5, atol=4e-5)
    for k, v in want.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=1e-5, atol=4e-5,
                                   msg=lambda m, k=k: f"{k}: {m}")
    plain = pn.reference_train(Block(p=0.0), (x, y), 3, 1, sgd)   # dropout makes a difference
    assert abs(plain.losses[-1] - want.losses[-1]) > 1e-3
