"""Hugging Face models, dense and mixture-of-experts, built from tiny configs with random
weights, captured by torch.export and trained like one process: Llama, Qwen3, GPT-2 (tied
embeddings), Mixtral and Qwen3-MoE, each under PP2 1F1B, PP2 x DP2 with ZeRO-1 and ZeRO-3,
and DualPipeV on 2 ranks. The loss is the model's own (`forward(input_ids, labels=...)`),
no loss_fn given; dropout is off, as equality with the reference needs."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.dist

VOCAB, SEQ, BATCH, STEPS = 64, 8, 8, 2
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
               attn_implementation="eager")


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON))


def qwen3():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=8, **_COMMON))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager"))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **_COMMON))


def qwen3_moe():
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
        head_dim=8, **_COMMON))


FAMILIES = {"llama": llama, "qwen3": qwen3, "gpt2": gpt2, "mixtral": mixtral,
            "qwen3_moe": qwen3_moe}


def stages(name: str, n: int) -> dict:
    """Layer i of 4 on stage i * n // 4; the embeddings on the first, the head on the last."""
    base = "transformer" if name == "gpt2" else "model"
    layers = "h" if name == "gpt2" else "layers"
    ann = {f"{base}.{layers}.{i}": {"PP": i * n // 4} for i in range(4)}
    first = ["transformer.wte", "transformer.wpe"] if name == "gpt2" else ["model.embed_tokens"]
    last = ["transformer.ln_f", "lm_head"] if name == "gpt2" else ["model.norm", "lm_head"]
    return {**{p: {"PP": 0} for p in first}, **ann, **{p: {"PP": n - 1} for p in last}}


def pp_dp(zero: int) -> list:
    return [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
            pn.replicate({"PP": 0}, [0, 2], zero=zero), pn.replicate({"PP": 1}, [1, 3], zero=zero),
            *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]


STRATEGIES = {
    "pp2_1f1b": (2, lambda: [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                             *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]),
    "pp2_dp2_zero1": (2, lambda: pp_dp(1)),
    "pp2_dp2_zero3": (2, lambda: pp_dp(3)),
    "dualpipev": (4, lambda: pn.schedules.dualpipev(ranks=2, microbatches=4, place=True)),
}


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


OPTIMIZER = pn.optim.SGD(lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def built():
    """Per family: the model, its specs by stage count (one export each, shared by the
    strategies through the spec's capture cache) and the reference run."""
    cache: dict = {}

    def get(family: str, n_stages: int):
        if family not in cache:
            torch.manual_seed(0)
            model = FAMILIES[family]()
            ref = pn.reference_train(model, batch(), steps=STEPS, microbatches=4,
                                     optimizer=OPTIMIZER)
            cache[family] = (model, {}, ref)
        model, specs, ref = cache[family]
        if n_stages not in specs:
            specs[n_stages] = pn.annotate(model, stages(family, n_stages))
        return specs[n_stages], ref
    return get


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_like_one_process(family, strategy, built, cluster2, cluster4, one_thread):
    n_stages, program = STRATEGIES[strategy]
    spec, ref = built(family, n_stages)
    plan = pn.compile(spec, program(), batch())
    assert plan.capture.method == "export"
    cluster = cluster4 if plan.world == 4 else cluster2
    got = pn.train(plan, batch(), steps=STEPS, optimizer=OPTIMIZER, cluster=cluster)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    mine, theirs = got.state_dict(), ref.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_dropout_runs_repeat_exactly_given_the_seed(cluster2, one_thread):
    """Each region's random stream is seeded per step, microbatch and replica: a run with
    dropout repeats exactly under the same seed (equality with the single-process
    reference needs dropout off: the reference draws one stream for the whole model)."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.1,
        embd_pdrop=0.1, attn_pdrop=0.1, attn_implementation="eager"))
    ann = {"transformer.wte": {"PP": 0}, "transformer.wpe": {"PP": 0}, "transformer.h.0": {"PP": 0},
           "transformer.h.1": {"PP": 1}, "transformer.ln_f": {"PP": 1}, "lm_head": {"PP": 1}}
    plan = pn.compile(pn.annotate(model, ann), STRATEGIES["pp2_1f1b"][1](), batch())
    opt = pn.optim.SGD(lr=0.05)
    runs = [pn.train(plan, batch(), steps=2, optimizer=opt, cluster=cluster2, seed=s).losses
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def mistral():
    return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=4, **_COMMON))


def gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        sliding_window=4, head_dim=8, **_COMMON))


@pytest.mark.parametrize("strategy", ["pp2_1f1b", "pp2_dp2_zero3"])
@pytest.mark.parametrize("make", [mistral, gemma2])
def test_sliding_window_masks_of_the_root_forward_are_recomputed_per_stage(
        make, strategy, cluster2, cluster4, one_thread):
    """Mistral and Gemma2 build their sliding-window masks (and a cache they drop) in the
    root `forward`, outside every module: annotated by module path, each stage recomputes
    the masks from the batch and trains like one process; the window of 4 in sequences of 8
    changes the loss, so a stage that lost it would show."""
    torch.manual_seed(0)
    model = make()
    ref = pn.reference_train(model, batch(), steps=STEPS, microbatches=4, optimizer=OPTIMIZER)
    model.config.sliding_window = SEQ
    wide = pn.reference_train(model, batch(), steps=1, microbatches=4, optimizer=OPTIMIZER)
    model.config.sliding_window = 4
    assert abs(wide.losses[0] - ref.losses[0]) > 1e-4
    plan = pn.compile(pn.annotate(model, stages("llama", 2)), STRATEGIES[strategy][1](), batch())
    last = plan.capture.regions[-1]
    sent = [v for v in last.inputs if v not in plan.capture.batch and "sym_size" not in v]
    assert len(sent) == 1, f"stage 1 is sent {sent}, not only the hidden states"
    got = pn.train(plan, batch(), steps=STEPS, optimizer=OPTIMIZER,
                   cluster=cluster4 if plan.world == 4 else cluster2)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    mine, theirs = got.state_dict(), ref.state_dict()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")


def test_bloom_keeps_its_custom_gelu_backward_from_a_dict_batch(cluster2, one_thread):
    """Bloom's MLP applies `GeLUFunction` (a custom autograd Function) in training; export
    keeps it whole, so PP 2 from a dict batch trains like one process."""
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=4, n_head=4, hidden_dropout=0.0,
        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    ids = batch()[0]
    named = {"input_ids": ids, "labels": ids.clone()}
    ann = {"transformer.word_embeddings": {"PP": 0},
           "transformer.word_embeddings_layernorm": {"PP": 0},
           **{f"transformer.h.{i}": {"PP": i // 2} for i in range(4)},
           "transformer.ln_f": {"PP": 1}, "lm_head": {"PP": 1}}
    plan = pn.compile(pn.annotate(model, ann), STRATEGIES["pp2_1f1b"][1](), named)
    assert [f.__name__ for f in plan.capture.functions.values()] == ["GeLUFunction"]
    pn.simulate(plan)
    got = pn.train(plan, named, steps=STEPS, optimizer=OPTIMIZER, cluster=cluster2)
    ref = pn.reference_train(model, named, steps=STEPS, microbatches=4, optimizer=OPTIMIZER)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got.state_dict()[k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"{k}: {m}")
