"""A Hugging Face model trained by a plan comes back in its own format: `Result.state_dict()`
loads into the model class, `save_pretrained` writes it, and `from_pretrained` of that local
folder gives the very same weights (GPT-2: tied embeddings, the lm_head saved once)."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

transformers = pytest.importorskip("transformers")


@pytest.mark.dist
def test_a_trained_hf_model_saves_and_reloads_with_from_pretrained(tmp_path, cluster2,
                                                                    one_thread):
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    ann = {"transformer.wte": {"PP": 0}, "transformer.wpe": {"PP": 0},
           "transformer.h.0": {"PP": 0}, "transformer.h.1": {"PP": 1},
           "transformer.ln_f": {"PP": 1}, "lm_head": {"PP": 1}}
    plan = pn.compile(pn.annotate(model, ann), [pn.place({"PP": 0}, [0]),
                      pn.place({"PP": 1}, [1]), *pn.schedules.one_f_one_b(2, 4)], batch)
    result = pn.train(plan, batch, 2, torch.optim.AdamW, cluster=cluster2, seed=0,
                      clip_grad_norm=1.0)
    trained = transformers.GPT2LMHeadModel(config)
    trained.load_state_dict(result.state_dict())       # strict
    assert trained.lm_head.weight is trained.transformer.wte.weight   # still tied
    trained.save_pretrained(tmp_path / "gpt2")
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    want = result.state_dict()
    got = again.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(want["transformer.wte.weight"], model.transformer.wte.weight)
