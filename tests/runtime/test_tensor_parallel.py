"""Tensor parallelism trains exactly like one process: the composition table of the
tensor-parallel issue (TP 2 and 4 alone, PP 2 x TP 2 under 1F1B and DualPipeV, TP 2 x DP 2
under ZeRO 1, 2 and 3, PP 2 x TP 2 x DP 2 on 8 workers, TP with EP on a mixture of
experts, with recompute, bf16, clipping and torch.optim parameter groups, a vocabulary-
parallel embedding, with and without a padding row, tied to a gathered LM head), then Llama,
Qwen3, Mixtral and Qwen3-MoE from transformers on their own TP plans, each against
`pn.reference_train` and a plain PyTorch loop written here. fp32, rtol 1e-5: a rowwise
layer's all-reduce sums partial products in another order than one matmul does, which
moves the last bit or two (atol 4e-5, as the other fidelity tests)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import piper_nb as pn
from piper_nb.cluster.local import LocalCluster
from piper_nb.strategies import moe_annotation
from piper_nb.tp.styles import model_tp_plan

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import plain_loop, tiny_family  # noqa: E402

pytestmark = pytest.mark.dist
S = pn.schedules
SGD = pn.optim.SGD(lr=0.1)
RTOL, ATOL = 1e-5, 4e-5


def llama(heads: int = 4, kv_heads: int = 2):
    return pn.models.Llama(vocab=32, dim=32, layers=2, heads=heads, kv_heads=kv_heads,
                           hidden=64, seq=8)


def _same(result, ref, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=rtol, atol=atol)
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() >= {k for k in want if not k.endswith("num_batches_tracked")}
    for k, v in want.items():
        torch.testing.assert_close(got[k].float(), v.float(), rtol=rtol, atol=atol,
                                   msg=lambda m, k=k: f"{k}: {m}")


def _train(model, ann, program, cluster, opt=SGD, steps=3, **compile_kw):
    batch = model.example_batch(batch_size=8, seed=0) if hasattr(model, "example_batch") \
        else None
    plan = pn.compile(pn.annotate(model, ann), program, batch, **compile_kw)
    assert any(i.purpose == pn.Purpose.TP for dp in plan.devices for i in dp.instrs)
    result = pn.train(plan, batch, steps, opt, cluster=cluster)
    ref = pn.reference_train(model, batch, steps, plan.reference_microbatches, opt,
                             **{k: v for k, v in compile_kw.items() if k in ("loss_fn", "loss_mean")})
    return plan, result, ref


ONE = {"": {"PP": 0}}


def test_tp2_alone_shards_every_linear_and_trains_like_one_process(cluster2):
    plan, result, ref = _train(llama(), ONE, [pn.tensor_parallel({}, [0, 1]),
                                               pn.split({}, num=2)], cluster2)
    _same(result, ref)
    q = plan.params["blocks.0.attn.q.weight"][0]
    assert q == (16, 32)                     # half the output features on each device
    assert plan.params["blocks.0.attn.o.weight"][0] == (32, 16)   # half the inputs
    assert plan.tp_groups == ((0, 1),)
    assert plan.params["embed.weight"][0] == plan.params["head.proj.weight"][0] == (16, 32)
    # per microbatch: the lookup's all-reduce, one after attention and one after the MLP
    # per block, and the loss's per-token numbers (never the logits)
    fwd = [i for i in plan[1].instrs if i.purpose == pn.Purpose.TP and not i.data.grad]
    assert len(fwd) == 2 * (1 + 2 * 2 + 1) and all(i.data.group == (0, 1) for i in fwd)
    assert _head_reduce(plan, "head.proj.weight") == {(32, 3)}


def test_tp4_alone_on_tinygpt_with_its_fused_qkv(cluster4):
    model = pn.models.TinyGPT(vocab=32, dim=32, layers=2, heads=4, seq=8)
    plan, result, ref = _train(model, ONE, [pn.tensor_parallel({}, [0, 1, 2, 3]),
                                            pn.split({}, num=2)], cluster4)
    _same(result, ref)
    assert plan.tp_params["blocks.0.attn.qkv.weight"] == (0, 4, 3)


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_pp2_tp2(cluster4, schedule):
    model = llama()
    if schedule == "1f1b":
        ann = pn.cut_stages(model, 2)
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                   pn.tensor_parallel({"PP": 0}, [0, 1]), pn.tensor_parallel({"PP": 1}, [2, 3]),
                   *S.one_f_one_b(2, 4)]
    else:   # DualPipeV: stages 0 and 3 on device 0, 1 and 2 on device 1
        ann = pn.cut_stages(model, 4)
        program = [pn.tensor_parallel({"PP": "*"}, [[0, 2], [1, 3]]),
                   *S.dualpipev(2, 4, place=True)]
    plan, result, ref = _train(model, ann, program, cluster4)
    _same(result, ref)
    sends = [i for i in plan[3].instrs if i.kind == pn.Op.SEND]
    assert sends and {i.data.peer for i in sends} <= {1, 2}   # rank 1 talks to rank 1


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_tp2_dp2_zero(cluster4, zero):
    program = [pn.replicate({}, [0, 2], zero=zero), pn.tensor_parallel({}, [[0, 1], [2, 3]]),
               pn.split({}, num=2)]
    plan, result, ref = _train(llama(), ONE, program, cluster4)
    _same(result, ref)
    # each TP rank reduces its own shards: buckets over (0, 2) and over (1, 3)
    assert {b.group for b in plan.buckets} == {(0, 2), (1, 3)}


def test_pp2_tp2_dp2_on_eight_workers():
    model = llama()
    # Megatron's order over devices: TP innermost, then PP, then DP
    program = [pn.place({"PP": 0}, [0, 4]), pn.place({"PP": 1}, [2, 6]),
               pn.replicate({"PP": 0}, [0, 4], zero=1), pn.replicate({"PP": 1}, [2, 6], zero=1),
               pn.tensor_parallel({"PP": 0}, [[0, 1], [4, 5]]),
               pn.tensor_parallel({"PP": 1}, [[2, 3], [6, 7]]), *S.one_f_one_b(2, 2)]
    with LocalCluster(8) as cluster:
        plan, result, ref = _train(model, pn.cut_stages(model, 2), program, cluster)
    _same(result, ref)
    assert plan.world == 8


def test_tp2_with_expert_parallel_moe(cluster4):
    model = pn.models.TinyMoE(vocab=32, dim=32, layers=2, experts=2, top_k=1, heads=2, seq=8)
    program = [pn.place({"PP": 0}, [0, 2]), pn.replicate({"PP": 0}, [0, 2]),
               pn.shard({"PP": 0, "EP": "*"}, [0, 2]),
               pn.tensor_parallel({"PP": 0}, [[0, 1], [2, 3]]), pn.split({}, num=2)]
    plan, result, ref = _train(model, moe_annotation(2, 2, 1), program, cluster4)
    _same(result, ref)
    a2a = {i.data.group for dp in plan.devices for i in dp.instrs if i.kind == pn.Op.ALL_TO_ALL}
    assert a2a == {(0, 2), (1, 3)}


def test_tp2_with_recompute_clipping_and_parameter_groups(cluster2):
    opt = torch.optim.AdamW
    groups = [{"params": "*norm*", "weight_decay": 0.0}, {"params": "*", "lr": 1e-2}]
    model = llama()
    program = [pn.tensor_parallel({}, [0, 1]), pn.recompute({}), pn.split({}, num=2)]
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, ONE), program, batch, clip_grad_norm=0.5)
    result = pn.train(plan, batch, 3, opt, cluster=cluster2, param_groups=groups)
    ref = pn.reference_train(model, batch, 3, 2, opt, clip_grad_norm=0.5, param_groups=groups)
    _same(result, ref)
    assert result.grad_norms and result.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)


def test_tp2_bf16(cluster2):
    model = llama()
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, ONE), [pn.tensor_parallel({}, [0, 1]),
                                                 pn.split({}, num=2)], batch, precision="bf16")
    result = pn.train(plan, batch, 3, SGD, cluster=cluster2)
    ref = pn.reference_train(model, batch, 3, 2, SGD, precision="bf16")
    _same(result, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("layout", ["tp2", "pp2-tp2"])
def test_vocab_parallel_embedding(request, layout):
    model = llama()
    vocab = {**model.tp_plan, "head.proj": "replicate"}   # the embedding alone
    if layout == "tp2":
        ann, cluster = ONE, request.getfixturevalue("cluster2")
        program = [pn.tensor_parallel({}, [0, 1], plan=vocab), pn.split({}, num=2)]
    else:
        ann, cluster = pn.cut_stages(model, 2), request.getfixturevalue("cluster4")
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                   pn.tensor_parallel({"PP": "*"}, [[0, 1], [2, 3]], plan=vocab),
                   *S.one_f_one_b(2, 4)]
    plan, result, ref = _train(model, ann, program, cluster)
    _same(result, ref)
    assert plan.params["embed.weight"][0] == (16, 32)    # half the vocabulary's rows
    assert plan.tp_params["embed.weight"] == (0, 2, 1)


def test_vocab_parallel_embedding_keeps_the_padding_row_out_of_training(cluster2):
    transformers = pytest.importorskip("transformers")
    model = tiny_family(transformers, "llama")
    assert model.model.embed_tokens.padding_idx == 0
    ids = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
    ids[:, :2] = 0   # padding tokens: they look up row 0, which gets no gradient
    batch = {"input_ids": ids, "labels": ids}
    plan_map = {**model_tp_plan(model), "model.embed_tokens": "embedding_rowwise"}
    plan = pn.compile(pn.annotate(model, ONE), [pn.tensor_parallel({}, [0, 1], plan=plan_map),
                                                pn.split({}, num=2)], batch)
    assert plan.tp_params["model.embed_tokens.weight"] == (0, 2, 1)
    result = pn.train(plan, batch, 2, SGD, cluster=cluster2)
    _same(result, pn.reference_train(model, batch, 2, 2, SGD))
    losses, state = plain_loop(model, [batch] * 2, 2, 0.1)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(result.state_dict()["model.embed_tokens.weight"],
                               state["model.embed_tokens.weight"], rtol=RTOL, atol=ATOL)


def test_a_tied_embedding_and_lm_head_cut_by_vocabulary(cluster2):
    model = pn.models.TinyGPT(vocab=32, dim=32, layers=2, heads=4, seq=8)   # tied weights
    plan_map = {**model.tp_plan, "tok": "vocab", "head.proj": "colwise_gather_output"}
    plan, result, ref = _train(model, ONE, [pn.tensor_parallel({}, [0, 1], plan=plan_map),
                                            pn.split({}, num=2)], cluster2)
    _same(result, ref)
    assert plan.tp_params["embed.tok.weight"] == (0, 2, 1)   # one weight, one cut


def _head_reduce(plan, weight="head.proj.weight") -> set[tuple]:
    """The shapes the LM head's part all-reduces forward."""
    head = {r.index for r in plan.regions if weight in r.params}
    return {plan.values[v].shape for dp in plan.devices for i in dp.instrs
            if i.purpose == pn.Purpose.TP and not i.data.grad and i.region in head
            for v in i.data.values}


