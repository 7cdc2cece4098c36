"""Every strategy trains exactly like the single-process reference (losses and parameters).

Data parallel, ZeRO 1-3, GPipe, 1F1B, PP x DP with ZeRO-3 and tied embeddings across
stages, each for 3 steps with SGD-momentum and AdamW, compared with `pn.reference_train`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import piper_nb as pn
from piper_nb import optim
from piper_nb.train import reference_train, train

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain import assert_like, plain_loop  # noqa: E402

pytestmark = pytest.mark.dist

OPTIMIZERS = {"sgd": optim.SGD(0.1, momentum=0.9), "adamw": optim.AdamW(1e-3)}
STEPS = 3
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _mlp():
    model = pn.models.MLP(dim=16, depth=4)
    return model, model.example_batch(batch_size=8, seed=0)


def _gpt(tied: bool):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=tied)
    return model, model.example_batch(batch_size=8, seed=0)


def _pp(stages: int = 2) -> list:
    return [pn.place({"PP": s}, [s]) for s in range(stages)]


def _check(model, batch, program, cluster, opt_name, same, annotation=None):
    spec = pn.annotate(model, annotation or pn.cut_stages(model, 2))
    plan = pn.compile(spec, program, batch)
    opt = OPTIMIZERS[opt_name]
    result = train(plan, batch, STEPS, opt, cluster=cluster)
    ref = reference_train(model, batch, STEPS, plan.microbatches, opt)
    same(result, ref, model)
    return plan, result


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_zero_2_ranks(cluster2, same, opt, zero):
    model, batch = _mlp()
    program = [pn.replicate({}, [0, 1], zero=zero), pn.split({}, "MB", 2)]
    plan, _ = _check(model, batch, program, cluster2, opt, same, {"layers": {"PP": 0}})
    kinds = {i.kind for dp in plan.devices for i in dp.instrs}
    assert ("ALL_REDUCE" in kinds) == (zero == 0)
    assert ("REDUCE_SCATTER" in kinds) == (zero > 0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_pure_data_parallelism_needs_no_tags(cluster2, zero):
    """A model as it is, one directive: one region (`PP=0`) replicated over two devices,
    trained like the loop a user writes."""
    model, batch = _mlp()
    plan = pn.compile(model, [pn.replicate({}, [0, 1], zero=zero)], batch)
    assert [r.name for r in plan.regions] == ["PP=0"] and plan.world == 2
    result = train(plan, batch, STEPS, optim.SGD(0.1), cluster=cluster2)
    want_losses, want_state = plain_loop(model, [batch] * STEPS, plan.reference_microbatches,
                                         lr=0.1, loss_fn=model.loss_fn)
    assert_like(result, want_losses, want_state)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_zero3_4_ranks_tied_gpt(cluster4, same, opt):
    model, batch = _gpt(tied=True)
    program = [pn.replicate({}, [0, 1, 2, 3], zero=3), pn.split({}, "MB", 2)]
    _check(model, batch, program, cluster4, opt, same)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_schedules(cluster2, same, opt, schedule):
    model, batch = _mlp()
    program = [*_pp(), pn.Program([{"op": "schedule", "name": schedule, "ranks": 2,
                                    "microbatches": 4}])[0]]
    _check(model, batch, program, cluster2, opt, same)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_pp2_dp2_zero3(cluster4, same, opt):
    """The shipped example: PP 2 x DP 2, ZeRO-3 inside each stage, 1F1B over 4 microbatches."""
    model, batch = _gpt(tied=False)
    program = pn.Program.from_json((EXAMPLES / "pp2_dp2_zero3.json").read_text())
    plan, _ = _check(model, batch, program, cluster4, opt, same)
    assert plan.world == 4 and {b.zero for b in plan.buckets} == {3}


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_tied_embeddings_across_stages(cluster2, same, opt):
    model, batch = _gpt(tied=True)
    program = [*_pp(), *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]
    plan, _ = _check(model, batch, program, cluster2, opt, same)
    tied = [b for b in plan.buckets if "embed.tok.weight" in b.params]
    assert tied and tied[0].group == (0, 1)



@pytest.mark.parametrize("name,stages,program", [
    ("zb1p", 2, lambda: [*_pp(), *pn.schedules.zero_bubble(ranks=2, microbatches=4)]),
    ("interleaved", 4, lambda: pn.schedules.interleaved_1f1b(2, 4, chunks=2, place=True)),
    ("dualpipev", 4, lambda: pn.schedules.dualpipev(ranks=2, microbatches=4, place=True)),
    ("dualpipe", 2, lambda: pn.schedules.dualpipe(ranks=2, microbatches=4, place=True)),
])
def test_advanced_schedules(cluster2, same, name, stages, program):
    """BI/BW split backwards, several stages per rank, two directions and doubled stages."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=6, heads=2, seq=16, tie_embeddings=False)
    batch = model.example_batch(batch_size=8, seed=0)
    _check(model, batch, program(), cluster2, "adamw", same, pn.cut_stages(model, stages))


def test_loader_and_a_cluster_larger_than_the_plan(cluster4, same):
    """A new batch every step (any iterable of (inputs, targets)); idle ranks 2 and 3."""
    model, _ = _mlp()
    batches = [model.example_batch(batch_size=8, seed=s) for s in range(STEPS)]
    spec = pn.annotate(model, {"layers": {"PP": 0}})
    plan = pn.compile(spec, [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)],
                      batches[0])
    opt = OPTIMIZERS["sgd"]
    result = train(plan, iter(batches), STEPS, opt, cluster=cluster4)
    same(result, reference_train(model, iter(batches), STEPS, 2, opt), model)
    with pytest.raises(pn.PlanError, match="ran out after 3 of 4 steps"):
        train(plan, iter(batches), 4, opt, cluster=cluster4)
