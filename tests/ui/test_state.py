"""The Designer's logic without widgets: text fields, pure edits on `DesignerState`,
`compile_state`'s problems (pointing at rows and layers), Piper JSON and the Python view."""

from __future__ import annotations

import json

import pytest
import torch

import piper_nb as pn
from piper_nb.compiler.compile import expand
from piper_nb.ui import fields
from piper_nb.ui.codegen import python_code
from piper_nb.ui.compute import compile_state, evaluate
from piper_nb.ui.dag_draw import dag_groups, dag_svg, node_details
from piper_nb.ui.designer import default_design
from piper_nb.ui.state import (
    DesignerState,
    add_row,
    cut,
    effective_tags,
    import_json,
    microbatches,
    move_row,
    new_row,
    program_json,
    remove_row,
    schedule_row,
    set_microbatches,
    set_tags,
    update_row,
)


@pytest.fixture
def state(gpt):
    ann, rows = default_design(gpt[0])
    return DesignerState(model=gpt[0], batch=gpt[1], annotations=ann, rows=tuple(rows))


def test_field_text_forms_round_trip():
    assert fields.parse_filter("PP=0, EP=*") == {"PP": 0, "EP": "*"}
    assert fields.parse_filter('{"PP": 1}') == {"PP": 1}
    assert fields.parse_filter("") == {}
    assert fields.parse_filter("PP 0") == "PP 0"            # kept as typed, becomes a Problem
    assert fields.parse_devices("0, 2") == [0, 2] == fields.parse_devices("[0,2]")
    assert fields.parse_devices("0,x") == "0,x"
    slots = [[{"PP": 1, "MB": 1, "PASS": "F"}, {"PP": 1, "MB": 0, "PASS": "B"}],
             [{"PP": 1, "MB": 2, "PASS": "F"}]]
    text = fields.slots_text(slots)
    assert text == "PP=1, MB=1, PASS=F | PP=1, MB=0, PASS=B\nPP=1, MB=2, PASS=F"
    assert fields.parse_slots(text) == slots
    assert fields.parse_tag_parts("TP=1, X") == {"TP": 1, "X": ""}


def test_a_new_replicate_row_replicates_where_its_stage_is_placed(state):
    assert new_row("replicate", state)["devices"] == [0]      # the default design's place
    wide = state.replace(rows=({"op": "place", "filter": {"PP": 0}, "devices": [0, 2]},
                               {"op": "place", "filter": {"PP": 1}, "devices": [1, 3]}))
    assert new_row("replicate", wide) == {"op": "replicate", "filter": {"PP": 0},
                                          "devices": [0, 2], "zero": 0}
    assert new_row("replicate", state.replace(rows=()))["devices"] == [0, 2]  # none placed


def test_edits_are_pure_and_do_what_they_say(state):
    before = json.dumps(state.rows)
    s2 = add_row(state, new_row("split", state))
    s3 = move_row(s2, len(s2.rows) - 1, -10)
    s4 = update_row(s3, 0, {"num_microbatches": 2})
    s5 = remove_row(s4, 0)
    assert json.dumps(state.rows) == before                # nothing mutated in place
    assert [r["op"] for r in s3.rows] == ["split", "place", "place", "schedule"]
    assert s4.rows[0]["num_microbatches"] == 2
    assert json.dumps(s5.rows) == before
    assert microbatches(state) == 4 and microbatches(set_microbatches(state, 8)) == 8


def test_layer_tags_and_even_cut(state):
    s = set_tags(state, "blocks.1.attn", {"TP": 1})
    assert effective_tags(s, "blocks.1.attn.qkv") == {"PP": 0, "TP": 1}
    s = cut(s, 4, by="params")
    assert {p: t.get("PP") for p, t in s.annotations.items() if "PP" in t} == {
        p: t["PP"] for p, t in pn.cut_stages(state.model, 4).items()}
    assert s.annotations["blocks.1.attn"] == {"TP": 1}    # other tags survive a re-cut
    by_flops = cut(state, 2, by="flops")
    assert {t["PP"] for t in by_flops.annotations.values()} == {0, 1}


def test_default_design_compiles_and_simulates(state):
    plan, problems = compile_state(state)
    assert problems == [] and plan.world == 2 and plan.microbatches == 4
    out = evaluate(state)
    assert out.trace is not None and out.trace.step_time > 0 and set(out.seconds) == {"compile", "simulate"}


