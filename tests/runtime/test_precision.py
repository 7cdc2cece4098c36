"""`precision="bf16"`: bf16 weights, activations and gradients, fp32 master weights and
optimizer state, gradients reduced in fp32 (default) or bf16; trained like the bf16
reference (`reference_train(precision="bf16")`), sized by the memory model byte for byte
(tests/sim/test_memory_vs_runtime.py) and costed at the bf16 peak.

Tolerance: bf16 keeps 8 significant bits, so neighbouring values differ by 2^-8 to 2^-7
relative. The plan and the reference round at different places (a microbatch split over
replicas, the order of a reduction, fp32 or bf16 reduction), so a loss or a weight may land
one or two bf16 steps apart: losses and weights are compared at torch.testing's bf16
tolerance (rtol 1.6e-2), with atol 1e-3 for weights near zero (a few steps at the weights'
scale; 2 lr per step under Adam, see below). fp32 plans stay at rtol 1e-5."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import piper_nb as pn
from piper_nb import strategies
from piper_nb.sim import HARDWARE
from piper_nb.strategies import PP2_DP2_ZERO3
from piper_nb.train import reference_train, train

SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)


def _compile(name: str, reduce_dtype: str | None = None):
    model, batch = strategies._gpt("test", layers=4)
    spec = pn.annotate(model, pn.cut_stages(model, 4 if name == "dualpipev" else 2))
    if name == "dualpipev":
        program = pn.schedules.dualpipev(ranks=2, microbatches=4, place=True)
    elif name == "1f1b":
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                   *pn.schedules.one_f_one_b(2, 4)]
    else:
        zero = int(name[-1])
        program = [dict(d, zero=zero) if d["op"] == "replicate" else d for d in PP2_DP2_ZERO3]
    return pn.compile(spec, program, batch, precision="bf16", reduce_dtype=reduce_dtype), batch


@pytest.mark.dist
@pytest.mark.parametrize("name,reduce_dtype,opt", [
    ("1f1b", None, ADAMW), ("zero1", "fp32", SGD), ("zero3", "bf16", SGD),
    ("zero2", None, ADAMW), ("dualpipev", None, SGD)])
def test_bf16_plans_train_like_the_bf16_reference(name, reduce_dtype, opt, cluster2, cluster4):
    plan, batch = _compile(name, reduce_dtype)
    assert plan.precision == "bf16" and plan.reduce_dtype == ("bfloat16" if reduce_dtype ==
                                                              "bf16" else "float32")
    result = train(plan, batch, 3, opt, cluster=cluster2 if plan.world == 2 else cluster4,
                   seed=0, clip_grad_norm=1.0)
    ref = reference_train(plan.capture.model, batch, 3, plan.microbatches, opt,
                          precision="bf16", clip_grad_norm=1.0)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1.6e-2, atol=0)
    torch.testing.assert_close(torch.tensor(result.grad_norms), torch.tensor(ref.grad_norms),
                               rtol=1.6e-2, atol=0)
    got, want = result.state_dict(), ref.state_dict()
    init = plan.capture.model.state_dict()
    # Adam scales each element's step to about lr whatever its gradient, so an element whose
    # gradient is rounding noise can move by lr either way at every step: 2 lr per step
    atol = 2 * opt.keywords["lr"] * 3 if opt is ADAMW else 1e-3
    for k, v in want.items():
        assert got[k].dtype == torch.bfloat16 == v.dtype
        torch.testing.assert_close(got[k], v, rtol=1.6e-2, atol=atol,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert any(not torch.equal(got[k], init[k]) for k in init)


def test_a_bf16_plan_is_bf16_throughout_and_costed_at_the_bf16_peak():
    model, batch = strategies._gpt("test")
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, PP2_DP2_ZERO3, batch, precision="bf16")
    fp32 = pn.compile(spec, PP2_DP2_ZERO3, batch)
    assert {d for _, d in plan.params.values()} == {"bfloat16"}
    assert {v.dtype for v in plan.values.values()} <= {"bfloat16", "int64"}
    assert model.embed.tok.weight.dtype == torch.float32          # the user's model untouched
    again = pn.Plan.from_json(plan.to_json())
    assert (again.precision, again.reduce_dtype) == ("bf16", "float32")
    # matmuls alone priced (memory free, no launch): their time is FLOPs over the peak of
    # the plan's dtype, the tensor cores' for bf16, the CUDA cores' for fp32
    h100 = dataclasses.replace(HARDWARE["H100"], hbm_bandwidth=1e30, launch_overhead=0.0)
    bf16_f = pn.CostModel.analytic(plan, h100).passes[(0, "F")]
    fp32_f = pn.CostModel.analytic(fp32, h100).passes[(0, "F")]
    assert fp32_f / bf16_f == pytest.approx(h100.peak_flops / h100.fp32_flops)
    with pytest.raises(pn.PlanError, match="precision must be one of fp32, bf16"):
        pn.compile(spec, PP2_DP2_ZERO3, batch, precision="fp16")
    with pytest.raises(pn.PlanError, match="reduce_dtype must be 'fp32' or 'bf16'"):
        pn.compile(spec, PP2_DP2_ZERO3, batch, precision="bf16", reduce_dtype="fp16")
