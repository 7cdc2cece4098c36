"""The tools on Hugging Face models (tiny configs, random weights, captured by torch.export):
`pn.cut_stages` by parameters and by FLOPs, the Designer driven headless, `pn.simulate`
with the uniform and the analytic cost models, and the memory model. No process starts;
the loss is the model's own (`forward(input_ids, labels=...)`)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import piper_nb as pn
from piper_nb.capture.annotate import flop_counter, pipeline_units
from piper_nb.sim.flops import region_flops, region_inputs
from piper_nb.sim.memory import MIXED_PRECISION_ADAM, device_model_states
from piper_nb.ui.dag_draw import dag_groups
from piper_nb.ui.views import TABS

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, LAYERS = 64, 8, 8, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
               num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=64, attn_implementation="eager")


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **_COMMON))


FAMILIES = {"llama": llama, "mixtral": mixtral}
LAYER_UNITS = [f"model.layers.{i}" for i in range(LAYERS)]
HALVES = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 0,
          "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def pp2() -> list:
    return [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
            *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    torch.manual_seed(0)
    model = FAMILIES[request.param]()
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), pp2(), batch())
    return request.param, model, plan


def pp_of(cut: dict) -> dict:
    return {p: t["PP"] for p, t in cut.items()}


# ---- cut_stages ---------------------------------------------------------------------------
def test_pipeline_units_reach_the_decoder_layers():
    assert pipeline_units(llama()) == ["model.embed_tokens", *LAYER_UNITS, "model.norm",
                                       "model.rotary_emb", "lm_head"]
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    assert pipeline_units(gpt2) == ["transformer.wte", "transformer.wpe", "transformer.drop",
                                    "transformer.h.0", "transformer.h.1", "transformer.ln_f",
                                    "lm_head"]
    cut = pn.cut_stages(gpt2, 2)            # tied lm_head counts no parameters of its own
    assert "transformer.drop" not in cut and cut["lm_head"] == {"PP": 1}


def test_models_with_their_lists_at_the_top_keep_their_units():
    assert pipeline_units(pn.models.TinyGPT(layers=2)) == ["embed", "blocks.0", "blocks.1", "head"]
    assert pipeline_units(pn.models.MLP(depth=3)) == ["layers.0", "layers.1", "layers.2"]
    assert pipeline_units(pn.models.TinyMoE(layers=2)) == ["embed", "blocks.0", "blocks.1", "head"]


@pytest.mark.parametrize("by", ["params", "flops"])
def test_cut_stages_halves_the_layers(family, by):
    name, model, _ = family
    cut = pn.cut_stages(model, 2, by=by)    # flops: runs the model on its dummy_inputs
    assert pp_of(cut) == HALVES             # the rotary table stays untagged: it is glue
    assert pp_of(pn.cut_stages(model, 2, by=by, example=batch())) == HALVES
    assert pp_of(pn.cut_stages(model, 2, by=by, example=batch()[0])) == HALVES
    four = pp_of(pn.cut_stages(model, 4, by=by, example=batch()))
    assert [four[u] for u in LAYER_UNITS] == [0, 1, 2, 3]


def opt():
    """OPT declares `decoder.final_layer_norm` before `decoder.layers` (dropout off: the
    reference draws other masks)."""
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=LAYERS,
        ffn_dim=32, num_attention_heads=2, max_position_embeddings=64, dropout=0.0,
        pad_token_id=1, bos_token_id=2, eos_token_id=2))


@pytest.mark.dist
def test_cut_stages_follows_the_forward_not_the_definition(cluster2):
    torch.manual_seed(0)
    model = opt()
    units = pipeline_units(model)
    assert units.index("model.decoder.final_layer_norm") < units.index("model.decoder.layers.0")
    cut = pp_of(pn.cut_stages(model, 2))
    assert cut["model.decoder.final_layer_norm"] == cut["lm_head"] == 1   # after the layers
    assert [cut[f"model.decoder.layers.{i}"] for i in range(LAYERS)] == [0, 0, 1, 1]
    ids = batch()[0]
    data = {"input_ids": ids, "labels": ids}
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      pn.schedules.one_f_one_b(2, 4, place=True), data)
    assert [r.name for r in plan.regions] == ["PP=0", "PP=1"]
    result = pn.train(plan, data, 2, pn.optim.SGD(0.1), cluster=cluster2)
    ref = pn.reference_train(model, data, 2, plan.reference_microbatches, pn.optim.SGD(0.1))
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=4e-5)


def test_opt_cut_in_definition_order_is_refused_naming_the_cut():
    model = opt()
    units = pipeline_units(model)
    tags = {u: {"PP": int(i >= len(units) // 2)} for i, u in enumerate(units)}
    ids = batch()[0]
    with pytest.raises(pn.PlanError) as e:
        pn.compile(pn.annotate(model, tags), pn.schedules.one_f_one_b(2, 4, place=True),
                   {"input_ids": ids, "labels": ids})
    assert ("model.decoder.final_layer_norm (PP 0) first runs after model.decoder.layers.1, "
            "model.decoder.layers.2, model.decoder.layers.3 (PP 1)") in str(e.value)
    assert "the order 0, 1, 0, 1" in str(e.value)


def test_cut_stages_plan_captures_even_stages(family):
    name, model, plan = family
    assert plan.capture.method == "export"
    assert [r.name for r in plan.capture.regions] == ["PP=0", "PP=1"]
    params = dict(model.named_parameters())
    sizes = [sum(params[p].numel() for p in r.params) for r in plan.capture.regions]
    assert max(sizes) < 1.3 * min(sizes)
    assert any("rotary_emb" in b for r in plan.capture.regions for b in r.buffers)


def test_grouped_matmuls_of_stacked_experts_are_counted():
    torch.manual_seed(0)
    model = mixtral()
    ids = batch()[0][:2]
    plain, ours = FlopCounterMode(display=False), flop_counter()
    with torch.no_grad():
        with plain:
            model(ids)
        with ours:
            model(ids)
    experts = "MixtralForCausalLM.model.layers.0.mlp.experts"
    tokens, k, hidden, inter = ids.numel(), 2, 32, 64
    want = 2 * tokens * k * hidden * (2 * inter) + 2 * tokens * k * inter * hidden
    assert sum(ours.get_flop_counts()[experts].values()) == want
    assert sum(plain.get_flop_counts().get(experts, {}).values()) == 0
    assert ours.get_total_flops() == plain.get_total_flops() + LAYERS * want


def test_attention_on_the_cpu_is_counted_as_on_the_meta_device():
    """torch counts SDPA's CPU kernel as 0 FLOPs; ours counts it as SDPA (4 b h t t d)."""
    b, h, t, d = 2, 4, 16, 8
    counts = []
    for device in ("cpu", "meta"):
        q = torch.randn(b, h, t, d, device=device)
        with torch.no_grad(), flop_counter() as counter:
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        counts.append(counter.get_total_flops())
    assert counts == [4 * b * h * t * t * d] * 2


