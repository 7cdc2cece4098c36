"""Every ZeRO level composes with every schedule: {replicate zero 0-3} x {no PP, GPipe, 1F1B,
interleaved, ZB1P, DualPipeV, DualPipe} on up to 8 devices compiles and passes the checks."""

import pytest

import piper_nb as pn
from piper_nb.directives.spec import Place
from piper_nb.ir.kinds import Op

S = pn.schedules
SCHEDULES = {
    # name: (stages, ranks, builder)
    "gpipe": (4, 4, lambda: S.gpipe(4, 8, place=True)),
    "1f1b": (4, 4, lambda: S.one_f_one_b(4, 8, place=True)),
    "interleaved": (4, 2, lambda: S.interleaved_1f1b(2, 4, chunks=2, place=True)),
    "zb1p": (4, 4, lambda: S.zero_bubble(4, 8, place=True)),
    "dualpipev": (4, 2, lambda: S.dualpipev(2, 8, place=True)),
    "dualpipe": (4, 4, lambda: S.dualpipe(4, 8, place=True)),
}


def with_data_parallel(program, ranks, zero):
    """Each pipeline rank r becomes the replica group [r, r + ranks]."""
    out = []
    for d in program:
        if isinstance(d, Place):
            devs = [x for r in d.devices for x in (r, r + ranks)]
            out += [pn.place(d.filter, devs), pn.replicate(d.filter, devs, zero=zero)]
        else:
            out.append(d)
    return out


@pytest.fixture(scope="module")
def mlp16():
    model = pn.models.MLP(dim=8, depth=8)
    return model, model.example_batch(batch_size=32, seed=0)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_data_parallel_without_pipeline(mlp16, zero):
    model, batch = mlp16
    spec = pn.annotate(model, {"layers": {"PP": 0}})
    plan = pn.compile(spec, [pn.replicate({}, list(range(8)), zero=zero), pn.split({}, "MB", 4)],
                      batch)
    assert plan.world == 8 and plan.buckets[0].zero == zero


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_schedule_times_zero(mlp16, name, zero):
    model, batch = mlp16
    stages, ranks, build = SCHEDULES[name]
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    program = build()
    if name == "dualpipe":
        plan = pn.compile(spec, program, batch)
        assert plan.world == 4
        # the two copies of each stage sum their gradients
        assert sorted(b.group for b in plan.buckets) == [(0, 3), (0, 3), (1, 2), (1, 2)]
        # with data parallel, each stage lives on both copies' replica groups: ZeRO shards
        # over all four devices, reducing and gathering once per step
        plan = pn.compile(spec, with_data_parallel(program, ranks, zero), batch)
        assert sorted({b.group for b in plan.buckets}) == [(0, 3, 4, 7), (1, 2, 5, 6)]
        assert {b.zero for b in plan.buckets} == {zero}
        per_mb = [n for n in plan.dag.nodes if n.op == Op.REDUCE_SCATTER and n.mb is not None]
        assert per_mb == []
        return
    plan = pn.compile(spec, with_data_parallel(program, ranks, zero), batch)
    assert plan.world == 2 * ranks
    assert {b.zero for b in plan.buckets} == {zero}
    ops = {n.op for n in plan.dag.nodes}
    assert (Op.ALL_REDUCE in ops) == (zero == 0)
    assert (Op.REDUCE_SCATTER in ops) == (zero > 0)
    assert (Op.ALL_GATHER in ops) == (zero > 0)


def test_tied_embedding_across_first_and_last_stage_sums_its_gradient():
    model = pn.models.TinyGPT(layers=2, tie_embeddings=True)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks.0": {"PP": 0},
                               "blocks.1": {"PP": 1}, "head": {"PP": 1}})
    plan = pn.compile(spec, S.one_f_one_b(2, 4, place=True), batch)
    (tied,) = [b for b in plan.buckets if "embed.tok.weight" in b.params]
    assert tied.group == (0, 1) and tied.params == ("embed.tok.weight",)
    assert "b0:AR" in plan[0].text() and "b0:AR" in plan[1].text()
