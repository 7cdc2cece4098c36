"""Full recompute of a tensor-parallel layer as one unit (`compiler.layer_recompute`): the
parts' first forwards keep nothing, their second runs and a copy of the collectives between
them run before the layer's backwards, and the layer keeps only its input. Each plan
trains like `pn.reference_train` (fp32, rtol 1e-5, atol 4e-5 as the other tensor-parallel
tests: the group's sums add partial products in another order than one matmul). The
memory ledger's equality with the runtime is in tests/sim/test_memory_vs_runtime.py, the
bytes a layer keeps in tests/sim/test_layer_memory.py."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import piper_nb as pn
from piper_nb.compiler.layer_recompute import AGAIN
from piper_nb.ir.kinds import Op, Unit
from piper_nb.strategies import moe_annotation

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plain import assert_like, tiny_family  # noqa: E402

pytestmark = pytest.mark.dist
S = pn.schedules
SGD = pn.optim.SGD(lr=0.1)
LAYERS = {"embed": {"PP": 0, "L": 0}, "blocks.0": {"PP": 0, "L": 1},
          "blocks.1": {"PP": 0, "L": 2}, "head": {"PP": 0, "L": 3}}


def llama():
    return pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)


def _train(model, ann, program, cluster, steps=3, seed=None):
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, ann)
    plan = pn.compile(spec, program, batch)
    result = pn.train(plan, batch, steps, SGD, cluster=cluster, seed=seed)
    _same(result, pn.reference_train(spec, batch, steps, plan.reference_microbatches, SGD,
                                     seed=seed))
    return plan, result


def _same(result, ref) -> None:   # plain.assert_like: rtol 1e-5, atol 4e-5
    assert_like(result, ref.losses, ref.state_dict())


def _passes(plan, unit: Unit):
    return [i for i in plan[0].instrs if i.kind == Op.F and i.data.unit == unit]


def test_the_parts_run_again_as_one_unit_before_the_layers_backward():
    model = llama()
    plan = pn.compile(pn.annotate(model, LAYERS),
                      [pn.tensor_parallel({}, [0, 1], sequence_parallel=True),
                       pn.split({}, num=2), pn.recompute({"L": 1})],
                      model.example_batch(batch_size=8, seed=0))
    parts = {r.index for r in plan.regions if dict(r.tags).get("L") == 1}
    first, again = _passes(plan, Unit.FIRST), _passes(plan, Unit.AGAIN)
    assert {i.region for i in first} == {i.region for i in again} == parts
    assert all(i.node.endswith(AGAIN) for i in again) and len(again) == 2 * len(parts)
    assert not any(i.data.recompute for i in plan[0].instrs if i.kind in pn.ir.kinds.PASSES)
    order = [(i.kind, i.region, i.mb) for i in plan[0].instrs if i.is_compute]
    for mb in (0, 1):   # the second runs come after the whole forward, in part order, and
        runs = [order.index((Op.F, r, mb)) for r in sorted(parts)]   # right before the
        assert runs == sorted(runs)                                  # layer's backwards
        last = max(parts)
        seconds = [k for k, i in enumerate(plan[0].instrs) if i.kind == Op.F
                   and i.data.unit == Unit.AGAIN and i.mb == mb]
        backward = next(k for k, i in enumerate(plan[0].instrs)
                        if i.kind == Op.B and i.region == last and i.mb == mb)
        assert max(seconds) < backward
        assert all(plan[0].instrs[k].region == r for k, r in zip(seconds, sorted(parts),
                                                                 strict=True))
    copies = [i for i in plan[0].instrs if i.kind in (Op.ALL_GATHER, Op.REDUCE_SCATTER)
              and i.node.endswith(AGAIN)]
    assert copies   # SP's gathers and reduce-scatters between the parts run again
    again = pn.Plan.from_json(plan.to_json())   # the plan file keeps what the runs are
    assert again[0].instrs == plan[0].instrs


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_recomputed_as_units_with_dropout_draws_one_process_masks(cluster2, sp):
    program = [pn.tensor_parallel({}, [0, 1], sequence_parallel=sp), pn.split({}, num=2),
               pn.recompute({})]
    plan, _ = _train(pn.models.MegatronGPT(vocab=32, p=0.25), LAYERS, program, cluster2, seed=3)
    assert _passes(plan, Unit.AGAIN)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p", "dualpipev"])
def test_pp2_tp2_sp_recomputed_as_units(cluster4, schedule):
    model = llama()
    if schedule == "dualpipev":   # stages 0 and 3 on device 0, 1 and 2 on device 1
        ann = pn.cut_stages(model, 4)
        program = [pn.tensor_parallel({"PP": "*"}, [[0, 2], [1, 3]], sequence_parallel=True),
                   *S.dualpipev(2, 4, place=True)]
    else:
        ann = pn.cut_stages(model, 2)
        build = S.one_f_one_b if schedule == "1f1b" else S.zero_bubble
        program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                   pn.tensor_parallel({"PP": 0}, [0, 1], sequence_parallel=True),
                   pn.tensor_parallel({"PP": 1}, [2, 3], sequence_parallel=True),
                   *build(2, 4)]
    plan, _ = _train(model, ann, [*program, pn.recompute({"PP": "*"})], cluster4)
    assert _passes(plan, Unit.AGAIN)


@pytest.mark.parametrize("reshard", [True, False])
def test_tp2_sp_dp2_zero3_recomputed_as_units(cluster4, reshard):
    program = [pn.replicate({}, [0, 2], zero=3, reshard=reshard),
               pn.tensor_parallel({}, [[0, 1], [2, 3]], sequence_parallel=True),
               pn.split({}, num=2), pn.recompute({"L": 1})]
    plan, _ = _train(llama(), LAYERS, program, cluster4)
    assert _passes(plan, Unit.AGAIN)


def test_a_filter_naming_some_parts_recomputes_them_alone():
    model = llama()
    plan = pn.compile(pn.annotate(model, LAYERS),
                      [pn.tensor_parallel({}, [0, 1]), pn.recompute({"L": 1, "PART": 1})],
                      model.example_batch(batch_size=8, seed=0))
    assert not _passes(plan, Unit.AGAIN)
    assert any(i.data.recompute for i in plan[0].instrs if i.kind == Op.F)


def test_tp2_sp_units_in_bf16(cluster2):
    """bf16 at the bf16 tolerance of the other SP tests: the second runs compute what the
    first ones did, in the same order."""
    model = llama()
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, LAYERS)
    plan = pn.compile(spec, [pn.tensor_parallel({}, [0, 1], sequence_parallel=True),
                             pn.split({}, num=2), pn.recompute({"L": 1})], batch,
                      precision="bf16")
    result = pn.train(plan, batch, 3, SGD, cluster=cluster2)
    ref = pn.reference_train(spec, batch, 3, plan.reference_microbatches, SGD,
                             precision="bf16")
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1.6e-2, atol=1e-3)
    assert _passes(plan, Unit.AGAIN)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_transformers_layers_recomputed_as_units_with_sp(cluster2, family):
    model = tiny_family(pytest.importorskip("transformers"), family)
    ids = torch.randint(3, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    ann = {"model.embed_tokens": {"PP": 0},
           **{f"model.layers.{i}": {"PP": 0, "L": i} for i in range(2)}}
    spec = pn.annotate(model, ann)
    plan = pn.compile(spec, [pn.tensor_parallel({}, [0, 1], sequence_parallel=True),
                             pn.split({}, num=2), pn.recompute({"L": "*"})], batch)
    _same(pn.train(plan, batch, 2, SGD, cluster=cluster2),
          pn.reference_train(spec, batch, 2, plan.reference_microbatches, SGD))
    assert len(_passes(plan, Unit.AGAIN)) == len(_passes(plan, Unit.FIRST)) > 0


@pytest.mark.parametrize("sp, recompute", [(True, False), (False, True), (True, True)])
def test_tp2_with_expert_parallel_moe_sp_and_units(cluster4, sp, recompute):
    """TP 2 x EP 2 on TinyMoE: with SP (its routed rows planned on fake tensors, where a
    slice's offset is any), and its TP layers recomputed as units around the all-to-alls."""
    model = pn.models.TinyMoE(vocab=32, dim=32, layers=2, experts=2, top_k=1, heads=2, seq=8)
    program = [pn.place({"PP": 0}, [0, 2]), pn.replicate({"PP": 0}, [0, 2]),
               pn.shard({"PP": 0, "EP": "*"}, [0, 2]),
               pn.tensor_parallel({"PP": 0}, [[0, 1], [2, 3]], sequence_parallel=sp),
               pn.split({}, num=2), *([pn.recompute({"PP": 0})] if recompute else [])]
    plan, _ = _train(model, moe_annotation(2, 2, 1), program, cluster4, steps=2)
    assert bool(_passes(plan, Unit.AGAIN)) == recompute