# ---- simulate and the memory model ----------------------------------------------------------
def test_region_flops_count_every_layer(family):
    name, model, plan = family
    flops = region_flops(plan)
    plain = {}
    for r in range(len(plan.regions)):
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            plan.capture.modules[r](*region_inputs(plan, r))
        plain[r] = counter.get_total_flops()
    if name == "mixtral":            # the exported experts run a custom grouped matmul
        assert all(flops[r] > 2 * plain[r] for r in flops)
    else:
        assert flops == {r: float(f) for r, f in plain.items()}
    assert min(flops.values()) > 0


def test_simulate_uniform_and_analytic(family):
    name, model, plan = family
    uniform = pn.simulate(plan)
    analytic = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"))
    for trace in (uniform, analytic):
        assert list(trace.devices) == [0, 1] and trace.step_time > 0
        assert set(trace.peak_memory) == {0, 1} and min(trace.peak_memory.values()) > 0
        assert trace.figure().data
    assert analytic.unit == "s" and analytic.step_time < 1e-2      # a tiny model on an H100


def test_memory_model_counts_states_and_activations(family):
    name, model, plan = family
    trace = pn.simulate(plan, pn.CostModel.analytic(plan, "H100"))
    params = dict(model.named_parameters())
    for d in trace.devices:
        region = plan.capture.regions[d]
        psi = sum(params[p].numel() for p in region.params)
        states = device_model_states(plan, d, MIXED_PRECISION_ADAM)
        assert sum(states.values()) == pytest.approx(16 * psi)
        samples = [m for m in trace.memory if m.device == d]
        assert samples[-1].activations == 0
        assert plan.saved[d] > 0
        assert max(m.activations for m in samples) >= plan.saved[d] * trace.live_stashes(d)
        assert trace.peak_memory[d] == max(m.total for m in samples)
    assert trace.live_stashes(0) == 2 and trace.live_stashes(1) == 1     # 1F1B on 2 ranks


