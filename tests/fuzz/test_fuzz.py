"""The differential fuzzer's fast subset: the first cases of `make fuzz` (see cases.py).

Each case is a random StageGraph under a random schedule, DP width and ZeRO level, trained
and compared with one process, on the shared clusters, which emulate NCCL (tests/conftest.py);
the first `STREAMS` cases also check that every device ran exactly its stream program. A
failure names the case and the command that replays it.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

import piper_nb as pn
from piper_nb.models import StageGraph

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cases import batches, check, draw, program  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.usefixtures("one_thread")]

FAST = int(os.environ.get("PIPER_NB_FUZZ_FAST", "120"))   # seeds 0 .. FAST-1
STREAMS = 40   # the first seeds also check that the runtime ran the stream program


@pytest.mark.parametrize("seed", range(FAST))
def test_case_trains_like_one_process(request, seed):
    case = draw(seed)
    cluster = request.getfixturevalue("cluster2" if case.world <= 2 else "cluster4")
    check(case, cluster, streams=seed < STREAMS)   # the shared clusters emulate NCCL


def test_the_draw_covers_every_schedule_zero_level_and_feature():
    cases = [draw(s) for s in range(FAST)]
    assert {c.schedule for c in cases} == {"none", "gpipe", "1f1b", "interleaved2",
                                           "interleaved3", "zb1p", "dualpipev", "dualpipe", "grid"}
    assert {c.zero for c in cases if c.dp > 1} == {0, 1, 2, 3}
    for feature in ("skips", "ties", "frozen", "norms", "scales", "shared", "dropout"):
        assert any(getattr(c.spec, feature) for c in cases), feature
    assert {c.optimizer for c in cases} == {"sgd", "adamw", "adam", "adagrad", "rmsprop",
                                            "adamax", "nadam", "radam"}
    assert any(c.groups for c in cases) and any(c.warmup for c in cases)
    assert {c.clip for c in cases} >= {None, 0.05, math.inf}
    assert any(c.clip == 0.05 and c.zero >= 1 for c in cases)
    assert any(c.clip is not None and c.schedule == "dualpipe" for c in cases)
    assert any(c.bf16 and c.zero == 3 for c in cases) and any(c.bf16 and c.ranks > 1
                                                                for c in cases)
    assert any(c.spec.act_modules for c in cases)
    assert any(c.recompute for c in cases if c.schedule in ("zb1p", "dualpipev"))
    assert any(c.recompute and c.zero == 3 for c in cases)
    assert any(mb >= 0 for c in cases for _, mb in c.recompute)
    # fidelity: custom Functions, eval mode (BatchNorm, dropout), changing lengths, global loss
    assert any(c.spec.functions and c.ranks > 1 for c in cases)
    assert any(set(c.spec.eval_stages) & set(c.spec.norms) for c in cases)
    assert any(c.spec.eval_dropout for c in cases)
    assert any(len(set(c.lengths)) > 1 and c.ranks > 1 for c in cases)
    assert any(c.global_loss and c.dp > 1 for c in cases)
    assert any(c.float8 and c.zero >= 1 for c in cases)   # Float8 linears (pn.float8)
    assert any(c.float8 and c.schedule in ("dualpipe", "dualpipev") for c in cases)
    assert any(c.global_loss and c.schedule == "dualpipev" for c in cases)
    # tensor parallelism over MLPs, with a pipeline, with data parallelism, under ZeRO
    assert any(c.tp > 1 and c.ranks > 1 for c in cases)
    assert any(c.tp > 1 and c.dp > 1 for c in cases)
    assert any(c.tp > 1 and c.zero == 3 for c in cases)
    assert any(c.tp > 1 and c.spec.dropout and not c.spec.eval_dropout for c in cases)
    # and a classifier head cut by class: its cross-entropy vocabulary-parallel
    assert any(c.spec.classes and c.ranks > 1 for c in cases)
    assert any(c.spec.classes and c.spec.smoothing for c in cases)


def test_make_fuzz_draws_selective_recompute():
    """Selective recompute of attention, with TP and SP and without, under split backwards
    and DualPipe's copies, among the 500 cases of `make fuzz`."""
    cases = [c for c in map(draw, range(500)) if c.selective]
    assert any(c.sp for c in cases) and any(c.tp == 1 for c in cases)
    assert any(c.schedule in ("zb1p", "dualpipev") for c in cases)
    assert any(c.schedule == "dualpipe" for c in cases)


def test_make_fuzz_draws_float8():
    """Float8 linears under split backwards, DualPipe's copies, ZeRO-3, recompute and the
    global loss, among the 500 cases of `make fuzz` (67 of them)."""
    cases = [c for c in map(draw, range(500)) if c.float8]
    assert len(cases) > 40
    assert any(c.schedule in ("zb1p", "dualpipev") for c in cases)
    assert any(c.schedule == "dualpipe" for c in cases)
    assert any(c.zero == 3 and c.dp > 1 for c in cases)
    assert any(c.recompute for c in cases) and any(c.global_loss for c in cases)


