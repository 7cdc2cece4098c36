"""The measured trace: real overlap of communication and compute, and ZeRO memory ratios.

Events are timed on the workers against a clock aligned at the step start; memory is
counted after every instruction by the compiler's rules (parameters held, gradients,
optimizer state, activations, buffers in flight).
"""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb import optim
from piper_nb.train import train

pytestmark = pytest.mark.dist


def _gpt():
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=False)
    return model, model.example_batch(batch_size=8, seed=0)


def test_1f1b_trace_overlaps_comm_and_compute(cluster2):
    model, batch = _gpt()
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                             *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batch)
    result = train(plan, batch, 2, optim.SGD(0.1), cluster=cluster2)
    trace = result.trace
    assert trace.source == "measured" and trace.devices == (0, 1)
    labels = [e.label for e in trace.events if e.kind in ("F", "B") and e.device == 1]
    assert sorted(labels) == sorted(f"r1:{p}{m}" for p in "FB" for m in range(4))
    for e in trace.events:
        assert 0 <= e.start <= e.end
    comm = [e for e in trace.events if e.kind in ("SEND", "RECV")]
    compute = [e for e in trace.events if e.kind in ("F", "B")]
    overlapping = [(c.label, x.label) for c in comm for x in compute
                   if c.device == x.device and c.start < x.end and x.start < c.end]
    assert overlapping, "no SEND/RECV overlaps a compute event on its device"
    assert len(trace.memory) == sum(len(dp.instrs) for dp in plan.devices)
    assert max(e.end for e in trace.events) <= result.step_times[-1]


def test_zero3_prefetch_gathers_while_the_previous_pass_computes(cluster2):
    """The all-gather for the next pass is issued before the current one and completes
    (its future fires) while that pass runs: the gather's span overlaps a compute span."""
    model, batch = _gpt()
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)], batch)
    text = plan[0].text()
    first_compute = next(i for i, t in enumerate(text) if t.startswith("r0:F"))
    assert ":AG@" in text[first_compute + 1], "the next gather is issued before r0:F0 runs"
    result = train(plan, batch, 2, optim.SGD(0.1), cluster=cluster2)
    gathers = [e for e in result.trace.events if e.kind == "ALL_GATHER"]
    compute = [e for e in result.trace.events if e.kind in ("F", "B", "BI", "BW")]
    overlapping = [(g.label, c.label) for g in gathers for c in compute
                   if g.device == c.device and g.start < c.end and c.start < g.end]
    assert overlapping, "no ZeRO-3 gather ran while a pass computed"


def _end_state(sample) -> int:
    return sample.params + sample.grads + sample.optim


def test_zero_memory_ratios_4_ranks(cluster4):
    """Between uses ZeRO-1 shards optimizer state, ZeRO-3 also parameters: ~1/4 on 4 ranks."""
    model, batch = _gpt()
    spec = pn.annotate(model, {"": {"PP": 0}})
    end, peak_grads = {}, {}
    for zero in (0, 1, 2, 3):
        plan = pn.compile(spec, [pn.replicate({}, [0, 1, 2, 3], zero=zero),
                                 pn.split({}, "MB", 2)], batch)
        result = train(plan, batch, 1, optim.AdamW(1e-3), cluster=cluster4)
        last = {}
        for m in result.trace.memory:
            last[m.device] = m  # samples are in time order per device
        end[zero] = [last[d] for d in range(4)]
        peak_grads[zero] = max(m.grads for m in result.trace.memory if m.device == 0)
    p0 = end[0][0].params
    full = sum(p.numel() * 4 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))   # torch's Adam: one fp32 step count per tensor
    assert p0 == full and end[0][0].optim == 2 * full + steps and end[0][0].grads == 0
    for d in range(4):
        assert end[1][d].params == full
        assert end[1][d].optim == pytest.approx(2 * full / 4, rel=0.01)
        assert end[2][d].optim == pytest.approx(2 * full / 4, rel=0.01)
        assert end[3][d].params == pytest.approx(full / 4, rel=0.01)
        assert _end_state(end[3][d]) == pytest.approx(_end_state(end[0][d]) / 4, rel=0.01)
    # ZeRO-1 keeps the full gradients until its single reduce-scatter; ZeRO-2 reduces them
    # after every microbatch, waiting for each reduction before the next is issued, so at
    # most one microbatch's full gradients beside the shard reduced so far
    assert peak_grads[1] == full
    assert peak_grads[2] == pytest.approx(full + full / 4, rel=0.01)
