"""Expert parallelism as a search knob: a mixture-of-experts model's candidates spread its
experts over each stage's replicas (EP = DP, `pn.shard`) beside those that replicate them;
the EP candidate the search ranks first trains like one process (TinyMoE's listed experts
on 4 workers, alone and under a pipeline; Mixtral's stacked experts on 2); the estimate
divides the experts' states by EP and charges the all-to-alls; a pin the model cannot take
is a PlanError."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb.planner.experts import find_experts
from piper_nb.planner.knobs import space

SGD = pn.optim.SGD(lr=0.1)


def tiny_moe(experts: int = 4):
    model = pn.models.TinyMoE(vocab=64, dim=32, layers=2, experts=experts, top_k=2, heads=2,
                              seq=16)
    return model, model.example_batch(batch_size=8, seed=0)


def mixtral(experts: int = 4):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        num_local_experts=experts, num_experts_per_tok=2, vocab_size=64, hidden_size=32,
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    return model, (ids, torch.roll(ids, -1, dims=1))


def test_the_experts_a_search_finds():
    listed = find_experts(tiny_moe()[0])
    assert [(p, n, s) for p, n, s in listed.modules] == [
        ("blocks.0.moe.experts", 4, False), ("blocks.1.moe.experts", 4, False)]
    stacked = find_experts(mixtral()[0])
    assert {(n, s) for _, n, s in stacked.modules} == {(4, True)}
    assert find_experts(pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=8)) is None
    # listed experts spread unevenly (3 over 2 devices); stacked ones need equal slices
    assert find_experts(tiny_moe(3)[0]).allows(2)
    assert not find_experts(mixtral(3)[0]).allows(2)
    assert not listed.allows(8)


def test_space_tries_ep_equal_to_dp_where_the_experts_allow():
    experts = find_experts(tiny_moe()[0])
    ks = list(space(4, 8, 4, gpus_per_node=8, experts=experts))
    assert {k.ep for k in ks if k.dp == 1} == {1}
    assert {(k.dp, k.ep) for k in ks if k.dp > 1} == {(2, 1), (2, 2), (4, 1), (4, 4)}
    # without experts, or where they are too few, only EP 1
    assert {k.ep for k in space(4, 8, 4, gpus_per_node=8)} == {1}
    assert {k.ep for k in space(8, 8, 4, gpus_per_node=1, experts=experts) if k.dp == 8} == {1}


def test_the_estimate_spreads_expert_states_and_charges_all_to_all():
    model, batch = tiny_moe()
    r = pn.search(model, batch, 4, precision="fp32", progress=False, top=1,
                  pin={"pp": 1, "tp": 1, "zero": 0, "microbatches": 1, "recompute": 0})
    by_ep = {c.knobs.ep: c for c in r.ranked + r.estimated}
    assert set(by_ep) == {1, 4}
    replicated, spread = by_ep[1], by_ep[4]
    # the experts' weights, gradients and Adam state live on one device of four
    assert spread.peak < replicated.peak
    # and each MoE layer's passes wait for four all-to-alls
    assert spread.step > replicated.step


@pytest.mark.dist
@pytest.mark.parametrize("pin", [{"ep": 4}, {"pp": 2, "ep": 2}], ids=["dp4-ep4", "pp2-dp2-ep2"])
def test_ep_candidates_train_like_one_process(cluster4, same, one_thread, pin):
    model, batch = tiny_moe()
    result = pn.search(model, batch, 4, precision="fp32", progress=False, top=1, pin=pin)
    assert len(result.ranked) == 1
    for c in result.ranked:
        spec = pn.annotate(model, c.annotation)
        plan = pn.compile(spec, c.program, batch)
        assert any(i.kind == pn.Op.ALL_TO_ALL for d in plan.devices for i in d.instrs)
        got = pn.train(plan, batch, 2, SGD, cluster=cluster4)
        same(got, pn.reference_train(spec, batch, 2, plan.reference_microbatches, SGD))


@pytest.mark.dist
def test_stacked_experts_candidate_trains_like_one_process(cluster2, same, one_thread):
    model, batch = mixtral()
    result = pn.search(model, batch, 2, precision="fp32", progress=False, top=1,
                       pin={"ep": 2, "zero": 1})
    c = result.best
    assert c.knobs.ep == 2 and "model.layers.0.mlp.experts[2:4]" in c.annotation
    spec = pn.annotate(model, c.annotation)
    plan = pn.compile(spec, c.program, batch)
    got = pn.train(plan, batch, 2, SGD, cluster=cluster2)
    same(got, pn.reference_train(spec, batch, 2, plan.reference_microbatches, SGD))


def test_an_ep_pin_on_a_dense_model_is_a_plan_error():
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=8)
    with pytest.raises(pn.PlanError, match="pin ep=2 spreads experts, and TinyGPT has none"):
        pn.search(model, model.example_batch(batch_size=8, seed=0), 4, pin={"ep": 2},
                  progress=False)
