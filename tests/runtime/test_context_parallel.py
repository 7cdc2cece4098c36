"""Context parallelism trains exactly like one process: CP 2 and CP 4, zigzag and
contiguous, with ZeRO-3 and with full recompute, PP 2 x CP 2 under 1F1B, CP 2 x DP 2 with
ZeRO-3, CP 2 x TP 2 (with SP, recompute, Hugging Face TP plans; with DP and with PP on
eight workers), on TinyGPT (learned position embeddings), Llama (rotary positions, grouped
key/value heads) and an eager attention (products, a causal mask, softmax), each against
`pn.reference_train`.
fp32, rtol 1e-5: ring attention sums its softmax block by block (`capture.ring_attention`),
which moves the last bit or two (atol 4e-5, as the other fidelity tests)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import piper_nb as pn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import Attend, tiny_family  # noqa: E402

pytestmark = pytest.mark.dist
SGD = pn.optim.SGD(lr=0.1)
RTOL, ATOL = 1e-5, 4e-5
ONE = {"": {"PP": 0}}


def tinygpt():
    return pn.models.TinyGPT(vocab=32, dim=32, layers=2, heads=4, seq=16)


def llama(attention: str = "sdpa"):
    return pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=16,
                           attention=attention)


def _train(model, program, cluster, steps=3, opt=SGD, ann=ONE):
    batch = model.example_batch(batch_size=4, seed=0)
    plan = pn.compile(pn.annotate(model, ann), program, batch)
    result = pn.train(plan, batch, steps, opt, cluster=cluster)
    ref = pn.reference_train(model, batch, steps, plan.reference_microbatches, opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    assert result.leftover == [], f"buffers never freed: {result.leftover[:4]}"
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    return plan


def _gathers(plan) -> list[str]:
    return [str(i) for i in plan.devices[0].instrs if i.purpose == pn.Purpose.CP]


def test_cp2_zigzag_tinygpt_learned_positions(cluster2):
    model = tinygpt()
    plan = _train(model, [pn.context_parallel({}, [0, 1]), pn.split({}, num=2)], cluster2)
    # each device holds 8 of the 16 tokens; every member's keys and values gathered (16)
    gathered = plan.capture.cp.gathered
    assert len(gathered) == 4 and all(plan.values[v].shape[1] == 16 for v in gathered)
    assert plan.values["inputs"].shape == (2, 8)
    streams = [v for v in plan.values.values() if len(v.shape) == 3]
    assert streams and all(v.shape[1] == 8 for v in streams)
    gathers = _gathers(plan)
    assert sum(g.startswith("r0:AG_F") or g.startswith("r1:AG_F") for g in gathers) == 4
    assert sum("RS_B" in g for g in gathers) == 4
    assert plan.reference_microbatches == 2


def test_cp4_zigzag_llama_rotary(cluster4):
    _train(llama(), [pn.context_parallel({}, [0, 1, 2, 3]), pn.split({}, num=2)], cluster4)


def test_cp2_contiguous_llama(cluster2):
    _train(llama(), [pn.context_parallel({}, [0, 1], load_balance="contiguous")], cluster2)


def test_cp2_llama_flash_kernel(cluster2):
    """The flash-attention op (`kernel(q, k, v, 0.0, True)[0]`) made ring attention."""
    plan = _train(llama("flash"), [pn.context_parallel({}, [0, 1])], cluster2)
    assert len(plan.capture.cp.gathered) == 4


@pytest.mark.parametrize("more", [
    [pn.replicate({}, [0, 1], zero=3)],
    [pn.recompute({"PP": 0})],
], ids=["zero3", "recompute"])
def test_cp2_composes(cluster2, more):
    plan = _train(llama(), [pn.context_parallel({}, [0, 1]), pn.split({}, num=2), *more],
                  cluster2, opt=pn.optim.AdamW(1e-2))
    if isinstance(more[0], pn.directives.spec.Recompute):   # each layer's parts as one unit:
        assert any(i.kind == pn.Op.F and i.data.unit == pn.ir.kinds.Unit.AGAIN   # its
                   for i in plan.devices[0].instrs)          # keys and values gathered again
        assert sum(i.purpose == pn.Purpose.CP and not i.data.grad
                   for i in plan.devices[0].instrs) == 8   # 2 layers x 2 microbatches x 2


@pytest.mark.parametrize("model", [Attend(eager=True, mask="causal"), Attend(mask="sdpa")],
                         ids=["eager-masked", "sdpa-mask-tensor"])
def test_cp2_causal_masks_written_out(cluster2, model):
    """An eager attention's causal mask, and a fused one's as a tensor (torch.export's
    capture: the sizes it wrote down are cut too)."""
    plan = _train(model, [pn.context_parallel({}, [0, 1])], cluster2)
    assert len(plan.capture.cp.gathered) == 2


@pytest.mark.parametrize("more", [[], [pn.recompute({})]], ids=["", "recomputed"])
def test_cp2_dropout_draws_one_process_mask(cluster2, more):
    """Dropout on a share: each member draws the whole sequence's mask from the seed one
    process draws from, and keeps its chunks (`cp.dropout`): equal to the seeded
    reference (and, recomputed, the same mask again)."""
    model = Attend(embed_dropout=0.3)
    batch = model.example_batch(batch_size=4, seed=0)
    spec = pn.annotate(model, ONE)
    plan = pn.compile(spec, [pn.context_parallel({}, [0, 1]), *more], batch)
    result = pn.train(plan, batch, 3, SGD, cluster=cluster2, seed=7)
    ref = pn.reference_train(spec, batch, 3, plan.reference_microbatches, SGD, seed=7)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(result.state_dict()[k], v, rtol=RTOL, atol=ATOL)
    plain = pn.reference_train(spec, batch, 3, plan.reference_microbatches, SGD, seed=8)
    assert plain.losses != ref.losses   # the masks matter: another seed trains otherwise


def _token_mean(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _token_sum(logits, targets):
    return (torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                              reduction="sum"), (targets != -100).sum())


def test_ignored_labels_uneven_over_the_shares_need_the_global_mean(cluster2):
    """Under the microbatch mean each member's loss is the mean over its own labels: exact
    when the shares count as many of them (ignored at positions 0 and 4: one in each
    zigzag share), a PlanError before the step when they do not (the last label ignored, as
    a causal LM's shifted labels are: device 0 holds it), and exact under the global mean."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    tokens, targets = model.example_batch(batch_size=4, seed=0)
    spec = pn.annotate(model, ONE)
    even, uneven = targets.clone(), targets.clone()
    even[:, [0, 4]] = -100
    uneven[:, -1] = -100
    for mean, batch in (("microbatch", (tokens, even)), ("global", (tokens, uneven))):
        loss = _token_sum if mean == "global" else _token_mean
        plan = pn.compile(spec, [pn.context_parallel({}, [0, 1])], batch, loss_fn=loss,
                          loss_mean=mean)
        result = pn.train(plan, batch, 2, SGD, cluster=cluster2)
        ref = pn.reference_train(spec, batch, 2, plan.reference_microbatches, SGD, loss,
                                 loss_mean=mean)
        torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                                   rtol=RTOL, atol=ATOL)
    plan = pn.compile(spec, [pn.context_parallel({}, [0, 1])], (tokens, uneven),
                      loss_fn=_token_mean)
    with pytest.raises(pn.PlanError, match=r"step 1: context_parallel: batch input "
                                           r"'targets' holds ignored labels \(-100\) "
                                           r"unevenly .*\[4, 0\] of .*loss_mean='global'"):
        pn.train(plan, (tokens, uneven), 2, SGD, cluster=cluster2)