def _smoothed(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                             targets.reshape(-1), label_smoothing=0.1,
                                             ignore_index=3)


def _summed(logits, targets):   # loss_mean="global": the token sum and the count
    flat = targets.reshape(-1)
    return (torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), flat,
                                              reduction="sum"), (flat != -100).sum())


@pytest.mark.parametrize("style, loss_fn, loss_mean", [
    ("vocab", None, "microbatch"),
    ("colwise", _smoothed, "microbatch"),      # label smoothing, an ignored class
    ("colwise_gather_output", _summed, "global"),  # only the loss reads them: not gathered
])
def test_a_vocab_parallel_loss_never_gathers_the_logits(cluster2, style, loss_fn, loss_mean):
    model = llama()
    plan_map = {**model.tp_plan, "head.proj": style}
    kw = {"loss_fn": loss_fn} if loss_fn else {}
    plan, result, ref = _train(model, ONE, [pn.tensor_parallel({}, [0, 1], plan=plan_map),
                                            pn.split({}, num=2)], cluster2,
                               loss_mean=loss_mean, **kw)
    _same(result, ref)
    assert plan.tp_params["head.proj.weight"] == (0, 2, 1)
    # per token 2 log-sum-exps and the target's logit (and its logits' sum when smoothing)
    assert _head_reduce(plan) == {(4 * 8, 3 + (loss_fn is _smoothed))}


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral", "qwen3moe"])
@pytest.mark.parametrize("layout", ["tp2", "pp2-tp2"])
def test_transformers_models_on_their_own_tp_plans(request, family, layout):
    transformers = pytest.importorskip("transformers")
    model = tiny_family(transformers, family)
    ids = torch.randint(3, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if layout == "tp2":
        ann, cluster = ONE, request.getfixturevalue("cluster2")
        program = [pn.tensor_parallel({}, [0, 1]), pn.split({}, num=2)]
    else:
        ann, cluster = pn.cut_stages(model, 2), request.getfixturevalue("cluster4")
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                   pn.tensor_parallel({"PP": 0}, [0, 1]), pn.tensor_parallel({"PP": 1}, [2, 3]),
                   *S.one_f_one_b(2, 2)]
    plan = pn.compile(pn.annotate(model, ann), program, batch)
    # the model's own plan sharded its projections, and its LM head (colwise_gather_output),
    # whose logits only the loss reads: never gathered
    assert "lm_head.weight" in plan.tp_params and len(plan.tp_params) > 1
    assert _head_reduce(plan, "lm_head.weight") == {(4 * 8, 3)}   # a vocab-parallel loss
    result = pn.train(plan, batch, 2, SGD, cluster=cluster)
    _same(result, pn.reference_train(model, batch, 2, 2, SGD))
    losses, state = plain_loop(model, [batch] * 2, 2, 0.1)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(losses),
                               rtol=RTOL, atol=ATOL)
    got = result.state_dict()
    for k, v in state.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


