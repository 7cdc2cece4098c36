"""`pn.recompute`: a recomputed region trains exactly like one process under PP, DP,
ZeRO-3 (resharding or not), ZB1P's split backward, DualPipeV and expert parallelism; its
forward keeps no saved activations (the runtime's and the ledger's counts drop by
`plan.saved`), its backward costs one forward more, and a region that changes buffers is
refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import piper_nb as pn
from piper_nb.directives.recompute import Recompute
from piper_nb.directives.spec import directive_from_json
from piper_nb.plan.instr import Pass
from piper_nb.sim import CostModel, MemorySettings
from piper_nb.strategies import MATRIX

OPT = pn.optim.AdamW(1e-2)


def _gpt(stages: int = 2):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    return model, pn.cut_stages(model, stages)


PROGRAMS = {
    "pp-1f1b": (2, lambda: [*pn.schedules.one_f_one_b(2, 4, place=True),
                            pn.recompute({"PP": 0})]),
    "pp-one-microbatch": (2, lambda: [*pn.schedules.gpipe(2, 4, place=True),
                                      pn.recompute({"PP": 1, "MB": 2})]),
    "dp": (2, lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1]), pn.split({}, "MB", 2),
                       pn.recompute({})]),
    "zero3": (2, lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1], zero=3),
                          pn.split({}, "MB", 2), pn.recompute({"PP": 1})]),
    "zero3-no-reshard": (2, lambda: [pn.place({}, [0, 1]),
                                     pn.replicate({}, [0, 1], zero=3, reshard=False),
                                     pn.split({}, "MB", 2), pn.recompute({})]),
    "zb1p": (2, lambda: [*pn.schedules.zero_bubble(2, 4, place=True),
                         pn.recompute({"PP": "*"})]),
    "dualpipev": (4, lambda: [*pn.schedules.dualpipev(2, 4, place=True),
                              pn.recompute({"PP": 1}), pn.recompute({"PP": 3})]),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_recompute_trains_like_one_process(cluster2, one_thread, name):
    stages, make = PROGRAMS[name]
    model, annotation = _gpt(stages)
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, annotation), make(), batch)
    assert any(isinstance(i.data, Pass) and i.data.recompute
               for dp in plan.devices for i in dp.instrs)
    result = pn.train(plan, batch, 2, OPT, cluster=cluster2)
    ref = pn.reference_train(model, batch, 2, plan.microbatches, OPT)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=4e-5)
    got, want = result.state_dict(), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=4e-5)
    assert result.leftover == []


def _after_last_forward(plan, trace, device: int) -> int:
    """Activation bytes `device` holds right after its last forward."""
    last = max(i for i, ins in enumerate(plan.devices[device].instrs) if ins.kind == "F")
    return [m for m in trace.memory if m.device == device][last].activations


@pytest.mark.dist
def test_activation_bytes_drop_by_the_plans_saved_bytes(cluster2, one_thread):
    """GPipe keeps all 4 microbatches' stashes after the last forward: recomputing stage 0
    drops 4 x plan.saved[0] there, in the runtime's count and in the prediction."""
    model, annotation = _gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, annotation)
    plain = pn.compile(spec, pn.schedules.gpipe(2, 4, place=True), batch)
    rc = pn.compile(spec, [*pn.schedules.gpipe(2, 4, place=True), pn.recompute({"PP": 0})],
                    batch)
    assert rc.saved[0] > 0
    drops = []
    for plan in (plain, rc):
        measured = pn.train(plan, batch, 2, OPT, cluster=cluster2).trace
        predicted = pn.simulate(plan, CostModel.uniform(), memory=MemorySettings(optimizer=OPT))
        drops.append([_after_last_forward(plan, t, 0) for t in (measured, predicted)])
    assert drops[0][0] == drops[0][1] and drops[1][0] == drops[1][1]
    assert drops[0][0] - drops[1][0] == 4 * rc.saved[0]
    # device 1 recomputes nothing: the same count
    assert rc.devices[1].instrs == plain.devices[1].instrs


