"""The candidates `pn.search` ranks first train like one process: each of the top plans
for TinyGPT on 4 workers (the top five; the top two with PP, with TP and with CP pinned;
the top one with CP x TP), compiled from the row's own annotation and program, equals
`pn.reference_train` (fp32; rtol 1e-5, atol 4e-5 as the other tensor-parallel tests)."""

from __future__ import annotations

import pytest

import piper_nb as pn

pytestmark = pytest.mark.dist
SGD = pn.optim.SGD(lr=0.1)


@pytest.mark.parametrize("pin, top", [(None, 5), ({"pp": 2}, 2), ({"tp": 2}, 2),
                                      ({"cp": 2}, 2), ({"cp": 2, "tp": 2}, 1)],
                         ids=["top5", "pipelined", "tensor-parallel", "context-parallel",
                              "context-x-tensor-parallel"])
def test_the_top_candidates_train_like_one_process(cluster4, same, one_thread, pin, top):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16)
    batch = model.example_batch(batch_size=8, seed=0)
    result = pn.search(model, batch, devices=4, precision="fp32", progress=False, top=top,
                       pin=pin)
    assert len(result.ranked) == top
    for c in result.ranked:
        spec = pn.annotate(model, c.annotation)
        plan = pn.compile(spec, c.program, batch)
        got = pn.train(plan, batch, 2, SGD, cluster=cluster4)
        same(got, pn.reference_train(spec, batch, 2, plan.reference_microbatches, SGD))
