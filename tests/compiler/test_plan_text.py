"""Plans read like schedules: expected per-device instruction lists in text form."""

import pytest

import piper_nb as pn
from piper_nb.plan.plan import Plan


def stages(model, n):
    return pn.annotate(model, pn.cut_stages(model, n))


def test_one_f_one_b_two_ranks_with_sends_receives_and_waits(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 2), pn.schedules.one_f_one_b(2, 2, place=True), batch)
    assert plan[0].text() == ["r0:F0", "r0:SEND_F0>1", "r0:RECV_B0<1", "r0:F1", "r0:SEND_F1>1",
                              "r0:RECV_B1<1", "r0:B0", "r0:B1", "r0:U"]
    assert plan[1].text() == ["r1:RECV_F0<0", "r1:F0", "r1:RECV_F1<0", "r1:B0", "r1:SEND_B0>0",
                              "r1:F1", "r1:B1", "r1:SEND_B1>0", "r1:U"]
    # receives are issued a pass ahead and waited for right before their consumer
    assert plan[1].text(waits=True)[:9] == [
        "r1:RECV_F0<0", "wait(r1:RECV_F0<0)", "r1:F0", "free(act:model_layers_3_1@0)",
        "r1:RECV_F1<0", "r1:B0", "r1:SEND_B0>0", "wait(r1:RECV_F1<0)", "r1:F1"]


def test_zero_levels_lower_to_distinct_collectives(mlp):
    model, batch = mlp
    spec = stages(model, 1)
    seen = {}
    for zero in range(4):
        plan = pn.compile(spec, [pn.replicate({}, [0, 1], zero=zero), pn.split({}, "MB", 2)], batch)
        seen[zero] = [str(i) for i in plan[0].instrs if i.is_issue]
    assert seen[0] == ["b0:AR"]
    assert seen[1] == ["b0:RS", "b0:AG"]
    assert seen[2] == ["b0:RS0", "b0:RS1", "b0:AG"]
    # no order directive and nothing to wait for from peers: F0 B0 F1 B1, as gradient
    # accumulation runs (F1's gather is prefetched during B0)
    assert seen[3] == ["b0:AG@F0", "b0:AG@B0", "b0:AG@F1", "b0:RS0", "b0:AG@B1",
                       "b0:RS1"]


def test_zero3_frees_gathered_parameters_after_every_pass(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 1), [pn.replicate({}, [0, 1], zero=3)], batch)
    assert plan[0].text(waits=True) == [
        "b0:AG@F", "b0:AG@B", "wait(b0:AG@F)", "r0:F", "free(param:0)", "wait(b0:AG@B)", "r0:B",
        "free(param:0)", "b0:RS", "wait(b0:RS)", "r0:U"]
    frees = [i for i in plan[0].instrs if i.kind == "FREE" and "param:0" in i.data.keys]
    assert len(frees) == 2


def test_plan_json_round_trips(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 4), pn.schedules.dualpipev(2, 4, place=True), batch)
    again = Plan.from_json(plan.to_json())
    assert again.devices == plan.devices and again.buckets == plan.buckets
    assert again.grid() == plan.grid()


def test_dag_text_and_json_round_trip(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 2), [
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2], zero=1), pn.replicate({"PP": 1}, [1, 3], zero=1),
        *pn.schedules.one_f_one_b(2, 4)], batch)
    dag = plan.dag
    again = pn.TrainingDAG.from_text(dag.text())
    assert (again.nodes, again.edges, again.history) == (dag.nodes, dag.edges, dag.history)
    again = pn.TrainingDAG.from_json(dag.to_json())
    assert (again.nodes, again.edges) == (dag.nodes, dag.edges)
    pn.validate(again, placed=True)


def test_zero3_without_reshard_gathers_once_and_reduces_once(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 1), [pn.replicate({}, [0, 1], zero=3, reshard=False),
                                         pn.split({}, "MB", 2)], batch)
    assert plan[0].text(waits=True) == [
        "b0:AG", "wait(b0:AG)", "r0:F0", "r0:B0", "r0:F1", "r0:B1", "free(param:0)", "b0:RS",
        "wait(b0:RS)", "r0:U"]
    with pytest.raises(pn.PlanError, match="only applies to zero=3"):
        pn.replicate({}, [0, 1], zero=2, reshard=False)


def test_zero3_gradients_reduce_once_per_step_or_after_each_microbatch(mlp):
    model, batch = mlp
    step = pn.compile(stages(model, 1), [pn.replicate({}, [0, 1], zero=3, grad_sync="step"),
                                         pn.split({}, "MB", 2)], batch)
    # gathers pulled a pass ahead as always; one reduction, after the last backward
    assert step[0].text() == ["b0:AG@F0", "b0:AG@B0", "r0:F0", "b0:AG@F1", "r0:B0", "b0:AG@B1",
                              "r0:F1", "r0:B1", "b0:RS", "r0:U"]
    held = pn.compile(stages(model, 1), [
        pn.replicate({}, [0, 1], zero=3, reshard=False, grad_sync="microbatch"),
        pn.split({}, "MB", 2)], batch)
    assert held[0].text() == ["b0:AG", "r0:F0", "r0:B0", "b0:RS0", "r0:F1", "r0:B1", "b0:RS1",
                              "r0:U"]
    with pytest.raises(pn.PlanError, match="which is zero=1"):
        pn.replicate({}, [0, 1], zero=2, grad_sync="step")
    with pytest.raises(pn.PlanError, match="applies to zero=2 and zero=3"):
        pn.replicate({}, [0, 1], zero=1, grad_sync="microbatch")
    with pytest.raises(pn.PlanError, match="'microbatch' or 'step'"):
        pn.replicate({}, [0, 1], zero=3, grad_sync="never")


def test_print_plan_names_what_the_prefixes_stand_for(mlp):
    model, batch = mlp
    plan = pn.compile(stages(model, 2), [pn.replicate({}, [0, 1], zero=3),
                                         pn.split({}, "MB", 2)], batch)
    text = str(plan)
    assert text.startswith(plan.grid()) and "b0:AG@F0" in text
    assert text.endswith("r0 = {PP=0}   r1 = {PP=1}\n"
                         "b0 = 8 parameters of r0 over devices 0,1 (ZeRO-3)\n"
                         "b1 = 8 parameters of r1 over devices 0,1 (ZeRO-3)")
    assert str(plan[0]).startswith("dev0: b0:AG@F0 b1:AG@F0 r0:F0 b1:AG@B0 r1:F0 ")
