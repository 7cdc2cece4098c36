"""TrainingDAG -> graphviz: clusters per device set, comm nodes set apart, temporal edges
dashed, and collapsing by tag; the SVG renders with `dot`."""

from __future__ import annotations

import piper_nb as pn
from piper_nb.viz.dag import dag_to_graphviz, dag_view


def plan_dp_pp():
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [*pn.schedules.one_f_one_b(ranks=2, microbatches=4),
               pn.place({"PP": 0}, devices=[0, 2]), pn.place({"PP": 1}, devices=[1, 3]),
               pn.replicate({"PP": 0}, devices=[0, 2], zero=3),
               pn.replicate({"PP": 1}, devices=[1, 3], zero=1)]
    return pn.compile(spec, program, model.example_batch(batch_size=16, seed=0))


def test_svg_renders_with_one_cluster_per_device_set():
    g = dag_to_graphviz(plan_dp_pp().dag)
    svg = g.pipe(format="svg").decode()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "subgraph cluster_0_2" in g.source and "subgraph cluster_1_3" in g.source
    assert "devices 0,2" in svg


def test_comm_nodes_have_their_own_shapes_and_temporal_edges_are_dashed():
    src = dag_to_graphviz(plan_dp_pp().dag, collapse=()).source
    assert "shape=cds" in src and "shape=hexagon" in src and "shape=box" in src
    assert "style=dashed" in src


def test_collapsing_microbatches_merges_nodes_that_differ_only_in_mb():
    dag = plan_dp_pp().dag
    full, merged = dag_view(dag, collapse=()), dag_view(dag, collapse=("MB",))
    assert len(full.nodes) == len(dag.nodes)
    assert len(merged.nodes) < len(full.nodes) / 2
    labels = {v["label"] for v in merged.nodes.values()}
    assert "F[PP=0] x4" in labels and "U[PP=0]" in labels
    assert not any(a == b for a, b, _ in merged.edges)          # no self loops


def test_large_dags_collapse_by_themselves_and_say_what_is_hidden():
    dag = plan_dp_pp().dag
    auto = dag_view(dag, max_nodes=len(dag.nodes) - 1)
    assert auto.collapse == ("MB",)
    capped = dag_view(dag, collapse=(), max_nodes=5)
    assert len(capped.nodes) == 5 and capped.hidden == len(dag.nodes) - 5
    assert "more nodes" in dag_to_graphviz(dag, collapse=(), max_nodes=5).source


def test_a_dag_too_big_for_microbatch_merging_opens_as_one_node_per_stage():
    dag = plan_dp_pp().dag
    view = dag_view(dag, max_nodes=8)          # merging microbatches leaves more than 8
    assert view.collapse == ("MB", "PASS", "bucket")
    labels = sorted(v["label"] for v in view.nodes.values())
    assert len(labels) == 2 and labels[0].startswith("PP=0\nF x4, B x4, U\n")
    assert "RS" in labels[0] and "SEND x4" in labels[0]
    assert {v["devices"] for v in view.nodes.values()} == {(0, 2), (1, 3)}
    assert sum(view.edges.values()) > 0 and not any(a == b for a, b, _ in view.edges)