def test_pp2_cp2_1f1b(cluster4):
    model = llama()
    _train(model, [*pn.schedules.one_f_one_b(2, 4), pn.place({"PP": 0}, [0, 1]),
                   pn.place({"PP": 1}, [2, 3]), pn.context_parallel({}, [[0, 1], [2, 3]])],
           cluster4, ann=pn.cut_stages(model, 2))


def test_cp2_dp2_zero3(cluster4):
    plan = _train(llama(), [pn.replicate({}, [0, 1, 2, 3], zero=3),
                            pn.context_parallel({}, [[0, 1], [2, 3]]), pn.split({}, num=2)],
                  cluster4, opt=pn.optim.AdamW(1e-2))
    assert plan.buckets[0].group == (0, 1, 2, 3)   # ZeRO shards over data and context
    assert plan.reference_microbatches == 4        # 2 microbatches x 2 replicas


CP_TP = [pn.context_parallel({}, [0, 2]), pn.tensor_parallel({}, [[0, 1], [2, 3]])]


@pytest.mark.parametrize("name", ["llama", "tinygpt-recompute", "llama-sp-recompute"])
def test_cp2_tp2(cluster4, name):
    """The context over the TP groups' first devices, each group following its first:
    TP's parts cut again at the attentions, numbered over the region (`PART`); the
    all-gathers of keys and values among the groups' members of one TP rank."""
    model = tinygpt() if name.startswith("tinygpt") else llama()
    sp = name.endswith("sp-recompute")
    program = [CP_TP[0], pn.tensor_parallel({}, [[0, 1], [2, 3]], sequence_parallel=sp),
               pn.split({}, num=2), *([pn.recompute({})] if "recompute" in name else [])]
    plan = _train(model, program, cluster4)
    names = [r.name for r in plan.regions]
    assert len(set(names)) == len(names) and plan.capture.tp.parts.keys() <= set(
        plan.capture.cp.parts)
    groups = {d: {i.data.group for i in plan.devices[d].instrs if i.purpose == pn.Purpose.CP}
              for d in range(4)}
    assert groups == {0: {(0, 2)}, 1: {(1, 3)}, 2: {(0, 2)}, 3: {(1, 3)}}
    if "recompute" in name:   # the region again as one unit over both cuts' parts, per
        assert "layer recompute: 2 layers as units" in plan.dag.history   # microbatch


