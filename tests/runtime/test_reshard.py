"""ZeRO-3 without resharding inside the step trains exactly like the reference too."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("opt", [pn.optim.SGD(lr=0.1, momentum=0.9), pn.optim.AdamW(lr=1e-2)],
                         ids=["sgd", "adamw"])
def test_zero3_no_reshard_equals_reference(opt):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=False)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=3, reshard=False),
               pn.replicate({"PP": 1}, [1, 3], zero=3, reshard=False),
               *pn.schedules.one_f_one_b(ranks=2, microbatches=2)]
    plan = pn.compile(spec, program, batch)
    with pn.LocalCluster(4) as cluster:
        result = pn.train(plan, batch, 3, opt, cluster=cluster)
    ref = pn.reference_train(model, batch, steps=3, microbatches=2, optimizer=opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=4e-5)
    got, want = result.state_dict(), ref.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=4e-5)
    gathers = [e for e in result.trace.events if e.kind == "ALL_GATHER" and e.device == 0]
    assert len(gathers) == 1  # one gather for the whole step on device 0
