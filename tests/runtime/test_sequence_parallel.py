"""Sequence parallelism trains exactly like one process: the composition table of the
sequence-parallel issue (TP 2 and 4 with SP, PP 2 x TP 2 + SP under 1F1B and DualPipeV,
TP 2 + SP x DP 2 under ZeRO 3, SP with full recompute, with bf16 and with dropout, Llama
and Qwen3 from transformers), each against `pn.reference_train`. fp32, rtol 1e-5, atol
4e-5 as the tensor-parallel tests: the sums over the group add partial products in another
order than one matmul does."""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.models.gpt import LanguageModel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import tiny_family  # noqa: E402

pytestmark = pytest.mark.dist
S = pn.schedules
SGD = pn.optim.SGD(lr=0.1)
RTOL, ATOL = 1e-5, 4e-5
LAYERS = {"embed": {"PP": 0, "L": 0}, "blocks.0": {"PP": 0, "L": 1},
          "blocks.1": {"PP": 0, "L": 2}, "head": {"PP": 0, "L": 3}}
ONE = {"": {"PP": 0}}


def llama(kv_heads: int = 2, layers: int = 2):
    return pn.models.Llama(vocab=32, dim=32, layers=layers, heads=4, kv_heads=kv_heads,
                           hidden=64, seq=8)


def _same(result, ref, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=rtol, atol=atol)
    got = result.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k].float(), v.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{k}: {m}")


def _train(model, ann, program, cluster, batch=None, steps=3, seed=None, **compile_kw):
    batch = batch if batch is not None else model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, ann)   # the reference draws each region's masks as a plan does
    plan = pn.compile(spec, program, batch, **compile_kw)
    result = pn.train(plan, batch, steps, SGD, cluster=cluster, seed=seed)
    ref = pn.reference_train(spec, batch, steps, plan.reference_microbatches, SGD, seed=seed,
                             **{k: v for k, v in compile_kw.items() if k == "precision"})
    return plan, result, ref


def _slices(plan, name: str) -> tuple:
    return plan.values[name].shape