def test_problems_point_at_the_row_or_layer(state):
    bad_row = add_row(state, {"op": "place", "filter": {"PP": 0}, "devices": "0,x"})
    plan, problems = compile_state(bad_row)
    assert plan is None and [p.row for p in problems] == [3]
    assert "devices" in problems[0].message and "Traceback" not in problems[0].text()
    # a whole-program error (3 microbatches for a batch of 8) names the schedule row
    plan, problems = compile_state(set_microbatches(state, 3))
    assert plan is None and problems[0].row == 2 and "divide" in problems[0].message
    plan, problems = compile_state(set_tags(state, "blocks.0", {"PP": "x"}))
    assert plan is None and problems[0].layer == "blocks.0" and "PP" in problems[0].message
    bad_sched = update_row(state, 2, {"name": "nope"})
    assert "unknown schedule" in compile_state(bad_sched)[1][0].message


def test_piper_json_round_trip_and_expansion(state):
    text = program_json(state)
    assert json.loads(text) == [dict(r) for r in state.rows]
    back = import_json(state.replace(rows=()), text)
    assert list(back.rows) == list(state.rows)
    expanded = json.loads(program_json(state, expand=True))
    assert {r["op"] for r in expanded} == {"place", "split", "order"}
    assert pn.Program.from_json(json.dumps(expanded)) == pn.Program(
        [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
         *pn.schedules.one_f_one_b(ranks=2, microbatches=4)])
    with pytest.raises(pn.PlanError):
        import_json(state, '{"op": "place"}')


def test_python_view_rebuilds_the_same_program(state, gpt):
    s = add_row(state, {"op": "replicate", "filter": {"PP": 0}, "devices": [0], "zero": 1})
    s = add_row(s, schedule_row("Interleaved 1F1B", 2, 4, chunks=2))
    code = python_code(s)
    assert "pn.replicate({\"PP\": 0}, devices=[0], zero=1)" in code
    assert "*pn.schedules.one_f_one_b(ranks=2, microbatches=4)" in code
    assert "*pn.schedules.interleaved_1f1b(ranks=2, microbatches=4, chunks=2)" in code
    body = code.split("plan = ")[0]
    scope = {"model": gpt[0], "batch": gpt[1]}
    exec(body, scope)
    assert scope["program"] == pn.Program(d for _, d in expand(pn.Program(s.rows)))
    assert scope["spec"].annotations == dict(s.annotations)
    broken = python_code(add_row(state, {"op": "split", "num_microbatches": -1}))
    assert "# directive #3 does not parse" in broken


def test_dag_drawing_carries_node_ids_and_details(state):
    plan, _ = compile_state(state)
    svg, groups = dag_svg(plan.dag, "none")
    assert '<g id="F[PP=0,MB=0]" class="node">' in svg
    assert len(groups.members) == len(plan.dag.nodes)
    merged = dag_groups(plan.dag, "MB")
    assert merged.members["F[PP=1,MB=0]"] == [f"F[PP=1,MB={m}]" for m in range(4)]
    html = node_details(plan.dag, "F[PP=1,MB=0]", merged)
    assert "Stands for 4 nodes" in html and "RECV" in html and "SEND" not in html.split("outputs")[0]
    assert "not in the current DAG" in node_details(plan.dag, "F[PP=9]", merged)


def test_default_design_fits_the_model_and_batch():
    ann, rows = default_design(torch.nn.Linear(4, 4), batch_size=6)     # one unit: no stages
    assert ann == {} and rows == [{"op": "split", "filter": {}, "dim_name": "MB",
                                   "num_microbatches": 2}]
    ann, rows = default_design(pn.models.TinyGPT(layers=2), batch_size=6)
    assert rows[-1]["microbatches"] == 2 and {t["PP"] for t in ann.values()} == {0, 1}


def test_profiled_cost_model_is_measured_once_per_design(state):
    from piper_nb.ui.compute import cost_model
    plan, _ = compile_state(state)
    cache: dict = {}
    first = cost_model(state.replace(cost="profiled"), plan, cache)
    assert first.unit == "s" and cost_model(state.replace(cost="profiled"), plan, cache) is first
    assert cost_model(state, plan, cache).unit == "unit"