def test_a_recomputed_backward_costs_one_forward_more():
    model, annotation = _gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, annotation)
    plan = pn.compile(spec, [*pn.schedules.zero_bubble(2, 4, place=True),
                             pn.recompute({"PP": 1})], batch)
    trace = pn.simulate(plan, CostModel.uniform(F=1, B=3, W=1))
    took = {(e.kind, e.region): e.end - e.start for e in trace.events if e.stream == "compute"}
    assert took[("F", 1)] == 1 and took[("F", 0)] == 1
    assert took[("BI", 1)] == 1 + 2 and took[("BI", 0)] == 2      # BI = B - W, + F
    assert took[("BW", 1)] == 1
    one = pn.compile(spec, [*pn.schedules.one_f_one_b(2, 4, place=True),
                            pn.recompute({"PP": 0})], batch)
    trace = pn.simulate(one, CostModel.uniform(F=1, B=2))
    took = {(e.kind, e.region): e.end - e.start for e in trace.events if e.stream == "compute"}
    assert took[("B", 0)] == 3 and took[("B", 1)] == 2


def test_the_plan_marks_recomputed_passes_and_frees_their_inputs_after_the_backward():
    model, annotation = _gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, annotation),
                      [*pn.schedules.one_f_one_b(2, 2, place=True),
                       pn.recompute({"PP": 1, "MB": 0})], batch)
    marked = {(i.kind, i.mb) for dp in plan.devices for i in dp.instrs
              if isinstance(i.data, Pass) and i.data.recompute}
    assert marked == {("F", 0), ("B", 0)}
    text = plan.devices[1].text(waits=True)
    freed = next(k for k, t in enumerate(text) if t.startswith("free(act:") and "@0" in t)
    assert text[freed - 1] == "r1:B0"                 # the input lives until the backward
    back = pn.Plan.from_json(plan.to_json())
    assert back.devices[1].instrs == plan.devices[1].instrs
    assert "recompute: 1 regions" in plan.dag.history


class _Norm(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.tanh(self.norm(self.a(x))))

    def loss_fn(self, out, y):
        return torch.nn.functional.mse_loss(out, y)


def test_a_region_that_changes_buffers_is_refused():
    model = _Norm()
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    spec = pn.annotate(model, {"a": {"PP": 0}, "norm": {"PP": 0}, "b": {"PP": 1}})
    base = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]), pn.split({}, "MB", 2)]
    pn.compile(spec, [*base, pn.recompute({"PP": 1})], batch, loss_fn=model.loss_fn)
    with pytest.raises(pn.PlanError, match=r"directive #3 \(recompute\).*changes buffers "
                                           r"norm.running_mean.*update them twice"):
        pn.compile(spec, [*base, pn.recompute({"PP": 0})], batch, loss_fn=model.loss_fn)


def test_argument_errors_name_the_directive_and_the_fix():
    model, annotation = _gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    with pytest.raises(pn.PlanError, match=r"recompute filter \{'PP': 5\} matches no forward"):
        pn.compile(pn.annotate(model, annotation),
                   [*pn.schedules.gpipe(2, 2, place=True), pn.recompute({"PP": 5})], batch)
    with pytest.raises(pn.PlanError, match="drop PASS from the filter"):
        pn.recompute({"PP": 0, "PASS": "B"})
    with pytest.raises(pn.PlanError, match="recompute filter must be"):
        pn.recompute([0])


def test_the_designer_row_and_code():
    row = Recompute.row(stages=2, microbatches=4)
    assert directive_from_json(row) == pn.recompute({"PP": 0})
    assert pn.recompute({"PP": 1}).code() == 'pn.recompute({"PP": 1})'


@pytest.mark.dist
def test_recomputed_experts_train_like_one_process_and_count_as_predicted(cluster4, one_thread):
    """PP 2 x DP 2 x EP 2: the expert regions between their all-to-alls are recomputed; the
    token buffers are sized by the routing the step made, as in the memory test. AdamW at
    1e-3, as `tests/runtime/test_equivalence.py` trains this strategy: routing makes some
    gradients tiny, and a larger step would magnify fp32 summation order."""
    opt = pn.optim.AdamW(1e-3)
    model, batch, annotation, program = MATRIX["pp2-dp2-ep2"]("test")
    plan = pn.compile(pn.annotate(model, annotation),
                      [*program, pn.recompute({"PP": 0, "EP": "*"}), pn.recompute({"PP": 1})],
                      batch)
    result = pn.train(plan, batch, 2, opt, cluster=cluster4)
    ref = pn.reference_train(model, batch, 2, plan.microbatches, opt)
    got, want = result.state_dict(), ref.state_dict()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=4e-5)
    predicted = pn.simulate(plan, CostModel.uniform(), memory=MemorySettings(
        optimizer=opt, tokens=result.trace.meta["tokens"]))
    fields = ("device", "params", "grads", "optim", "activations", "buffers")
    assert ([tuple(getattr(m, f) for f in fields) for m in result.trace.memory]
            == [tuple(getattr(m, f) for f in fields) for m in predicted.memory])