@pytest.mark.parametrize("t, ann", [(2, ONE), (2, LAYERS), (4, LAYERS)])
def test_tp_with_sp_trains_like_one_process(request, t, ann):
    cluster = request.getfixturevalue(f"cluster{t}")
    plan, result, ref = _train(llama(kv_heads=4 if t == 4 else 2), ann,
                               [pn.tensor_parallel({}, list(range(t)), sequence_parallel=True),
                                pn.split({}, num=2)], cluster)
    _same(result, ref)
    # the residual stream between the layers is each device's slice of the sequence
    stream = [v for r in plan.regions for v in r.outputs if v.startswith("add")]
    assert stream and all(plan.values[v].shape == (4, 8 // t, 32) for v in stream)
    # each layer's norm weights are read through copies whose gradients the group sums
    norms = [i for i in plan[0].instrs if i.purpose == pn.Purpose.TP and i.data.grad
             and any(plan.values[v].shape == (32,) for v in i.data.values)]
    assert norms


@pytest.mark.parametrize("ann", [LAYERS, ONE])
def test_layers_around_that_take_the_whole_sequence(cluster2, ann):
    """TinyGPT with only its blocks sharded: the embeddings' sum is cut on entry to the
    first layer (from a copy whose gradient shares the group sums) and the last layer's slices are laid
    back whole for the head and its loss, in their own region or in the layers' one."""
    model = pn.models.TinyGPT(vocab=32, dim=32, layers=2, heads=4, seq=8)
    plan, result, ref = _train(model, ann, [
        pn.tensor_parallel({}, [0, 1], sequence_parallel=True), pn.split({}, num=2)], cluster2)
    _same(result, ref)
    assert plan.capture.tp.sequence


class _Pooled(nn.Module):
    """An MLP block whose replicated part subtracts the mean over the sequence (the whole
    sequence laid back for it) and adds a learned offset made in the same part."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)
        self.offset = nn.Parameter(torch.linspace(-1, 1, 8))

    def forward(self, x):
        h = x + self.down(F.relu(self.up(x)))
        return h - h.mean(dim=1, keepdim=True) + torch.tanh(self.offset * 2)


class _PooledModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.block, self.head = nn.Embedding(16, 8), _Pooled(), nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))

    def loss_fn(self, logits, targets):
        return F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))


def test_a_mean_over_the_sequence_between_the_layers(cluster2):
    model = _PooledModel()
    ids = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(0))
    ann = {"embed": {"PP": 0, "L": 0}, "block": {"PP": 0, "L": 1}, "head": {"PP": 0, "L": 2}}
    _, result, ref = _train(model, ann, [pn.tensor_parallel(
        {}, [0, 1], plan={"block.up": "colwise", "block.down": "rowwise"},
        sequence_parallel=True), pn.split({}, num=2)], cluster2, batch=(ids, ids))
    _same(result, ref)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p", "dualpipev"])
def test_pp2_tp2_sp(cluster4, schedule):
    if schedule != "dualpipev":   # zb1p: the input gathered again is read until BW
        model = llama()
        ann = pn.cut_stages(model, 2)
        build = S.one_f_one_b if schedule == "1f1b" else S.zero_bubble
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                   pn.tensor_parallel({"PP": 0}, [0, 1], sequence_parallel=True),
                   pn.tensor_parallel({"PP": 1}, [2, 3], sequence_parallel=True),
                   *build(2, 4)]
    else:
        model = llama(layers=4)
        ann = pn.cut_stages(model, 4)
        program = [pn.tensor_parallel({"PP": "*"}, [[0, 2], [1, 3]], sequence_parallel=True),
                   *S.dualpipev(2, 4, place=True)]
    plan, result, ref = _train(model, ann, program, cluster4)
    _same(result, ref)
    sends = [i for dp in plan.devices for i in dp.instrs
             if i.kind == pn.Op.SEND and not i.data.grad]
    assert sends and all(plan.values[v].shape[1] == 4 for i in sends for v in i.data.values
                         if len(plan.values[v].shape) == 3)   # slices go between stages


def test_tp2_sp_dp2_zero3(cluster4):
    program = [pn.replicate({}, [0, 2], zero=3),
               pn.tensor_parallel({}, [[0, 1], [2, 3]], sequence_parallel=True),
               pn.split({}, num=2)]
    _, result, ref = _train(llama(), ONE, program, cluster4)
    _same(result, ref)


def test_sp_with_full_recompute(cluster2):
    _, result, ref = _train(llama(), LAYERS, [
        pn.tensor_parallel({}, [0, 1], sequence_parallel=True), pn.split({}, num=2),
        pn.recompute({"L": 1})], cluster2)
    _same(result, ref)


def test_sp_bf16(cluster2):
    _, result, ref = _train(llama(), LAYERS, [
        pn.tensor_parallel({}, [0, 1], sequence_parallel=True), pn.split({}, num=2)],
        cluster2, precision="bf16")
    _same(result, ref, rtol=1.6e-2, atol=1e-3)


class _Layer(nn.Module):
    """Megatron's GPT layer: dropout after attention and after the MLP, on slices under SP."""

    def __init__(self, dim: int, heads: int, p: float):
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (z.reshape(b, s, -1, d // self.heads).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(d // self.heads), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)
        x = x + F.dropout(self.out(y), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.p, self.training)


class _GPT(LanguageModel):
    tp_plan = {"blocks.*.qkv": "colwise:3", "blocks.*.out": "rowwise",
               "blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.config = dict(vocab=32, seq=8)
        self.embed = nn.Embedding(32, 32)
        self.blocks = nn.ModuleList([_Layer(32, 4, 0.25) for _ in range(2)])
        self.head = nn.Linear(32, 32, bias=False)


def test_sp_with_dropout_on_slices_draws_one_process_masks(cluster2):
    model = _GPT()
    program = [pn.tensor_parallel({}, [0, 1], sequence_parallel=True), pn.split({}, num=2)]
    plan, result, ref = _train(model, LAYERS, program, cluster2, seed=3)
    _same(result, ref)
    off = pn.reference_train(pn.annotate(model, LAYERS), model.example_batch(8, 0), 3, 2, SGD,
                             seed=4)
    assert abs(off.losses[0] - result.losses[0]) > 1e-4   # the masks make a difference


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_transformers_models_with_sp(request, family):
    model = tiny_family(pytest.importorskip("transformers"), family)
    ids = torch.randint(3, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
               pn.tensor_parallel({"PP": 0}, [0, 1], sequence_parallel=True),
               pn.tensor_parallel({"PP": 1}, [2, 3], sequence_parallel=True),
               *S.one_f_one_b(2, 2)]
    _, result, ref = _train(model, pn.cut_stages(model, 2), program,
                            request.getfixturevalue("cluster4"), batch=batch, steps=2)
    _same(result, ref)