def test_a_transformers_model_with_attention_dropout_equals_the_seeded_reference(cluster4):
    """Llama with attention dropout 0.5 (eager attention: the probabilities dropped on each
    device's heads), PP 2 x TP 2 on its own TP plan, trains exactly as the seeded
    reference: each stage's masks drawn as in one process, each device keeping its heads'."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, attention_dropout=0.5, attn_implementation="eager"))
    ids = torch.randint(3, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                             pn.tensor_parallel({"PP": 0}, [0, 1]),
                             pn.tensor_parallel({"PP": 1}, [2, 3]), *S.one_f_one_b(2, 2)],
                      batch)
    result = pn.train(plan, batch, 2, SGD, cluster=cluster4, seed=3)
    _same(result, pn.reference_train(spec, batch, 2, 2, SGD, seed=3))
    off = pn.reference_train(spec, batch, 2, 2, SGD, seed=4)   # the masks make a difference
    assert abs(off.losses[0] - result.losses[0]) > 1e-4


def test_a_users_fused_split_given_colwise_k_trains_like_one_process(cluster2):
    """`torch.split(h, [d, d, d], -1)` of a fused projection: plain colwise is refused
    (tests/directives/test_tp_fused.py); the fix it names, colwise:3, trains exactly."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "directives"))
    from test_tp_fused import FusedMLP

    torch.manual_seed(0)
    model = FusedMLP(fuse="split")
    plan = {"gate_up": "colwise:3", "down": "rowwise"}
    _, result, ref = _train(model, ONE, [pn.tensor_parallel({}, [0, 1], plan=plan)], cluster2,
                            loss_fn=torch.nn.functional.mse_loss)
    _same(result, ref)