@pytest.mark.extended   # eight workers: a minute on two cores (`make test-all`)
def test_cp2_tp2_with_dp_zero3_and_with_pp_on_eight_workers():
    """torchtitan's 4D order without a dimension: CP 2 x TP 2 x DP 2 with ZeRO-3 over the
    replicas and context groups (per TP rank), and PP 2 x CP 2 x TP 2 under 1F1B."""
    model = llama()
    with pn.LocalCluster(8) as cluster:
        plan = _train(model, [pn.replicate({}, [0, 2, 4, 6], zero=3),
                              pn.context_parallel({}, [[0, 2], [4, 6]]),
                              pn.tensor_parallel({}, [[0, 1], [2, 3], [4, 5], [6, 7]]),
                              pn.split({}, num=2)], cluster, opt=pn.optim.AdamW(1e-2))
        assert {b.group for b in plan.buckets} == {(0, 2, 4, 6), (1, 3, 5, 7)}
        _train(model, [*pn.schedules.one_f_one_b(2, 4), pn.place({"PP": 0}, [0, 2]),
                       pn.place({"PP": 1}, [4, 6]), pn.context_parallel({}, [[0, 2], [4, 6]]),
                       pn.tensor_parallel({"PP": "*"}, [[0, 1], [2, 3], [4, 5], [6, 7]])],
               cluster, ann=pn.cut_stages(model, 2))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cp2_tp2_transformers_own_tp_plans(cluster4, family):
    """Llama and Qwen3 from transformers on their own TP plans (the vocab-parallel
    embedding and loss: its label count made in the first part, read by the loss in the
    last) with CP 2 over the groups' first devices."""
    plan, _ = _hf_equal(family, None, [*CP_TP, pn.split({}, num=2)], cluster4)
    assert "lm_head.weight" in plan.tp_params and len(plan.capture.cp.gathered) == 4


def _hf_equal(family: str, attention: str | None, program: list, cluster):
    """A transformers model of `family` (its `attention`), the batch with its labels
    shifted already (`shift_labels`), compiled with the global token mean and trained on
    `cluster` equal to one process (SGD: Adam's division by each element's own scale turns
    a rounding into a step); -> (the plan, the batch)."""
    transformers = pytest.importorskip("transformers")
    model = tiny_family(transformers, family)
    if attention:
        model.config._attn_implementation = attention
    ids = torch.randint(3, 32, (4, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids,
             "shift_labels": torch.cat([ids[:, 1:], torch.full((4, 1), -100)], 1)}
    plan = pn.compile(model, program, batch, loss_mean="global")
    result = pn.train(plan, batch, 3, SGD, cluster=cluster)
    ref = pn.reference_train(model, batch, 3, plan.reference_microbatches, SGD,
                             loss_mean="global")
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    assert result.leftover == []
    got = result.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, k=k: f"{k}: {m}")
    return plan, batch


@pytest.mark.parametrize("family,attention", [("llama", "sdpa"), ("qwen3", "sdpa"),
                                              ("llama", "eager")])
def test_cp2_transformers_own_attention(cluster2, family, attention):
    """Llama and Qwen3 from transformers through their own attention modules (sdpa with
    the causal mask as a tensor, or eager: scores, the additive mask, softmax in fp32, a
    dropout of 0; Qwen3's per-head norms), exported: the batch carries the labels shifted
    already (`shift_labels`), and the loss is the global token mean."""
    transformers = pytest.importorskip("transformers")
    plan, batch = _hf_equal(family, attention, [pn.context_parallel({}, [0, 1]),
                                                pn.split({}, num=2)], cluster2)
    assert plan.capture.method == "export" and len(plan.capture.cp.gathered) == 4
    # the labels shifted inside, or each device's mean: refused, never a silent answer
    del batch["shift_labels"]
    with pytest.raises(pn.PlanError, match="shifts the batch's labels along the sequence"):
        pn.compile(tiny_family(transformers, family), [pn.context_parallel({}, [0, 1])],
                   batch, loss_mean="global")
    with pytest.raises(pn.PlanError, match="compile with loss_mean='global'"):
        pn.compile(tiny_family(transformers, family), [pn.context_parallel({}, [0, 1])],
                   batch)
