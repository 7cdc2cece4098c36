"""ZeRO-3 without resharding inside the step, or with gradients reduced once per step,
trains exactly like the reference too."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

pytestmark = pytest.mark.dist


def train_pp2_dp2_zero3(cluster, opt, microbatches: int, **zero3):
    """TinyGPT as PP 2 x DP 2 with ZeRO-3 (`zero3`: replicate's fields), 1F1B, trained 3
    steps on the session's 4 workers and checked against the reference; -> the result."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=False)
    batch = model.example_batch(batch_size=8, seed=0)
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=3, **zero3),
               pn.replicate({"PP": 1}, [1, 3], zero=3, **zero3),
               *pn.schedules.one_f_one_b(ranks=2, microbatches=microbatches)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, batch)
    result = pn.train(plan, batch, 3, opt, cluster=cluster)
    ref = pn.reference_train(model, batch, steps=3, microbatches=microbatches, optimizer=opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=4e-5)
    got, want = result.state_dict(), ref.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=4e-5)
    return result


@pytest.mark.parametrize("opt", [pn.optim.SGD(lr=0.1, momentum=0.9), pn.optim.AdamW(lr=1e-2)],
                         ids=["sgd", "adamw"])
def test_zero3_no_reshard_equals_reference(cluster4, opt):
    result = train_pp2_dp2_zero3(cluster4, opt, 2, reshard=False)
    gathers = [e for e in result.trace.events if e.kind == "ALL_GATHER" and e.device == 0]
    assert len(gathers) == 1  # one gather for the whole step on device 0


@pytest.mark.parametrize("zero3, gathers, reductions", [
    (dict(grad_sync="step"), 8, 1),                      # FSDP2 under torchtitan's PP
    (dict(reshard=False, grad_sync="microbatch"), 1, 4),
])
def test_zero3_gradient_sync_once_per_step_or_per_microbatch(cluster4, zero3, gathers,
                                                              reductions):
    result = train_pp2_dp2_zero3(cluster4, pn.optim.AdamW(lr=1e-2), 4, **zero3)
    # device 0 holds stage 0's one bucket: gathered before each of its 8 passes or once,
    # reduced once or after each of its 4 backwards; the trace shows one step
    ran = [e.kind for e in result.trace.events if e.device == 0]
    assert (ran.count("ALL_GATHER"), ran.count("REDUCE_SCATTER")) == (gathers, reductions)
