"""The stream program (`plan.streams()`): what a GPU runs, in a text form that reads like a
schedule and round-trips, with NCCL's layout (a communicator per collective group and per
direction of a pair), the issue and done events, the host's synchronisations, and
communicator families that make group creation one split per family."""

from __future__ import annotations

import json

import pytest

import piper_nb as pn
from piper_nb.compiler.nccl import check_nccl
from piper_nb.plan.streams import (
    COMPUTE_STREAM,
    Step,
    StreamProgram,
    communicators,
    families,
)

S = pn.schedules


def mlp_plan(stages: int, program, batch: int = 24):
    model = pn.models.MLP(dim=8, depth=stages)
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    return pn.compile(spec, program, model.example_batch(batch, seed=0))


BUILDERS = {
    "gpipe": (4, lambda: S.gpipe(4, 8, place=True)),
    "1f1b": (2, lambda: S.one_f_one_b(2, 4, place=True)),
    "interleaved": (8, lambda: S.interleaved_1f1b(4, 8, chunks=2, place=True)),
    "zb1p": (4, lambda: S.zero_bubble(4, 8, place=True)),
    "dualpipev": (8, lambda: S.dualpipev(4, 8, place=True)),
    "dualpipe": (4, lambda: S.dualpipe(4, 8, place=True)),
}


def test_1f1b_reads_as_its_streams():
    plan = mlp_plan(2, S.one_f_one_b(2, 4, place=True))
    text = plan.streams()[1].text().splitlines()
    assert text[0] == "dev1"
    assert text[1].startswith("  compute: rec(i0) wait(d0)@1 r1:F0 rec(i4) r1:B0 rec(i6)")
    assert text[2].startswith("  nccl:p2p:0>1: wait(i0) r1:RECV_F0<0 rec(d0) wait(i4) r1:RECV_F1<0")
    assert text[3].startswith("  nccl:p2p:1>0: wait(i6) r1:SEND_B0>0 rec(d6)")
    assert text[-1] == "  host: sync(compute)@end sync(nccl:p2p:0>1)@end sync(nccl:p2p:1>0)@end"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_the_text_and_json_forms_round_trip(name):
    stages, program = BUILDERS[name]
    plan = mlp_plan(stages, program())
    streams = plan.streams()
    assert StreamProgram.from_text(streams.text(), plan) == streams
    assert StreamProgram.from_json(json.loads(json.dumps(streams.to_json())), plan) == streams


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_op_waits_for_the_compute_it_was_issued_after_and_is_waited_for(name):
    stages, program = BUILDERS[name]
    plan = mlp_plan(stages, program())
    for ds in plan.streams():
        recorded = {x.event: x.stream for x in ds.launches if x.step == Step.RECORD}
        for stream, launches in ds.streams().items():
            comms = [x for x in launches if x.step == Step.COMM]
            assert all(stream == f"nccl:{x.comm}" for x in comms)   # one stream per communicator
            for k, x in enumerate(launches):
                if x.step == Step.COMM:   # NCCL's syncStream: wait for the compute stream
                    issue = launches[k - 1]
                    assert issue.step == Step.WAIT and recorded[issue.event] == COMPUTE_STREAM
        done = {x.event for x in ds.launches if x.step == Step.RECORD and x.event.startswith("d")}
        waited = {x.event for x in ds.launches if x.step == Step.WAIT and x.stream == COMPUTE_STREAM}
        assert done <= waited                  # every transfer's completion is waited for


def test_a_token_dispatch_syncs_the_host_and_exchanges_counts_first():
    from piper_nb.strategies import compile_strategy
    plan, _ = compile_strategy("pp2-dp2-ep2")
    ds = plan.streams()[0]
    k = next(i for i, ins in enumerate(ds.instrs) if ins.is_counted_dispatch)
    steps = [x.step for x in ds.by_instr()[k]]
    assert steps[:2] == [Step.SYNC, Step.EXCHANGE]
    assert Step.COMM in steps


def test_a_hand_made_program_is_the_one_the_plan_runs(coupled):
    import dataclasses
    plan = mlp_plan(2, S.one_f_one_b(2, 4, place=True))
    bad = dataclasses.replace(plan, stream_program=coupled(plan))
    assert bad.streams() is bad.stream_program
    assert "pp: wait(c1) rec(i1) wait(d1)" in bad.streams()[0].text()


def test_communicator_families_are_disjoint_and_few_at_scale():
    plan = pn.compile(pn.annotate(*_mlp_pp_dp(8)), [
        *[pn.place({"PP": s}, [s + 8 * r for r in range(4)]) for s in range(8)],
        *[pn.replicate({"PP": s}, [s + 8 * r for r in range(4)], zero=1) for s in range(8)],
        *S.one_f_one_b(8, 8)], _mlp_pp_dp(8)[0].example_batch(32, seed=0))
    comms = communicators(plan)
    fams = families(comms)
    assert sorted(c for f in fams for c in f) == sorted(comms)
    for fam in fams:
        ranks = [r for c in fam for r in set(map(int, c.split(":")[1].replace(">", ",").split(",")))]
        assert len(ranks) == len(set(ranks))
    # 8 DP groups, 2 x 7 x 4 directions: 64 communicators in a handful of families
    assert len(comms) == 8 + 2 * 7 * 4 and len(fams) <= 6


def _mlp_pp_dp(stages: int):
    model = pn.models.MLP(dim=8, depth=stages)
    return model, {f"layers.{i}": {"PP": i} for i in range(stages)}


def test_check_nccl_reads_the_stream_program_and_fails_the_old_coupling(coupled):
    plan = mlp_plan(2, S.one_f_one_b(2, 4, place=True))
    check_nccl(plan)
    with pytest.raises(pn.PlanError, match="NCCL deadlock") as info:
        check_nccl(plan, program=coupled(plan))
    text = str(info.value)
    # rank 0's pp stream waits for RECV_B0 (rank 1's SEND_B0 is queued behind RECV_F1 on
    # its pp stream, which waits for rank 0's SEND_F1, queued behind RECV_B0)
    assert "pp: " in text and ">wait(d" in text


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_builder_deadlocks_under_the_old_coupling(name, coupled):
    stages, program = BUILDERS[name]
    plan = mlp_plan(stages, program())
    check_nccl(plan)
    with pytest.raises(pn.PlanError, match="NCCL deadlock"):
        check_nccl(plan, program=coupled(plan))
