"""Batches as real models have them: a dict of named tensors (input_ids, attention_mask,
labels), each split on dim 0; outputs as ModelOutputs; the model's own loss or a loss_fn
on its output. Trained equal to the reference, and bad batches refused before anything
runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import piper_nb as pn
from piper_nb.capture.batch import Batch

transformers = pytest.importorskip("transformers")

VOCAB = 64


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="eager"))


ANNOTATIONS = {"model.embed_tokens": {"PP": 0}, "model.layers.0": {"PP": 0},
               "model.layers.1": {"PP": 1}, "model.norm": {"PP": 1}, "lm_head": {"PP": 1}}


def dict_batch(n: int = 8, seq: int = 8) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[::2, :2] = 0                                    # left padding on every other row
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def logits_loss(out, labels):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                           ignore_index=-100)


PROGRAM = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
           *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]


@pytest.mark.dist
@pytest.mark.parametrize("loss_fn", [None, logits_loss], ids=["own_loss", "loss_fn_on_logits"])
def test_a_dict_batch_trains_like_one_process(loss_fn, cluster2, one_thread):
    model, batch = llama(), dict_batch()
    plan = pn.compile(pn.annotate(model, ANNOTATIONS), PROGRAM, batch, loss_fn=loss_fn)
    assert plan.batch_names == ("input_ids", "attention_mask", "labels")
    assert "input_ids" in plan.regions[0].inputs        # the first stage needs no labels
    assert "labels" not in plan.regions[0].inputs
    opt = pn.optim.SGD(lr=0.05, momentum=0.9)
    got = pn.train(plan, batch, steps=2, optimizer=opt, cluster=cluster2)
    ref = pn.reference_train(model, batch, steps=2, microbatches=4, optimizer=opt,
                             loss_fn=loss_fn)
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5,
                               atol=1e-6)
    mine, theirs = got.state_dict(), ref.state_dict()
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6)


def test_the_dict_batch_is_split_into_microbatches_like_a_pair():
    model, batch = llama(), dict_batch()
    plan = pn.compile(pn.annotate(model, ANNOTATIONS), PROGRAM, batch)
    for name in plan.batch_names:
        assert plan.values[name].shape == (2, 8)         # 8 samples / 4 microbatches


@pytest.mark.parametrize("batch, message", [
    ({"input_ids": torch.zeros(4, 3, dtype=torch.long), "labels": torch.zeros(5, 3)},
     r"disagree on the batch size \(input_ids: 4, labels: 5\)"),
    ({"input_ids": [1, 2]}, r"batch\['input_ids'\] must be a tensor"),
    ({"loss": torch.zeros(2)}, "keys must be Python identifiers other than 'loss'"),
    ({"input-ids": torch.zeros(2)}, "keys must be Python identifiers"),
    (torch.zeros(2, 3), "a batch is \\(inputs, targets\\) or a dict of tensors"),
])
def test_bad_batches_are_refused_with_the_reason(batch, message):
    with pytest.raises(pn.PlanError, match=message):
        Batch.of(batch)


def test_a_dict_batch_with_a_loss_fn_needs_labels():
    model = llama()
    batch = {"input_ids": dict_batch()["input_ids"]}
    with pytest.raises(pn.PlanError, match="needs a 'labels' entry"):
        pn.compile(pn.annotate(model, ANNOTATIONS), PROGRAM, batch, loss_fn=logits_loss)


@pytest.mark.dist
def test_training_on_a_batch_of_other_keys_is_refused(cluster2):
    model, batch = llama(), dict_batch()
    plan = pn.compile(pn.annotate(model, ANNOTATIONS), PROGRAM, batch)
    other = {k: v for k, v in batch.items() if k != "attention_mask"}
    with pytest.raises(pn.PlanError, match="the batch has .* but the plan was compiled for"):
        pn.train(plan, other, steps=1, optimizer=pn.optim.SGD(lr=0.1), cluster=cluster2)


def test_the_designer_opens_on_a_dict_batch():
    from piper_nb.ui.designer import Designer
    from piper_nb.ui.state import cut
    model, batch = llama(), dict_batch()
    d = Designer(model, batch, debounce=None, program=PROGRAM, annotations=ANNOTATIONS)
    out = d.refresh()
    assert out.problems == [] and out.plan.batch_names == tuple(batch)
    assert isinstance(d.state.batch, Batch) and not d.state.batch.is_pair   # named once
    assert cut(d.state, 2, by="flops").annotations      # FLOPs counted on the dict batch