# ---- the Designer, headless ---------------------------------------------------------------
def bars(fig) -> int:
    return sum(len(t.x) for t in fig.data if t.type == "bar")


def show(designer, tab: str) -> None:
    designer.views.tabs.selected_index = TABS.index(tab)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_designer_opens_edits_and_recuts(name):
    torch.manual_seed(0)
    model = FAMILIES[name]()
    d = pn.Designer(model, batch(), debounce=None)
    try:
        assert d.problems == [] and d.plan.world == 2 and d.plan.capture.method == "export"
        assert pp_of(d.state.annotations) == HALVES          # pn.cut_stages by parameters
        # the Layers panel lists the decoder layers, unfolded down to them
        for unit in LAYER_UNITS:
            assert unit in d.layers.rows
        for parent in ("model", "model.layers"):
            assert d.layers.rows[parent].children_box.layout.display == "flex"
        assert d.layers.rows["model.layers.3"].pp.value == "1"
        assert "PP=0" in d.layers.rows["model.layers.0"].effective.value
        # the DAG: the layers of a stage are one region, so one F per stage and microbatch
        assert '<g id="F[PP=0,MB=0]" class="node">' in d.views.dag.svg
        assert sum(1 for n in d.plan.dag.nodes if n.op.value == "F") == 2 * 4
        groups = dag_groups(d.plan.dag, "MB")
        assert sorted(g for g in groups.members if g.startswith("F[")) == [
            "F[PP=0,MB=0]", "F[PP=1,MB=0]"]
        show(d, "Timeline")
        show(d, "Memory")
        assert bars(d.views.timeline) > 0 and len(d.views.memory.data) == 3
        # an edit of a directive recompiles from the cached capture
        d.microbatches.value = 2
        assert d.problems == [] and d.plan.microbatches == 2
        # a bad tag is a problem on its layer, and stays one across edits of the directives
        d.layers.rows["model.layers.1"].pp.value = "x"
        assert [p.layer for p in d.problems] == ["model.layers.1"]
        d.microbatches.value = 4
        assert [p.layer for p in d.problems] == ["model.layers.1"] and d.plan is None
        # a layer moves to the other stage
        d.layers.rows["model.layers.1"].pp.value = "1"
        assert d.problems == [] and d.state.annotations["model.layers.1"] == {"PP": 1}
        assert d.plan.microbatches == 4
        stage1 = next(r for r in d.plan.capture.regions if r.name == "PP=1")
        assert any(p.startswith("model.layers.1.") for p in stage1.params)
        # cut again by FLOPs (runs the model on the Designer's batch)
        d.layers.cut_by.value = "flops"
        d.layers.cut()
        assert d.problems == [] and pp_of(d.state.annotations) == HALVES
        d.views.cost.value = "analytic"
        assert d.problems == [] and d.trace.unit == "s"
    finally:
        d.close()
