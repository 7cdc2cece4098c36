"""Planning without weights: a model built under `torch.device("meta")` compiles, passes
the static checks, simulates with uniform and analytic costs and gets a memory model, and
allocates nothing; training it is refused with what to do."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb.sim.flops import region_flops

transformers = pytest.importorskip("transformers")

ANNOTATIONS = {"model.embed_tokens": {"PP": 0}, "model.layers.[0-1]": {"PP": 0},
               "model.layers.[2-3]": {"PP": 1}, "model.norm": {"PP": 1}, "lm_head": {"PP": 1}}


def build(device: str):
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, attn_implementation="eager")
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    ids = torch.zeros(8, 16, dtype=torch.long, device=device)
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]
    return model, pn.compile(pn.annotate(model, ANNOTATIONS), program, (ids, ids))


def test_a_meta_model_plans_like_the_real_one():
    meta_model, meta = build("meta")
    _, real = build("cpu")
    assert all(p.is_meta for p in meta_model.parameters())
    assert meta.values.keys() == real.values.keys()
    assert meta.saved == real.saved                      # saved activations, byte for byte
    for cost in (pn.CostModel.uniform(), pn.CostModel.analytic(real, "H100")):
        a, b = pn.simulate(meta, cost), pn.simulate(real, cost)
        assert a.peak_memory == b.peak_memory
        assert a.step_time == pytest.approx(b.step_time)
    analytic = pn.CostModel.analytic(meta, "H100")
    assert analytic.passes == pytest.approx(pn.CostModel.analytic(real, "H100").passes)


def test_a_tensor_parallel_meta_plan_costs_like_the_real_one():
    """Parts that only sum (a vocabulary-parallel embedding as a stage of its own returns
    its lookup through an alias after the all-reduce) are counted on meta too."""
    plans = []
    for device in ("meta", "cpu"):
        with torch.device(device):
            model = pn.models.Llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64)
        ids = torch.zeros(4, 16, dtype=torch.long, device=device)
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                   pn.tensor_parallel({"PP": "*"}, [[0, 1], [2, 3]]),
                   *pn.schedules.one_f_one_b(2, 2)]
        ann = {"embed": {"PP": 0}, "blocks": {"PP": 1}, "head": {"PP": 1}}
        plans.append(pn.compile(pn.annotate(model, ann), program, (ids, ids)))
    meta, real = plans
    assert meta.params["embed.weight"][0] == (32, 32)
    stage0 = [r.index for r in meta.regions if dict(r.tags)["PP"] == 0]
    assert len(stage0) == 3   # the range mask | the lookup | its sum, aliased out
    # every part alike, attention included (SDPA's CPU kernel was counted as 0 FLOPs)
    assert region_flops(meta) == region_flops(real)
    assert pn.simulate(meta, pn.CostModel.analytic(meta, "H100")).step_time > 0


def test_profiling_and_training_a_meta_model_are_refused_with_the_way_out():
    model, plan = build("meta")
    with pytest.raises(pn.PlanError, match=r"meta device .*CostModel\.analytic"):
        pn.simulate(plan)
    with pytest.raises(pn.PlanError, match="pn.train: the model is on the meta device"):
        pn.train(plan, (torch.zeros(8, 16, dtype=torch.long),) * 2, steps=1,
                 optimizer=pn.optim.SGD(lr=0.1))
    with pytest.raises(pn.PlanError, match="reference_train: the model is on the meta device"):
        pn.reference_train(model, (torch.zeros(8, 16, dtype=torch.long),) * 2, steps=1,
                           microbatches=4, optimizer=pn.optim.SGD(lr=0.1))


def test_a_meta_moe_plans_with_each_expert_given_its_balanced_share():
    """TinyMoE, top-1 over 2 experts, PP 2 x DP 2 x EP 2 on the meta device: the router has
    no values, so each expert is given tokens x 1 / 2 rows; everything the routing does not
    size is as the CPU model's plan has it."""
    from piper_nb.strategies import MATRIX
    real_model, batch, annotation, program = MATRIX["pp2-dp2-ep2"]("test")
    with torch.device("meta"):
        model = pn.models.TinyMoE(**real_model.config)
    meta = pn.compile(pn.annotate(model, annotation), program,
                      tuple(t.to("meta") for t in batch))
    real = pn.compile(pn.annotate(real_model, annotation), program, batch)
    tokens = batch[0].shape[0] // 4 // 2 * batch[0].shape[1]   # per microbatch and replica
    assert meta.rows and {meta.values[v].shape[0] for v in meta.rows} == {tokens // 2}
    dense = set(real.values) - set(real.rows) - set(meta.rows)
    assert {v: meta.values[v].shape for v in dense} == {v: real.values[v].shape for v in dense}
    trace = pn.simulate(meta, pn.CostModel.analytic(meta, "H100"))
    assert trace.step_time > 0


def test_a_nonzero_the_meta_device_cannot_size_is_refused():
    class Picky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return h[(h > 0).any(-1).nonzero().squeeze(-1)]

    with torch.device("meta"):
        model = Picky()
    x = torch.zeros(8, 4, device="meta")
    with pytest.raises(pn.PlanError, match="not a router's expert mask"):
        pn.compile(pn.annotate(model, {"": {"PP": 0}}), [pn.place({}, [0])], (x, x),
                   loss_fn=lambda out, t: out.sum(), capture="export")
