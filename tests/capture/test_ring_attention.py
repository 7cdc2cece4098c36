"""Ring attention (`capture.ring_attention`) against one process's attention: every
device's block of outputs and the gradients of the whole queries, keys and values, for
each load balance, causal or not, with grouped key/value heads."""

import pytest
import torch
import torch.nn.functional as F

from piper_nb.capture.ring_attention import (
    check_length,
    chunk_bounds,
    positions,
    ring_attention,
    take_share,
)

RTOL, ATOL = 1e-5, 1e-6


def test_zigzag_holds_chunk_r_and_its_mirror():
    assert chunk_bounds(16, 2, 0, "zigzag") == ((0, 4), (12, 16))
    assert chunk_bounds(16, 2, 1, "zigzag") == ((4, 8), (8, 12))
    assert positions(4, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert positions(4, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    every = torch.cat([positions(4, 4, r, "zigzag") for r in range(4)])
    assert sorted(every.tolist()) == list(range(16))
    assert check_length(12, 4, "zigzag") == 8 and check_length(16, 4, "zigzag") is None
    assert check_length(12, 4, "contiguous") is None


def _share(x, degree, r, balance):
    return take_share(x, degree, r, balance, dim=2)


@pytest.mark.parametrize("degree", [2, 4])
@pytest.mark.parametrize("balance", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
def test_equal_to_one_process(degree, balance, causal):
    torch.manual_seed(0)
    b, h, kv, seq, d = 2, 4, 2, 16, 8
    q = torch.randn(b, h, seq, d, requires_grad=True)
    k = torch.randn(b, kv, seq, d, requires_grad=True)
    v = torch.randn(b, kv, seq, d, requires_grad=True)
    w = torch.randn(b, h, seq, d)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    (dense * w).sum().backward()
    want = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    k_all = torch.cat([_share(k, degree, j, balance) for j in range(degree)], 2)
    v_all = torch.cat([_share(v, degree, j, balance) for j in range(degree)], 2)
    total = 0
    for r in range(degree):
        out = ring_attention(_share(q, degree, r, balance), k_all, v_all, degree,
                             torch.tensor(r), balance, causal, gqa=True)
        torch.testing.assert_close(out, _share(dense, degree, r, balance).detach(),
                                   rtol=RTOL, atol=ATOL)
        total = total + (out * _share(w, degree, r, balance)).sum()
    total.backward()
    for got, exp in zip((q.grad, k.grad, v.grad), want, strict=True):
        torch.testing.assert_close(got, exp, rtol=RTOL, atol=ATOL)


def test_block_count_is_checked():
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="not 2 blocks of 4"):
        ring_attention(q, torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2), 2, 0,
                       "zigzag", True)