def test_make_fuzz_draws_tensor_parallel_layers_recomputed_as_units():
    """Full recompute of a TP stage (its parts run again as one unit), with SP and without,
    under split backwards and DualPipe's copies, among the 500 cases of `make fuzz`."""
    cases = [c for c in map(draw, range(500)) if c.units]
    assert any(c.sp for c in cases) and any(not c.sp for c in cases)
    assert any(c.schedule in ("zb1p", "dualpipev") for c in cases)
    case = next(c for c in cases if c.sp)
    model = StageGraph(case.spec)
    plan = pn.compile(pn.annotate(model, model.annotation()), program(case),
                      batches(case, model)[0])
    assert any(i.kind == pn.Op.F and i.data.unit == pn.ir.kinds.Unit.AGAIN
               for d in plan.devices for i in d.instrs)


def test_make_fuzz_draws_sequence_parallel_inputs_gathered_again():
    """A sharded MLP under SP keeps its slice of the gathered input and the plan gathers it
    again before the backward (`compiler.regather`): drawn with pipelines, data
    parallelism and split backwards among the 500 cases of `make fuzz`."""
    cases = [c for c in map(draw, range(500)) if c.regathers]
    assert any(c.ranks > 1 for c in cases) and any(c.dp > 1 for c in cases)
    assert any(c.schedule in ("zb1p", "dualpipev") for c in cases)
    case = next(c for c in cases if c.ranks > 1)
    model = StageGraph(case.spec)
    plan = pn.compile(pn.annotate(model, model.annotation()), program(case),
                      batches(case, model)[0])
    assert any(i.is_regather for d in plan.devices for i in d.instrs)


def test_a_drawn_classifier_head_sends_per_token_numbers_not_its_logits():
    case = next(c for c in map(draw, range(500)) if c.spec.classes and not c.lengths)
    model = StageGraph(case.spec)
    plan = pn.compile(pn.annotate(model, model.annotation()), program(case),
                      model.example_batch(case.batch_size, seed=case.seed))
    head = {r.index for r in plan.regions if "head.weight" in r.params}
    sums = {plan.values[v].shape for dp in plan.devices for i in dp.instrs
            if i.purpose == pn.Purpose.TP and not i.data.grad and i.region in head for v in i.data.values}
    tokens = case.batch_size // case.microbatches // case.dp   # one microbatch's samples
    # per token: each device's log-sum-exp, the target's logit (and the logits' sum)
    assert sums == {(tokens, case.tp + 1 + (case.spec.smoothing > 0))}, sums


def test_a_case_replays_from_its_seed():
    assert draw(7) == draw(7) and draw(7).replay().endswith("--seed 7")


def test_make_fuzz_draws_context_parallel():
    """Context parallelism of degree 2, zigzag and contiguous, with pipelines (split
    backwards among them), data parallelism under ZeRO-3, recompute, dropout (one
    process's masks) and the global loss over masked targets, all-gathered and on the
    point-to-point ring, among the 500 cases of `make fuzz` (86 of them)."""
    cases = [c for c in map(draw, range(500)) if c.cp > 1]
    assert len(cases) > 60 and {c.balance for c in cases} == {"zigzag", "contiguous"}
    assert {c.rotate for c in cases} == {"all_gather", "p2p"}
    assert any(c.rotate == "p2p" and c.tp > 1 for c in cases)
    assert any(c.ranks > 1 and c.schedule in ("zb1p", "dualpipev") for c in cases)
    assert any(c.dp > 1 and c.zero == 3 for c in cases)
    assert any(c.recompute for c in cases) and any(c.global_loss for c in cases)
    assert any(c.spec.dropout and not c.spec.eval_dropout for c in cases)
    for rotate in ("all_gather", "p2p"):
        case = next(c for c in cases if c.ranks > 1 and c.rotate == rotate)
        model = StageGraph(case.spec)
        plan = pn.compile(pn.annotate(model, model.annotation()), program(case),
                          batches(case, model)[0])
        ring = plan.capture.cp.rotations
        assert plan.capture.cp.rotate == rotate
        assert any(i.purpose == pn.Purpose.CP if rotate == "all_gather" else
                   i.kind == pn.Op.SEND and i.data.values[0] in ring.values()
                   for d in plan.devices for i in d.instrs)


def test_make_fuzz_draws_compiled_regions():
    """Stages through torch.compile (AOTAutograd, eager kernels) among the cases, with
    pipelines (split backwards too), data parallelism, context parallelism and dropout."""
    cases = [c for c in map(draw, range(300)) if c.compiled]
    assert len(cases) > 20
    assert any(c.schedule in ("zb1p", "dualpipev") for c in cases)
    assert any(c.dp > 1 and c.zero == 3 for c in cases) and any(c.cp > 1 for c in cases)
    assert any(c.spec.dropout for c in cases)
    case = cases[0]
    model = StageGraph(case.spec)
    plan = pn.compile(pn.annotate(model, model.annotation()), program(case),
                      batches(case, model)[0])
    assert {i.data.compiled for d in plan.devices for i in d.instrs
            if i.kind in pn.ir.kinds.PASSES and i.region in {
                r.index for r in plan.regions if dict(r.tags)["PP"] in case.compiled}} == {
        "aot_eager"}
