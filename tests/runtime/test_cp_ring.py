"""The point-to-point ring (`pn.context_parallel(..., rotate="p2p")`) trains exactly like
one process, in every composition the all-gather rotation has: CP 2 and CP 4, zigzag and
contiguous, microbatches, ZeRO-3 over DP x CP, recompute, PP 2 x CP 2 under 1F1B, CP 2 x
TP 2, transformers' Llama and Qwen3 through their own attention; each step's exchange is
a SEND and a RECV of the plan, issued before the part it runs beside.
fp32, rtol 1e-5 (the steps sum the softmax block by block, as the all-gather's ring
attention does: its forward to the bit, the gradients summed in another order)."""

from __future__ import annotations

import os
import sys

import pytest

import piper_nb as pn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_context_parallel import _hf_equal, _train, llama, tinygpt  # noqa: E402

pytestmark = pytest.mark.dist


def _ring(devices, **kw):
    return pn.context_parallel({}, devices, rotate="p2p", **kw)


def _exchanges(plan, device=0) -> list:
    return [i for i in plan.devices[device].instrs if i.kind in (pn.Op.SEND, pn.Op.RECV)]


def test_cp2_ring_llama_exchanges_beside_the_steps(cluster2):
    plan = _train(llama(), [_ring([0, 1]), pn.split({}, num=2)], cluster2)
    assert not [i for i in plan.devices[0].instrs if i.purpose == pn.Purpose.CP]
    # per layer and microbatch: one exchange of keys and values, one of their gradients
    sends = [i for i in _exchanges(plan) if i.kind == pn.Op.SEND]
    assert len(sends) == 2 * 2 * 2 and {i.data.peer for i in sends} == {1}
    instrs = plan.devices[1].instrs
    for k, ins in enumerate(instrs):   # a SEND goes out before the next step's part runs
        if ins.kind == pn.Op.SEND and not ins.data.grad:
            after = next(x for x in instrs[k:] if x.is_compute)
            assert after.kind == pn.Op.F and after.region == ins.region - 1
    cp = plan.capture.cp
    assert cp.rotate == "p2p" and len(cp.rotations) == 4 and not cp.gathered


@pytest.mark.parametrize("name", ["cp4", "contiguous", "tinygpt", "zero3", "recompute"])
def test_ring_composes(cluster4, name):
    devices = [0, 1, 2, 3] if name == "cp4" else [0, 1]
    model = tinygpt() if name == "tinygpt" else llama()
    more = {"zero3": [pn.replicate({}, devices, zero=3)],
            "recompute": [pn.recompute({"PP": 0})]}.get(name, [])
    balance = "contiguous" if name == "contiguous" else "zigzag"
    # SGD on TinyGPT: its key bias's gradient is zero but for roundings, which Adam's
    # division by each element's own scale would turn into steps
    opt = pn.optim.SGD(lr=0.1) if name == "tinygpt" else pn.optim.AdamW(1e-2)
    plan = _train(model, [_ring(devices, load_balance=balance), pn.split({}, num=2), *more],
                  cluster4, opt=opt)
    if name == "cp4":   # three exchanges an attention: to the next member, from the last
        sends = [i for i in _exchanges(plan, 1) if i.kind == pn.Op.SEND]
        assert len(sends) == 2 * 2 * 3 * 2
        assert {(i.data.peer, i.data.grad) for i in sends} == {(2, False), (0, True)}


def test_pp2_cp2_ring_1f1b(cluster4):
    model = llama()
    _train(model, [*pn.schedules.one_f_one_b(2, 4), pn.place({"PP": 0}, [0, 1]),
                   pn.place({"PP": 1}, [2, 3]), _ring([[0, 1], [2, 3]])],
           cluster4, ann=pn.cut_stages(model, 2))


def test_cp2_dp2_zero3_ring(cluster4):
    plan = _train(llama(), [pn.replicate({}, [0, 1, 2, 3], zero=3), _ring([[0, 1], [2, 3]]),
                            pn.split({}, num=2)], cluster4, opt=pn.optim.AdamW(1e-2))
    assert {i.data.peer for i in _exchanges(plan, 2)} == {3}


def test_cp2_tp2_ring(cluster4):
    plan = _train(llama(), [_ring([0, 2]), pn.tensor_parallel({}, [[0, 1], [2, 3]]),
                            pn.split({}, num=2)], cluster4)
    assert {i.data.peer for i in _exchanges(plan, 1)} == {3}


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen3", "eager")])
def test_cp2_ring_transformers_own_attention(cluster2, family, attention):
    plan, _ = _hf_equal(family, attention, [_ring([0, 1]), pn.split({}, num=2)], cluster2)
    assert len(plan.capture.cp.rotations) == 4
