"""The loss over the global batch (`loss_mean="global"`): every plan equals one process on
the whole batch, with no microbatching, against a plain PyTorch loop written here. Labels
are padded (-100), so the mean of microbatch means would differ. Also the loss forms a
`loss_fn` may return ((loss, metrics), a dict) and the metrics in `StepMetrics`."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from torch import nn

import piper_nb as pn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import assert_like, tiny_llama  # noqa: E402

pytestmark = pytest.mark.dist
S = pn.schedules
RTOL, ATOL = 1e-5, 4e-5
IGNORE = -100


class Stack(nn.Module):
    """Token ids -> logits over 4 tagged stages (DualPipeV puts two on each rank)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.mid:
            h = torch.tanh(layer(h))
        return self.head(h)


ANNOTATIONS = {"emb": {"PP": 0}, "mid.0": {"PP": 1}, "mid.1": {"PP": 2}, "head": {"PP": 3}}


def token_sum(logits, labels):
    """The documented form of a global loss: (sum over the microbatch, what it counts)."""
    s = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                    ignore_index=IGNORE, reduction="sum")
    return s, (labels != IGNORE).sum()


def token_mean(logits, labels):
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                       ignore_index=IGNORE)


def padded_batch(seed: int, n: int = 8, length: int = 6):
    """Rows padded at different lengths: the microbatches hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 16, (n, length), generator=g)
    labels = torch.randint(0, 16, (n, length), generator=g)
    for row in range(n):
        labels[row, (row * 5) % length + 1:] = IGNORE
    return ids, labels


def full_batch_loop(model, batches, lr: float, loss_of, clip: float | None = None):
    """One process, the whole batch at once, no microbatching: what a user trains."""
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for batch in batches:
        opt.zero_grad()
        loss = loss_of(model, batch)
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, model.state_dict()


PROGRAMS = {
    "pp2-1f1b": lambda: S.one_f_one_b(2, 4, place=True),
    "pp2-dp2-zero3": lambda: [
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2], zero=3), pn.replicate({"PP": 1}, [1, 3], zero=3),
        *S.one_f_one_b(2, 2)],
    "dualpipev": lambda: S.dualpipev(2, 4, place=True),
}
TWO = {"emb": {"PP": 0}, "mid.0": {"PP": 0}, "mid.1": {"PP": 1}, "head": {"PP": 1}}
ANNOTATE = {"pp2-1f1b": TWO, "pp2-dp2-zero3": TWO, "dualpipev": ANNOTATIONS}
CLUSTER = {"pp2-1f1b": "cluster2", "pp2-dp2-zero3": "cluster4", "dualpipev": "cluster2"}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_plan_trains_the_whole_batch_token_mean(request, name):
    """PP 2 1F1B, PP 2 x DP 2 ZeRO-3 and DualPipeV: each equals one process on the whole
    batch, where the default (mean of microbatch means) would not."""
    model = Stack()
    batches = [padded_batch(s) for s in range(3)]
    spec = pn.annotate(model, ANNOTATE[name])
    plan = pn.compile(spec, PROGRAMS[name](), batches[0], loss_fn=token_sum, loss_mean="global")
    assert plan.loss_mean == "global" and plan.reference_microbatches == 1
    assert any(str(i) == "count:AR" for dp in plan.devices for i in dp.instrs)
    result = pn.train(plan, iter(batches), 3, pn.optim.SGD(0.5),
                      cluster=request.getfixturevalue(CLUSTER[name]))
    want = full_batch_loop(model, batches, 0.5, lambda m, b: token_mean(m(b[0]), b[1]))
    assert_like(result, *want)
    mean_of_means = pn.reference_train(model, iter(batches), 3, plan.microbatches,
                                       pn.optim.SGD(0.5), loss_fn=token_mean)
    assert abs(mean_of_means.losses[0] - want[0][0]) > 1e-3   # the test can tell them apart


def test_the_reference_and_clipping_under_the_global_loss(cluster4):
    """reference_train(loss_mean="global") is the whole batch's loss at any microbatch
    count; clipping reads the gradients divided by the count (the norm after the count)."""
    model = Stack()
    batches = [padded_batch(s) for s in range(2)]
    spec = pn.annotate(model, TWO)
    plan = pn.compile(spec, PROGRAMS["pp2-dp2-zero3"](), batches[0], loss_fn=token_sum,
                      loss_mean="global", clip_grad_norm=0.05)
    texts = [str(i) for i in plan.devices[0].instrs]
    assert texts.index("count:AR") < texts.index("norm:AR") < texts.index("r0:U")
    result = pn.train(plan, iter(batches), 2, pn.optim.SGD(0.5), cluster=cluster4)
    want = full_batch_loop(model, batches, 0.5, lambda m, b: token_mean(m(b[0]), b[1]),
                           clip=0.05)
    assert_like(result, *want)
    for micro in (1, 4):
        ref = pn.reference_train(model, iter(batches), 2, micro, pn.optim.SGD(0.5),
                                 loss_fn=token_sum, loss_mean="global", clip_grad_norm=0.05)
        assert_like(ref, *want)


def test_a_hugging_face_model_trains_its_token_mean_over_the_global_batch(cluster4):
    """A Llama with padded labels and its own loss: num_items_in_batch as the Trainer
    counts it (labels[..., 1:] other than -100, across replicas), under PP 2 x DP 2."""
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(transformers)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 32, (8, 6), generator=g)
    labels = ids.clone()
    for row in range(8):
        labels[row, row % 5 + 1:] = IGNORE
    batch = {"input_ids": ids, "labels": labels}
    spec = pn.annotate(model, {"model.embed_tokens": {"PP": 0}, "model.layers.0": {"PP": 0},
                               "model.layers.1": {"PP": 1}, "model.norm": {"PP": 1},
                               "model.rotary_emb": {"PP": 0}, "lm_head": {"PP": 1}})
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=3), pn.replicate({"PP": 1}, [1, 3], zero=3),
               *S.one_f_one_b(2, 2)]
    plan = pn.compile(spec, program, batch, loss_mean="global")
    result = pn.train(plan, batch, 2, pn.optim.SGD(0.5), cluster=cluster4)
    want = full_batch_loop(model, [batch] * 2, 0.5, lambda m, b: m(**b).loss)
    assert_like(result, *want)


@pytest.mark.parametrize("form, capture", [("tuple", "fx"), ("dict", "fx"), ("tuple", "export")])
def test_a_loss_with_metrics_reports_them_per_step(cluster2, form, capture):
    """(loss, metrics) and {"loss": ..., **metrics}: the loss trains as usual, the metrics
    are each microbatch's averaged, in StepMetrics and the progress text."""
    model = Stack()
    batch = padded_batch(0, length=4)

    def with_metrics(logits, labels):
        loss = token_mean(logits, labels)
        valid = labels != IGNORE
        hits = ((logits.argmax(-1) == labels) & valid).sum() / valid.sum()
        return (loss, {"accuracy": hits}) if form == "tuple" else {"loss": loss, "accuracy": hits}

    spec = pn.annotate(model, ANNOTATE["pp2-1f1b"])
    plan = pn.compile(spec, PROGRAMS["pp2-1f1b"](), batch, loss_fn=with_metrics, capture=capture)
    result = pn.train(plan, batch, 2, pn.optim.SGD(0.5), cluster=cluster2)
    ref = pn.reference_train(model, batch, 2, plan.microbatches, pn.optim.SGD(0.5),
                             loss_fn=with_metrics)
    assert_like(result, ref.losses, ref.state_dict())
    for got, want in zip(result.metrics, ref.metrics, strict=True):
        assert got.metrics.keys() == {"accuracy"}
        assert got.metrics["accuracy"] == pytest.approx(want.metrics["accuracy"], rel=1e-6)
    assert "accuracy" in result.metrics[0].text()
    first = ref.metrics[0].metrics["accuracy"]
    model_c = copy.deepcopy(model)
    logits = model_c(batch[0])
    by_hand = [((logits[i:i + 2].argmax(-1) == batch[1][i:i + 2]) & (batch[1][i:i + 2] != IGNORE))
               .sum().item() / (batch[1][i:i + 2] != IGNORE).sum().item() for i in range(0, 8, 2)]
    assert first == pytest.approx(sum(by_hand) / 4, rel=1e-6)


def test_loss_forms_that_cannot_work_are_refused_at_compile():
    model = Stack()
    batch = padded_batch(0)
    spec = pn.annotate(model, ANNOTATE["pp2-1f1b"])
    program = PROGRAMS["pp2-1f1b"]()
    with pytest.raises(pn.PlanError, match=r"loss_mean='global': token_mean must return "
                                           r"\(sum, count\)"):
        pn.compile(spec, program, batch, loss_fn=token_mean, loss_mean="global")
    with pytest.raises(pn.PlanError, match=r"the loss is a tensor of shape \[2, 6\], computed "
                                           r"in region .*must be a scalar"):
        pn.compile(spec, program, batch, loss_fn=lambda o, y: nn.functional.cross_entropy(
            o.transpose(1, 2), y, reduction="none"))
    with pytest.raises(pn.PlanError, match=r"loss_mean='average'"):
        pn.compile(spec, program, batch, loss_fn=token_sum, loss_mean="average")
