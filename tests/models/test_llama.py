"""The Llama-shaped example model computes what Hugging Face's LlamaForCausalLM computes
(same weights, same logits) and symbolic tracing captures it."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

transformers = pytest.importorskip("transformers")


def hf_twin(m: pn.models.Llama):
    """LlamaForCausalLM with `m`'s configuration and weights."""
    c = m.config
    cfg = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["dim"], intermediate_size=c["hidden"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["kv_heads"], rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(cfg)
    names = {"norm1": "input_layernorm", "norm2": "post_attention_layernorm",
             "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
             "attn.v": "self_attn.v_proj", "attn.o": "self_attn.o_proj",
             "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}
    sd = {"model.embed_tokens.weight": m.embed.weight, "model.norm.weight": m.head.norm.weight,
          "lm_head.weight": m.head.proj.weight}
    for i in range(c["layers"]):
        sd |= {f"model.layers.{i}.{theirs}.weight": m.get_parameter(f"blocks.{i}.{ours}.weight")
               for ours, theirs in names.items()}
    hf.load_state_dict(sd, strict=True)
    return hf


def test_the_same_logits_as_hugging_face_llama():
    m = pn.models.Llama(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, hidden=48, seq=16)
    hf = hf_twin(m)
    tokens, _ = m.example_batch(3)
    assert sum(p.numel() for p in m.parameters()) == sum(p.numel() for p in hf.parameters())
    torch.testing.assert_close(m(tokens), hf(tokens).logits, rtol=1e-5, atol=1e-5)


def test_70b_on_the_meta_device_has_llama_3_70bs_parameters_and_traces():
    with torch.device("meta"):
        m = pn.models.Llama(vocab=128256, dim=8192, layers=2, heads=64, kv_heads=8,
                            hidden=28672, seq=4096)
    per_layer = sum(p.numel() for p in m.blocks[0].parameters())
    rest = sum(p.numel() for p in m.parameters()) - 2 * per_layer
    assert round((80 * per_layer + rest) / 1e9, 2) == 70.55
    torch.fx.symbolic_trace(m)                       # what capture="fx" runs
