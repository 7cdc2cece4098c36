"""Every tensor-parallel pattern must match: a plan pattern that matches no module (a
typo, annotate-style brackets), a module no style can cut (GPT-2's Conv1D, a norm), and a
directive that shards nothing in its regions are each a PlanError naming the directive,
the pattern and the closest module names; the fix each suggests compiles."""

from __future__ import annotations

import pytest

import piper_nb as pn

ONE = {"": {"PP": 0}}
MLP = {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.gate": "colwise",
       "blocks.*.mlp.down": "rowwise"}


def llama():
    return pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)


def compile_tp(model, program, ann=ONE):
    return pn.compile(pn.annotate(model, ann), program, model.example_batch(batch_size=4, seed=0))


@pytest.mark.parametrize("spell, match", [
    ("blocks.*.mlp.{}s", r"plan pattern 'blocks.\*.mlp.ups' \(colwise\) matches no module of "
     r"Llama; closest: 'blocks.\*.mlp.up'.*; fix or remove it"),
    ("blocks.[0-1].mlp.{}", r"matches no module of Llama \(a plan takes \* for any one "
     r"component, not brackets\); closest: 'blocks.\*.mlp.up'"),
])
def test_a_pattern_that_matches_no_module_names_the_closest(spell, match):
    """Before: every pattern missing, the plan compiled as TP and sharded nothing."""
    plan = {spell.format(k.rsplit(".", 1)[1]): v for k, v in MLP.items()}
    with pytest.raises(pn.PlanError, match=r"directive #0 \(tensor_parallel\): .*" + match):
        compile_tp(llama(), [pn.tensor_parallel({}, [0, 1], plan=plan)])
    fixed = compile_tp(llama(), [pn.tensor_parallel({}, [0, 1], plan=MLP)])   # the fix
    assert "blocks.1.mlp.up.weight" in fixed.tp_params


def test_a_directive_that_shards_nothing_in_its_regions():
    model = llama()
    plan = {"head.proj": "colwise_gather_output"}   # the head is in region PP=1
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
               pn.tensor_parallel({"PP": 0}, [0, 1], plan=plan)]
    with pytest.raises(pn.PlanError, match=r"directive #2 \(tensor_parallel\): .*the plan "
                       r"\('head.proj'\) shards nothing in region\(s\) PP=0.*fix the patterns"):
        compile_tp(model, program, ann=pn.cut_stages(model, 2))
    program[-1] = pn.tensor_parallel({"PP": 0}, [0, 1], plan=MLP)   # the fix
    assert "blocks.0.mlp.up.weight" in compile_tp(model, program,
                                                  ann=pn.cut_stages(model, 2)).tp_params


def test_a_module_no_style_cuts_is_named_by_its_type():
    plan = {**MLP, "blocks.*.norm1": "colwise"}
    with pytest.raises(pn.PlanError, match=r"plan gives blocks.0.norm1 \(RMSNorm\) colwise, "
                       "but tensor_parallel shards only nn.Linear and nn.Embedding; give it "
                       "'replicate'"):
        compile_tp(llama(), [pn.tensor_parallel({}, [0, 1], plan=plan)])
    compile_tp(llama(), [pn.tensor_parallel({}, [0, 1], plan={**plan, "blocks.*.norm1":
                                                              "replicate"})])   # the fix


GPT2_PLAN = {"h.*.attn.c_attn": "colwise:3", "h.*.attn.c_proj": "rowwise",
             "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise"}


def gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def gpt2_batch():
    import torch
    ids = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def test_gpt2s_conv1d_is_refused_by_name():
    model = gpt2()
    with pytest.raises(pn.PlanError, match=r"plan gives transformer.h.0.attn.c_attn \(Conv1D\) "
                       "colwise.*transformers' Conv1D, GPT-2's, is a transposed linear layer"):
        pn.compile(pn.annotate(model, ONE), [pn.tensor_parallel({}, [0, 1], plan=GPT2_PLAN)],
                   gpt2_batch())
