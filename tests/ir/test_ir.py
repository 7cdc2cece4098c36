"""IR atoms: filters, action text form, immutable nodes, validate()."""

import dataclasses

import pytest

import piper_nb as pn
from piper_nb.ir.action import Action, grid_text, parse_action, parse_grid, parse_slot
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import as_filter, freeze_tags, matches
from piper_nb.ir.kinds import Op
from piper_nb.ir.node import Edge, Node


def test_filters_are_conjunctive_with_wildcards():
    tags = {"PP": 1, "EP": 0, "MB": 3, "PASS": "F"}
    assert matches({}, tags)
    assert matches({"PP": 1, "PASS": "F"}, tags)
    assert matches({"EP": "*"}, tags)
    assert not matches({"PP": 0}, tags)
    assert not matches({"TP": "*"}, tags)


def test_tags_have_a_canonical_order():
    assert freeze_tags({"MB": 0, "PASS": "F", "EP": 1, "PP": 2}) == (
        ("PP", 2), ("EP", 1), ("MB", 0), ("PASS", "F"))


@pytest.mark.parametrize("bad", [{"PP": -1}, {"PP": "x"}, {"PASS": "Q"}, {"": 1}, {"PP": True}])
def test_bad_filters_are_plan_errors(bad):
    with pytest.raises(pn.PlanError):
        as_filter(bad)


def test_action_text_round_trips_in_pytorch_form():
    assert str(parse_action("2I1")) == "2I1"
    assert parse_action("0F3") == Action(0, "F", 3)
    assert parse_slot("(1F1;2B0)OVERLAP_F_B") == (Action(1, "F", 1), Action(2, "B", 0))
    grid = parse_grid("rank 0: 0F0 0F1 (0F2;1B0)\n1: 1F0 1W0 .")
    assert grid_text(grid) == "0F0 0F1 (0F2;1B0)\n1F0 1W0"
    with pytest.raises(pn.PlanError, match="cannot read"):
        parse_action("F0")


def test_nodes_are_immutable_and_validate_catches_dangling_edges():
    n = Node("F[PP=0]", Op.F, (("PP", 0), ("PASS", "F")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        n.devices = (1,)
    assert n.with_attrs(x=1).attr("x") == 1 and n.attr("x") is None
    dag = TrainingDAG((n,), (Edge("F[PP=0]", "B[PP=0]"),))
    with pytest.raises(pn.PlanError, match="not in the DAG"):
        pn.validate(dag)
    with pytest.raises(pn.PlanError, match="not placed"):
        pn.validate(TrainingDAG((n,), ()), placed=True)


def test_directives_do_not_mutate_their_input():
    model = pn.models.MLP(dim=4, depth=2)
    batch = model.example_batch(batch_size=4, seed=0)
    spec = pn.annotate(model, {"layers.0": {"PP": 0}, "layers.1": {"PP": 1}})
    plan = pn.compile(spec, pn.schedules.one_f_one_b(2, 2, place=True), batch)
    history = plan.dag.history
    assert history[0] == "build" and any(h.startswith("split") for h in history)
    assert any(h.startswith("order") for h in history)
