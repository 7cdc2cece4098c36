"""Regions compiled with torch.compile (`pn.compile_regions`) train exactly like one
process: 1F1B, DualPipeV and zero bubble (their split backwards run the compiled backward
for BI and again for BW), ZeRO-3, TP 2 and recompute, on AOTAutograd with eager kernels
(`backend="aot_eager"`: the graphs the workers trace and partition, quick to compile), and
with inductor's generated kernels on a pipeline. fp32, rtol 1e-5 and atol 4e-5 (inductor
fuses reductions, which sums in another order; on these models the losses moved by 4e-8).
The compile's time is the first step's (`Result.compile_s`); `print(plan)` lists the
compiled regions; a directive the compile cannot take is a PlanError."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

pytestmark = pytest.mark.dist
SGD = pn.optim.SGD(lr=0.1)
RTOL, ATOL = 1e-5, 4e-5


def llama(layers: int = 2):
    return pn.models.Llama(vocab=32, dim=32, layers=layers, heads=4, kv_heads=2, hidden=64,
                           seq=16)


def _train(model, ann, program, cluster, steps=3, opt=SGD):
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, ann), program, batch)
    result = pn.train(plan, batch, steps, opt, cluster=cluster)
    ref = pn.reference_train(model, batch, steps, plan.reference_microbatches, opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    got = result.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    assert result.leftover == []
    return plan, result


AOT = pn.compile_regions({}, backend="aot_eager")


@pytest.mark.parametrize("name", ["1f1b", "dualpipev", "zero_bubble"])
def test_compiled_pipelines(cluster2, name):
    model = llama(4 if name == "dualpipev" else 2)
    schedule = {"1f1b": lambda: pn.schedules.one_f_one_b(2, 4),
                "dualpipev": lambda: pn.schedules.dualpipev(ranks=2, microbatches=4, place=True),
                "zero_bubble": lambda: pn.schedules.zero_bubble(2, 4, place=True)}[name]()
    places = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1])] if name == "1f1b" else []
    stages = 4 if name == "dualpipev" else 2
    plan, result = _train(model, pn.cut_stages(model, stages), [*schedule, *places, AOT],
                          cluster2)
    passes = [i for i in plan.devices[1].instrs if i.kind in pn.ir.kinds.PASSES]
    assert passes and all(i.data.compiled == "aot_eager" for i in passes)
    assert result.compile_s[0] > 0 and result.compile_s[1:] == [0.0, 0.0]
    assert "compiled (aot_eager): r0, r1" in str(plan)


@pytest.mark.parametrize("name", ["zero3", "tp2", "recompute"])
def test_compiled_with_data_and_tensor_parallelism(cluster2, name):
    model = llama()
    more = {"zero3": [pn.replicate({}, [0, 1], zero=3), pn.split({}, num=2)],
            "tp2": [pn.tensor_parallel({}, [0, 1])],
            "recompute": [pn.replicate({}, [0, 1]), pn.recompute({}), pn.split({}, num=2)]}[name]
    _train(model, {"": {"PP": 0}}, [*more, AOT], cluster2, opt=pn.optim.AdamW(1e-2))


def test_inductor_kernels_on_a_pipeline(cluster2):
    """Inductor's own kernels (C++ on this CPU), each stage compiled once per worker."""
    model = llama()
    plan, result = _train(model, pn.cut_stages(model, 2),
                          [*pn.schedules.one_f_one_b(2, 2), pn.place({"PP": 0}, [0]),
                           pn.place({"PP": 1}, [1]),
                           pn.compile_regions({"PP": 1}), pn.compile_regions({})], cluster2)
    assert {i.data.compiled for d in plan.devices for i in d.instrs
            if i.kind in pn.ir.kinds.PASSES} == {"inductor"}
    assert result.compile_s[0] > 0


def test_what_compile_regions_refuses():
    with pytest.raises(pn.PlanError, match="names MB"):
        pn.compile_regions({"MB": 0})
    with pytest.raises(pn.PlanError, match="mode is one of default"):
        pn.compile_regions({}, mode="fast")
    with pytest.raises(pn.PlanError, match="backend is one of inductor, aot_eager"):
        pn.compile_regions({}, backend="cudagraphs")
    model = llama()
    with pytest.raises(pn.PlanError, match=r"compile_regions filter \{'PP': 3\} matches no "
                                           "region"):
        pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                   [pn.place({"PP": 0}, [0]), pn.compile_regions({"PP": 3})],
                   model.example_batch(batch_size=4, seed=0))
