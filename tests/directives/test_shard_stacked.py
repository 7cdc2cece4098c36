"""`shard` on Hugging Face's stacked experts: Mixtral and Qwen3-MoE, whose blocks keep all
experts in one `*Experts` module with stacked parameters, cut into expert slices
(`pn.expert_slices`) and spread over 2 devices, alone (EP2 on 2 devices) and under a
pipeline (PP2 x DP2 x EP2 on 4). Each trains 2 steps like one process, its state dict holds
the full stacked tensors again, and the memory model equals the runtime's count byte for
byte. Also: the annotation's errors, the pieces each device holds, and planning on the
meta device with a balanced routing."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb.cluster import checkpoint, dcp
from piper_nb.runtime.layout import assemble_state
from piper_nb.sim import CostModel, MemorySettings

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 8, 8
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               attn_implementation="eager")
OPT = pn.optim.AdamW(1e-3)


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **_COMMON))


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        head_dim=8, **_COMMON))


FAMILIES = {"mixtral": mixtral, "qwen3_moe": qwen3_moe}


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def two_stages(model) -> dict:
    return {"model.embed_tokens": {"PP": 0}, "model.layers.0": {"PP": 0},
            "model.layers.1": {"PP": 1}, "model.norm": {"PP": 1}, "lm_head": {"PP": 1},
            **pn.expert_slices(model, 2)}


STRATEGIES = {   # (annotation, program, microbatches)
    "ep2": (lambda m: {"": {"PP": 0}, **pn.expert_slices(m, 2)},
            lambda: [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]),
                     pn.split({}, "MB", 2)], 2),
    "pp2_dp2_ep2": (two_stages, lambda: [
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
        pn.shard({"PP": 0, "EP": "*"}, [0, 2]), pn.shard({"PP": 1, "EP": "*"}, [1, 3]),
        *pn.schedules.one_f_one_b(ranks=2, microbatches=2)], 2),
}


@pytest.fixture(scope="module")
def models():
    cache: dict = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(0)
            cache[family] = FAMILIES[family]()
        return cache[family]
    return get


def test_slices_become_expert_regions_holding_their_pieces(models):
    model = models("mixtral")
    plan = pn.compile(pn.annotate(model, STRATEGIES["ep2"][0](model)),
                      STRATEGIES["ep2"][1](), batch())
    experts = {r.name: r.params for r in plan.regions if "EP" in dict(r.tags)}
    assert experts["PP=0,EP=1,SEG=1"] == ("model.layers.1.mlp.experts.gate_up_proj[2:4]",
                                          "model.layers.1.mlp.experts.down_proj[2:4]")
    assert len(experts) == 4   # 2 layers x 2 slices
    assert plan.params["model.layers.0.mlp.experts.gate_up_proj[0:2]"][0] == (2, 128, 32)
    assert "model.layers.0.mlp.experts.gate_up_proj" not in plan.params
    assert plan.pieces["model.layers.0.mlp.experts.down_proj[2:4]"] == (
        "model.layers.0.mlp.experts.down_proj", 2, 4)
    # device d updates the pieces of slice d only; nothing of the experts is replicated
    for d in (0, 1):
        held = {p for i in plan[d].compute() if i.kind == "U" for p in i.data.params
                if "experts" in p}
        assert held == {p for p in plan.pieces if p.endswith(f"[{2 * d}:{2 * d + 2}]")}
    assert pn.Plan.from_json(plan.to_json()).pieces == plan.pieces
    # the workers' pieces go back into the stacked tensors, in expert order
    full = {n: torch.randn(*s) for n, (s, _) in plan.params.items()}
    state = assemble_state(plan, [{"full": {n: t for n, t in full.items()
                                            if not n.endswith("[2:4]")}, "shards": {}},
                                  {"full": {n: t for n, t in full.items()
                                            if n.endswith("[2:4]")}, "shards": {}}])
    stacked = "model.layers.1.mlp.experts.gate_up_proj"
    assert torch.equal(state[stacked], torch.cat([full[stacked + "[0:2]"],
                                                  full[stacked + "[2:4]"]]))
    assert state.keys() == dict(model.named_parameters()).keys()
    assert all("forward" not in vars(m) for m in model.modules())   # the model is as it was


def test_uneven_slices_by_hand_go_round_robin(models):
    model = models("qwen3_moe")
    cut = {f"model.layers.{i}.mlp.experts[{lo}:{hi}]": {"EP": s}
           for i in (0, 1) for s, (lo, hi) in enumerate(((0, 1), (1, 3), (3, 4)))}
    plan = pn.compile(pn.annotate(model, {"": {"PP": 0}, **cut}), STRATEGIES["ep2"][1](), batch())
    on = {d: sorted({p.rpartition(".")[2] for i in plan[d].compute() if i.kind == "U"
                     for p in i.data.params if "experts" in p}) for d in (0, 1)}
    assert on == {0: ["down_proj[0:1]", "down_proj[3:4]", "gate_up_proj[0:1]",
                      "gate_up_proj[3:4]"], 1: ["down_proj[1:3]", "gate_up_proj[1:3]"]}


@pytest.mark.parametrize("bad, message", [
    ({"model.layers.0.mlp.experts[0:3]": {"EP": 0}}, r"stop at expert 3 of 4"),
    ({"model.layers.0.mlp.experts[0:2]": {"EP": 0}, "model.layers.0.mlp.experts[1:4]": {"EP": 1}},
     r"must cover its 4 experts"),
    ({"model.layers.0.mlp.experts[0:2]": {"EP": 0}, "model.layers.0.mlp.experts[2:4]": {"EP": 0}},
     r"needs tags of its own"),
    ({"model.layers.0.mlp.gate[0:2]": {"EP": 0}}, r"not a stacked-experts module"),
])
def test_bad_slices_say_what_to_annotate(models, bad, message):
    with pytest.raises(pn.PlanError, match=message):
        pn.annotate(models("mixtral"), {"": {"PP": 0}, **bad})


def test_expert_slices_need_a_divisor_of_the_expert_count(models):
    with pytest.raises(pn.PlanError, match=r"4 experts of model.layers.0.mlp.experts do not "
                                           r"split into 3 equal slices"):
        pn.expert_slices(models("qwen3_moe"), 3)
    with pytest.raises(pn.PlanError, match="no stacked-experts module"):
        pn.expert_slices(pn.models.TinyMoE(), 2)
    with pytest.raises(pn.PlanError, match=r"captured by torch.export"):
        model = models("mixtral")
        pn.compile(pn.annotate(model, {"": {"PP": 0}, **pn.expert_slices(model, 2)}),
                   [pn.place({}, [0])], batch(), capture="fx")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_stacked_experts_plan_on_the_meta_device_with_a_balanced_routing(family):
    """Without weights the dispatch's `nonzero` has nothing to count: each slice of 2 of 4
    experts is given its balanced share, tokens x top-2 x 2 / 4, and the plan compiles and
    simulates as PP 2 x DP 2 x EP 2 does on the CPU."""
    with torch.device("meta"):
        meta = FAMILIES[family]()
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta")
    annotation, program, _ = STRATEGIES["pp2_dp2_ep2"]
    plan = pn.compile(pn.annotate(meta, annotation(meta)), program(), (ids, ids))
    tokens = BATCH // 2 // 2 * SEQ                 # per replica and microbatch
    dispatched = {v for dp in plan.devices for i in dp.instrs
                  if i.kind == "ALL_TO_ALL" and i.purpose == "dispatch" and not i.data.grad
                  for v in i.data.values}
    rows = {plan.values[v].shape[0] for v in dispatched}
    assert rows == {tokens * 2 * 2 // 4}
    torch.manual_seed(0)
    real = pn.compile(pn.annotate(FAMILIES[family](), annotation(meta)), program(), batch())
    dense = set(real.values) - set(real.rows) - set(plan.rows)
    assert {v: plan.values[v].shape for v in dense} == {v: real.values[v].shape for v in dense}
    trace = pn.simulate(plan, CostModel.analytic(plan, "H100"))
    assert trace.step_time > 0 and max(trace.peak_memory.values()) > 0


@pytest.mark.dist
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_stacked_experts_train_like_one_process(family, strategy, models, cluster2, cluster4,
                                                one_thread, tmp_path):
    model = models(family)
    annotation, program, micro = STRATEGIES[strategy]
    plan = pn.compile(pn.annotate(model, annotation(model)), program(), batch())
    cluster = cluster4 if plan.world == 4 else cluster2
    got = pn.train(plan, batch(), steps=2, optimizer=OPT, cluster=cluster,
                   checkpoint_dir=tmp_path)
    ref = pn.reference_train(model, batch(), steps=2, microbatches=micro, optimizer=OPT)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    mine, theirs = got.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
    # a DCP checkpoint holds the pieces as chunks of the stacked tensors, and reads whole
    saved, _ = dcp.read(checkpoint.latest(tmp_path))
    assert all(torch.equal(saved[k], mine[k]) for k in mine)   # (it also holds buffers)
    # the memory model counts what the runtime held, sample by sample (the last step)
    tokens = got.trace.meta.get("tokens")
    assert tokens is not None
    predicted = pn.simulate(plan, CostModel.uniform(),
                            memory=MemorySettings(optimizer=OPT, tokens=tokens))
    for d in range(plan.world):
        meas = [m for m in got.trace.memory if m.device == d]
        pred = [m for m in predicted.memory if m.device == d]
        assert len(meas) == len(pred) == len(plan[d].instrs)
        for i, (a, b) in enumerate(zip(meas, pred, strict=True)):
            kinds = ("params", "grads", "optim", "activations", "buffers")
            assert [getattr(a, k) for k in kinds] == [getattr(b, k) for k in kinds], (
                f"device {d}, instruction {i} ({plan[d].instrs[i]})")
    assert predicted.peak_memory == got.trace.peak_memory
