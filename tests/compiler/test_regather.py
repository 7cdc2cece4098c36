"""Sequence-parallel inputs kept as slices (`compiler.regather`): a sharded part's forward
keeps its device's slice of each all-gathered input its linears save, and an all-gather
again before its backward makes it whole. What the plan says, in order, with its frees.
That such plans train like one process is tests/runtime/test_sequence_parallel.py; that the
ledger counts them byte for byte with the runtime, tests/sim/test_memory_vs_runtime.py; the
bytes a layer keeps, tests/sim/test_layer_memory.py."""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb.ir.kinds import Op
from piper_nb.plan.instr import slice_name

LAYERS = {"embed": {"PP": 0, "L": 0}, "blocks.0": {"PP": 0, "L": 1},
          "blocks.1": {"PP": 0, "L": 2}, "head": {"PP": 0, "L": 3}}


def llama():
    return pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)


def compile_sp(*extra, sp=True, ann=LAYERS):
    model = llama()
    return pn.compile(pn.annotate(model, ann),
                      [pn.tensor_parallel({}, [0, 1], sequence_parallel=sp), *extra],
                      model.example_batch(batch_size=8, seed=0))


def _frees(instrs) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, ins in enumerate(instrs):
        if ins.kind == Op.FREE:
            for k in ins.data.keys:
                out.setdefault(k, []).append(i)
    return out


def test_each_sliced_input_is_gathered_again_before_its_backward():
    plan = compile_sp(pn.split({}, num=2))
    sharded = set(plan.tp_params)
    head = max(i.region for i in plan[0].instrs if i.kind == Op.F and i.data.slices)
    for dp in plan.devices:
        instrs = dp.instrs
        frees = _frees(instrs)
        where = {(i.kind, i.region, i.mb): k for k, i in enumerate(instrs) if i.is_compute}
        sliced = [(k, i) for k, i in enumerate(instrs) if i.kind == Op.F and i.data.slices]
        again = {(i.data.values, i.mb): k for k, i in enumerate(instrs)
                 if i.is_regather}
        # the two sharded parts of each layer that read the normed stream (QKV, the MLP's
        # first linear) and the head, for each microbatch
        assert len(sliced) == (2 * 2 + 1) * 2 and len(again) == len(sliced)
        for k, f in sliced:
            v = f.data.slices
            assert plan.values[slice_name(v[0])].shape[1] == plan.values[v[0]].shape[1] // 2
            r = again[(v, f.mb)]
            b = where[(Op.B, f.region, f.mb)]
            assert k < r < b and instrs[b].data.slices == v
            wait = next(j for j, x in enumerate(instrs) if x.kind == Op.WAIT and x.data.target == r)
            assert r < wait < b
            # issued before the backward of the sharded part before it, to run while that
            # one's matmuls do (the head's has none before it: issued after the forwards)
            between = {instrs[j].region for j in range(r, wait) if instrs[j].kind == Op.B}
            assert f.region == head or any(set(plan.regions[x].params) & sharded
                                           for x in between)
            whole, part = f"act:{v[0]}@{f.mb}", f"act:{slice_name(v[0])}@{f.mb}"
            # the whole input goes after the forward, its slice after the gather, and the
            # gathered one after the backward that last reads it
            assert frees[whole][0] < r and frees[whole][1] > b and len(frees[whole]) == 2
            assert r < frees[part][0] < wait
    again = pn.Plan.from_json(plan.to_json())
    assert [str(i) for i in again[1].instrs] == [str(i) for i in plan[1].instrs]
    assert [i.data for i in again[1].instrs] == [i.data for i in plan[1].instrs]
    assert any("AG_R" in str(i) for i in plan[0].instrs)


def test_a_split_backward_reads_the_gathered_input_until_bw():
    model = llama()
    ann = pn.cut_stages(model, 2)
    plan = pn.compile(pn.annotate(model, ann), [
        pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
        pn.tensor_parallel({"PP": 0}, [0, 1], sequence_parallel=True),
        pn.tensor_parallel({"PP": 1}, [2, 3], sequence_parallel=True),
        *pn.schedules.zero_bubble(2, 4)], model.example_batch(batch_size=8, seed=0))
    instrs = plan[0].instrs
    frees = _frees(instrs)
    sliced = [i for i in instrs if i.kind == Op.F and i.data.slices]
    assert sliced
    for f in sliced:
        at = {i.kind: k for k, i in enumerate(instrs)
              if i.is_compute and (i.region, i.mb) == (f.region, f.mb)}
        r = next(k for k, i in enumerate(instrs) if i.is_regather
                 and i.mb == f.mb and i.data.values == f.data.slices)
        assert Op.BI in at and r < at[Op.BI] < at[Op.BW]
        assert frees[f"act:{f.data.slices[0]}@{f.mb}"][-1] > at[Op.BW]


@pytest.mark.parametrize("case", ["no-sp", "full-units", "per-part-recompute"])
def test_left_whole_where_nothing_is_gathered_or_the_forward_runs_again(case):
    if case == "no-sp":
        plan = compile_sp(pn.split({}, num=2), sp=False)
    elif case == "full-units":   # the layer's parts run again before the backward
        plan = compile_sp(pn.split({}, num=2), pn.recompute({}))
    else:                        # only some parts recomputed: each keeps its inputs
        plan = compile_sp(pn.split({}, num=2), pn.recompute({"L": 1, "PART": 2}))
    regathers = [i for i in plan[0].instrs if i.is_regather]
    if case == "per-part-recompute":
        recomputed = {i.region for i in plan[0].instrs if i.kind == Op.F and i.data.recompute}
        assert recomputed and not any(i.region in recomputed for i in regathers)
        assert regathers   # the other layer's parts still keep slices
    else:
        assert regathers == []