class _PickedMLP(torch.nn.Module):
    """gate and up in one layer cut colwise:2, taken apart by a view into (2, hidden) and
    its unbind, or by slices (`h[..., :hidden]`): each device takes its share of each."""

    def __init__(self, how: str, dim: int = 16, hidden: int = 12):
        super().__init__()
        self.how, self.hidden = how, hidden
        self.gate_up = torch.nn.Linear(dim, 2 * hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.gate_up(x)
        gate, up = (h[..., :self.hidden], h[..., self.hidden:]) if self.how == "slice" else \
            h.view(x.shape[0], 2, self.hidden).unbind(1)
        return self.down(torch.nn.functional.silu(gate) * up)

    def example_batch(self, batch_size, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 16, generator=g), torch.randn(batch_size, 16, generator=g)


@pytest.mark.parametrize("how", ["view", "slice"])
def test_colwise_k_taken_apart_by_a_view_or_slices_trains_like_one_process(cluster2, how):
    plan = {"gate_up": "colwise:2", "down": "rowwise"}
    _, result, ref = _train(_PickedMLP(how), ONE, [pn.tensor_parallel({}, [0, 1], plan=plan)],
                            cluster2, loss_fn=torch.nn.functional.mse_loss)
    _same(result, ref)


@pytest.mark.parametrize("cls, how", [("NarrowedMLP", "method"), ("NarrowedMLP", "aten"),
                                      ("UnflattenedMLP", "torch"), ("UnflattenedMLP", "unbind")])
def test_colwise_k_taken_apart_by_narrow_or_unflatten_trains_like_one_process(cluster2, cls,
                                                                              how):
    """The fix `colwise:2` that tests/directives/test_tp_fused.py's errors name, applied:
    narrow and unflatten then take each device's share of gate and of up."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                                    "directives"))
    import test_tp_fused

    torch.manual_seed(0)
    model = getattr(test_tp_fused, cls)(how)
    plan = {"gate_up": "colwise:2", "down": "rowwise"}
    _, result, ref = _train(model, ONE, [pn.tensor_parallel({}, [0, 1], plan=plan)],
                            cluster2, loss_fn=torch.nn.functional.mse_loss)
    _same(result, ref)
