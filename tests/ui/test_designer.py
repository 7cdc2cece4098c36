"""The Designer's widgets driven from Python: set traits and values the way the front end
would (a click on the DAG sets `selected`, typing sets a box's `value`, buttons are
clicked with `.click()`) and check the views, rows and problems that follow."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

import piper_nb as pn
from piper_nb.ui import Designer
from piper_nb.ui.codegen import python_code
from piper_nb.ui.views import TABS
from piper_nb.ui.widgets import DagView, asset_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def designer(gpt):
    d = Designer(*gpt, debounce=None)       # every edit refreshes at once
    yield d
    d.close()


def bars(fig) -> int:
    return sum(len(t.x) for t in fig.data if t.type == "bar")


def show(designer, tab: str) -> None:
    """Select a view tab, as a click on it would."""
    designer.views.tabs.selected_index = TABS.index(tab)


def test_front_end_assets_are_found_and_loaded_by_path():
    assert (asset_dir() / "dag_view.js").is_file() and (asset_dir() / "dag_view.css").is_file()
    view = DagView()
    assert "export default" in view._esm and "pn-selected" in view._css


def test_opens_on_a_compiling_two_stage_1f1b(designer):
    assert designer.problems == [] and designer.plan.world == 2
    assert '<g id="F[PP=0,MB=0]" class="node">' in designer.views.dag.svg
    assert designer.views.stale == {"Timeline", "Memory"}        # drawn when shown
    show(designer, "Timeline")
    show(designer, "Memory")
    assert bars(designer.views.timeline) > 0 and len(designer.views.memory.data) == 3
    assert designer.views.stale == set()
    assert "r0:F0" in designer.views.grid.value and "r1:B3" in designer.views.grid.value
    assert "plan checked" in designer.views.status.value
    assert designer.last_refresh_seconds > 0
    assert [r.op for r in designer.directives.rows] == ["place", "place", "schedule"]
    assert designer.layers.rows["blocks.1"].pp.value == "0"


def test_clicking_a_dag_node_shows_its_details(designer):
    views = designer.views
    assert views.dag.zoom == 0 and not views.dag.details       # opens readable, details shut
    assert views.details.layout.display == "none" and views.dag.layout.width == "100%"
    views.dag.selected = "F[PP=1,MB=0]"                  # what dag_view.js posts on a click
    assert views.dag.details and views.details.layout.display == ""
    assert views.dag.layout.width == "68%"
    details = designer.views.details.value
    for text in ("F[PP=1,MB=0]", "devices</td><td>1", "stream</td><td>compute", "inputs",
                 "RECV(F[PP=0,MB=0]", "outputs", "B[PP=1,MB=0]"):
        assert text in details
    designer.views.dag.selected = "nonsense"
    assert "not in the current DAG" in designer.views.details.value
    views.dag.details = False                            # the *details* button
    assert views.details.layout.display == "none" and views.dag.layout.width == "100%"


def test_microbatch_edit_recompiles_and_redraws_in_place(designer):
    timeline, memory, dag = designer.views.timeline, designer.views.memory, designer.views.dag
    show(designer, "Timeline")
    before_bars, before_grid = bars(timeline), designer.views.grid.value
    before_svg = dag.svg
    designer.microbatches.value = 8
    assert designer.plan.microbatches == 8 and designer.state.rows[2]["microbatches"] == 8
    assert bars(designer.views.timeline) > before_bars and designer.views.grid.value != before_grid
    assert timeline.layout.title.text.startswith("Simulated timeline")
    assert dag.svg == before_svg and "DAG" in designer.views.stale   # hidden: drawn on show
    show(designer, "DAG")      # 67 nodes: "auto" opens it collapsed by microbatch
    assert "F[PP=0,MB=7]" not in dag.svg and 'id="F[PP=0,MB=0]"' in dag.svg
    designer.views.collapse.value = "none"
    assert "F[PP=0,MB=7]" in dag.svg
    assert designer.views.timeline is timeline and designer.views.memory is memory
    assert designer.views.dag is dag
    assert "2 devices x 8 microbatches" in designer.views.status.value


def test_bad_directive_is_a_problem_on_its_row(designer):
    designer.directives.op.value = "place"
    designer.directives.add.click()
    row = designer.directives.rows[3]
    row.widget("devices").value = "0,x"
    assert [p.row for p in designer.problems] == [3]
    assert "pn-row-error" in row.box._dom_classes and "devices" in row.error.value
    assert "directive #3 (place)" in designer.views.problems.value
    assert "Traceback" not in designer.views.problems.value
    assert designer.views.tabs.titles[4] == "Problems (1)"
    assert "No DAG" in designer.views.dag.message
    row.widget("devices").value = "0"
    assert designer.problems == [] and "pn-row-error" not in row.box._dom_classes
    assert designer.views.dag.message == ""


def test_whole_program_error_points_at_the_schedule_row(designer):
    designer.microbatches.value = 3                    # does not divide the batch of 8
    (problem,) = designer.problems
    assert problem.row == 2 and "divide" in problem.message
    assert problem.where == "directive #2 (schedule 1f1b)"   # the row, not its order
    assert "pn-row-error" in designer.directives.rows[2].box._dom_classes


def test_rows_move_and_go(designer):
    designer.directives.rows[2].up.click()
    assert [r["op"] for r in designer.state.rows] == ["place", "schedule", "place"]
    designer.directives.rows[1].remove.click()
    assert [r.op for r in designer.directives.rows] == ["place", "place"]
    assert "empty" not in designer.views.problems.value and designer.plan is not None
    designer.directives.schedule.value = "interleaved_1f1b"
    designer.directives.ranks.value = 2
    designer.directives.micro.value = 4
    designer.directives.add_schedule.click()
    assert designer.state.rows[-1] == {"op": "schedule", "name": "interleaved_1f1b", "ranks": 2,
                                       "microbatches": 4, "chunks": 2}
    assert not designer.directives.rows[-1].widget("chunks").disabled


def test_replicate_rows_set_the_zero_level():
    model = pn.models.TinyGPT(layers=4, tie_embeddings=False)
    d = Designer(model, model.example_batch(batch_size=8), debounce=None, program=[
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
        *pn.schedules.one_f_one_b(ranks=2, microbatches=2)])
    assert d.problems == [] and d.plan.world == 4
    d.directives.rows[2].widget("zero").value = 3
    assert d.state.rows[2]["zero"] == 3
    assert d.problems == [] and "ALL_GATHER" in d.plan.dag.text()
    d.directives.rows[3].widget("devices").value = "1, 2"
    assert d.problems[0].row == 3 and "replicate" in d.problems[0].text()


def test_order_and_shard_rows_edit_their_fields(designer):
    designer.directives.op.value = "order"
    designer.directives.add.click()
    order = designer.directives.rows[3]
    order.widget("filters").value = "PP=0,MB=0,PASS=F\nPP=0,MB=1,PASS=F | PP=0,MB=0,PASS=B"
    assert designer.state.rows[3]["filters"] == [
        [{"PP": 0, "MB": 0, "PASS": "F"}],
        [{"PP": 0, "MB": 1, "PASS": "F"}, {"PP": 0, "MB": 0, "PASS": "B"}]]
    designer.directives.op.value = "shard"
    designer.directives.add.click()
    shard = designer.directives.rows[4]
    shard.widget("filter").value = "PP=1, EP=*"
    shard.widget("stream").value = "ep"
    assert designer.state.rows[4] == {"op": "shard", "filter": {"PP": 1, "EP": "*"},
                                      "devices": [0, 1], "stream": "ep"}
    assert any(p.row in (3, 4) for p in designer.problems)    # TinyGPT has no EP regions


def test_json_export_import_round_trip(designer):
    designer.directives.export()
    exported = json.loads(designer.directives.json.value)
    assert exported == [dict(r) for r in designer.state.rows]
    designer.directives.json.value = (EXAMPLES / "pp2_1f1b.json").read_text().replace(
        '"microbatches": 4', '"microbatches": 2')
    designer.directives.import_button.click()
    assert designer.state.rows[2]["microbatches"] == 2 and designer.plan.microbatches == 2
    assert designer.microbatches.value == 2
    designer.directives.json.value = "[{not json"
    designer.directives.import_button.click()
    assert "not imported" in designer.directives.json_status.value
    assert designer.state.rows[2]["microbatches"] == 2
    designer.directives.expand.value = True
    designer.directives.export_button.click()
    assert {r["op"] for r in json.loads(designer.directives.json.value)} == {"place", "split", "order"}


def test_json_view_follows_edits_until_typed_into(designer):
    designer.microbatches.value = 8
    assert json.loads(designer.directives.json.value)[2]["microbatches"] == 8
    designer.directives.json.value = "[]  // mine"
    designer.microbatches.value = 2
    assert designer.directives.json.value == "[]  // mine"    # what the user typed stays
    designer.directives.export_button.click()
    designer.microbatches.value = 4
    assert json.loads(designer.directives.json.value)[2]["microbatches"] == 4


def test_python_view_follows_edits(designer):
    designer.microbatches.value = 8
    assert "one_f_one_b(ranks=2, microbatches=8)" in designer.directives.python.value


def test_layer_tags_and_cut(designer):
    row = designer.layers.rows["blocks.1"]
    row.pp.value = "x"
    assert designer.problems[0].layer == "blocks.1"
    assert "pn-layer-error" in row.row._dom_classes and "blocks.1" in designer.layers.message.value
    row.pp.value = "1"
    assert designer.state.annotations["blocks.1"] == {"PP": 1} and designer.problems == []
    designer.layers.cut_n.value = 4
    designer.layers.cut()
    assert designer.layers.rows["blocks.3"].pp.value == "3"
    assert designer.problems and designer.problems[0].stage in ("compile", "directive")
    designer.layers.fold(designer.layers.rows["blocks.2"])     # unfold: children rows appear
    assert "PP=2" in designer.layers.rows["blocks.2.attn"].effective.value
    designer.layers.fold(designer.layers.rows["blocks.2.attn"])
    qkv = designer.layers.rows["blocks.2.attn.qkv"].name.value    # the model's own TP plan
    assert "TP colwise" in qkv and "shards it colwise" in qkv
    assert "TP " not in designer.layers.rows["blocks.2.ln1"].name.value


def test_eager_views_draw_every_tab(gpt):
    d = Designer(*gpt, debounce=None, lazy_views=False)
    assert d.views.stale == set() and bars(d.views.timeline) > 0 and len(d.views.memory.data) == 3


def test_collapse_and_cost_options_redraw(designer):
    designer.views.collapse.value = "MB"
    assert '<g id="F[PP=0,MB=1]"' not in designer.views.dag.svg
    designer.views.cost.value = "analytic"
    assert designer.trace.unit == "s"


def test_edits_are_debounced_into_one_refresh(gpt):
    d = Designer(*gpt, debounce=0.2)
    try:
        start = d.refreshes
        for n in (2, 4, 8):
            d.microbatches.value = n
        assert d.refreshes == start
        deadline = time.monotonic() + 10
        while d.refreshes == start and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert d.refreshes == start + 1 and d.plan.microbatches == 8
    finally:
        d.close()


@pytest.mark.dist
def test_launch_trains_and_matches_the_reference(gpt):
    d = Designer(*gpt, debounce=None)
    try:
        assert d.launcher.plots.layout.display == "none"    # no empty plots before a launch
        assert "appear here once it runs" in d.launcher.status.value
        d.launch(steps=2, wait=True)
        run = d.launcher
        assert run.error is None, run.status.value
        assert run.plots.layout.display == ""
        y2 = run.loss.layout.yaxis2                  # the constant lr 0.1 at round ticks
        assert (y2.tick0, y2.dtick, tuple(y2.range)) == (0, 0.025, (0, 0.125))
        assert run.progress.value == 2 and "done" in run.status.value
        assert run.result.losses == pytest.approx(run.reference.losses, rel=1e-5, abs=4e-5)
        assert list(run.loss.data[0].y) == pytest.approx(run.result.losses)
        assert list(run.loss.data[2].y) == pytest.approx(run.result.lrs)   # learning rate
        halves = {t.xaxis for t in run.timelines.data if t.type == "bar"}
        assert halves == {"x", "x2"} and bars(run.timelines) > 0     # predicted | measured
    finally:
        d.close()


def test_a_model_without_a_loss_is_designed_with_loss_fn():
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    batch = (torch.randn(8, 4), torch.randn(8, 2))
    bare = Designer(model, batch, debounce=None)
    try:
        assert bare.outcome.plan is None
        assert "pass loss_fn=(output, targets) -> loss to pn.Designer(model, batch, " \
               "loss_fn=...)" in bare.outcome.problems[0].message
    finally:
        bare.close()

    def mse(out, y):
        return torch.nn.functional.mse_loss(out, y)
    d = Designer(model, batch, debounce=None, loss_fn=mse)
    try:
        assert d.outcome.plan is not None and not d.outcome.problems
        assert "pn.compile(spec, program, batch, loss_fn=loss_fn)" in \
            d.directives.python.value
        d.launch(steps=2, wait=True)
        run = d.launcher
        assert run.error is None, run.status.value
        # the reference and a plain loop, both with the same loss
        plain = [p.detach().clone() for p in model.parameters()]
        losses = []
        for _ in range(2):
            out = model(batch[0])
            loss = mse(out, batch[1])
            losses.append(loss.item())
            grads = torch.autograd.grad(loss, list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads, strict=True):
                    p -= run.lr.value * g
        with torch.no_grad():
            for p, q in zip(model.parameters(), plain, strict=True):
                p.copy_(q)
        assert run.result.losses == pytest.approx(run.reference.losses, rel=1e-5, abs=4e-5)
        assert run.result.losses == pytest.approx(losses, rel=1e-5, abs=4e-5)
    finally:
        d.close()


def test_launch_trains_with_the_optimizer_given_and_names_it(gpt):
    import functools

    import torch
    adam = functools.partial(torch.optim.Adam, lr=1e-2)
    d = Designer(*gpt, debounce=None, optimizer=adam)
    try:
        assert "Adam(lr=0.01)" in d.launcher.status.value and d.launcher.lr.disabled
        assert "designer.result" in d.launcher.status.value
        d.launch(steps=2, wait=True)
        run = d.launcher
        assert run.error is None, run.status.value
        assert d.result is run.result and "Adam(lr=0.01)" in run.status.value
        ref = pn.reference_train(gpt[0], gpt[1], 2, d.plan.reference_microbatches, adam)
        assert d.result.losses == pytest.approx(ref.losses, rel=1e-5, abs=4e-5)
        sgd = pn.reference_train(gpt[0], gpt[1], 2, d.plan.reference_microbatches,
                                 pn.optim.SGD(lr=0.1))
        assert d.result.losses[1] != pytest.approx(sgd.losses[1], rel=1e-5, abs=4e-5)
    finally:
        d.close()
    with pytest.raises(pn.PlanError):
        Designer(*gpt, debounce=None, optimizer="adam")


def test_a_tensor_parallel_row_toggles_sequence_parallelism():
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    d = Designer(model, model.example_batch(batch_size=4, seed=0), debounce=None,
                 program=[pn.tensor_parallel({}, [0, 1])])
    try:
        assert d.problems == [] and not d.plan.capture.tp.sequence
        row = d.directives.rows[0]
        assert not row.widget("sequence_parallel").value
        row.widget("sequence_parallel").value = True
        assert d.state.rows[0]["sequence_parallel"] is True
        assert d.problems == [] and d.plan.capture.tp.sequence          # norms on slices
        assert "sequence_parallel=True" in python_code(d.state)
        row.widget("sequence_parallel").value = False
        assert "sequence_parallel" not in d.state.rows[0] and not d.plan.capture.tp.sequence
    finally:
        d.close()


def test_a_recompute_row_picks_full_or_selective():
    model = pn.models.TinyGPT(vocab=32, dim=32, layers=2, heads=4, seq=8)
    d = Designer(model, model.example_batch(batch_size=4, seed=0), debounce=None,
                 program=[pn.place({}, [0]), pn.recompute({})])
    try:
        row = d.directives.rows[1]
        assert d.problems == [] and row.widget("mode").value == "full"
        full = sum(d.plan.saved.values())
        row.widget("mode").value = "selective"
        assert d.state.rows[1]["mode"] == "selective" and d.problems == []
        assert 'mode="selective"' in python_code(d.state)
        assert any(str(n.target).startswith("recomputed_attention_")
                   for m in d.plan.capture.modules for n in m.graph.nodes)
        assert sum(d.plan.saved.values()) < full   # the attention keeps its inputs only
        row.widget("mode").value = "full"
        assert "mode" not in d.state.rows[1]
    finally:
        d.close()


def test_the_run_tab_saves_the_plan_for_a_batch_job(designer, tmp_path):
    job = designer.launcher.job
    job.directory.value = str(tmp_path / "job")
    job.button.click()
    saved = pn.load_plan(tmp_path / "job")
    plan = designer.plan
    assert saved.plan.grid() == plan.grid() and saved.batch is not None
    assert saved.optimizer is not None                   # the Run tab's, as a launch uses
    want = (f"torchrun --standalone --nproc-per-node {plan.world} -m piper_nb launch "
            f"{(tmp_path / 'job').resolve()} --steps {designer.launcher.steps.value}")
    assert want in job.commands.value
    assert f"#SBATCH --ntasks={plan.world}" in job.commands.value
    assert "srun --kill-on-bad-exit=1 python -m piper_nb launch" in job.commands.value
    (tmp_path / "file").write_text("mine")
    job.directory.value = str(tmp_path / "file")
    job.button.click()
    assert "is a file" in job.status.value and (tmp_path / "file").read_text() == "mine"


def test_figures_say_each_thing_once_in_device_colours(designer):
    """One title per figure (no "predicted: Simulated timeline"), µs for short steps, and
    the peak bars in the colours of their devices' lines."""
    from piper_nb.ui.render import device_color, memory_figure
    from piper_nb.viz.units import time_scale
    designer.views.draw("Timeline")
    title = designer.views.timeline.layout.title.text
    assert title.startswith("Simulated timeline: step") and "predicted" not in title
    assert time_scale(2e-4, "s") == (1e6, "µs")
    fig = memory_figure(designer.trace)
    bars, lines = fig.data[0], fig.data[1:]
    assert list(bars.marker.color) == [device_color(int(x[3:])) for x in bars.x]
    assert {t.name: t.line.color for t in lines} == {f"dev{int(x[3:])}": device_color(int(x[3:]))
                                                     for x in bars.x}


def test_compile_problems_point_at_the_row_or_layer_to_change(designer):
    """Issue 59's cases: four stages under a schedule of ranks=2 name the schedule row and
    the ranks to set; a layer set to PP 5, and a stage no row places, mark the layer; a
    deadlock's grid sits under a details toggle, monospace."""
    designer.layers.cut_n.value = 4
    designer.layers.cut()
    for pp in (2, 3):
        designer.directives.op.value = "place"
        designer.directives.add.click()
        row = designer.directives.rows[-1]
        row.widget("filter").value = f"PP={pp}"
        row.widget("devices").value = str(pp)
    (problem,) = designer.problems
    assert (problem.row, problem.op) == (2, "schedule 1f1b")
    assert problem.message == ("ranks=2 orders 2 stages (PP 0-1), but the layers are cut "
                               "into 4 stages (PP 0-3): set ranks=4")
    assert "pn-row-error" in designer.directives.rows[2].box._dom_classes
    designer.directives.rows[2].widget("ranks").value = 4
    assert designer.problems == []

    designer.layers.rows["blocks.3"].pp.value = "5"
    (problem,) = designer.problems
    assert problem.layer == "blocks.3" and problem.message.startswith(
        "PP 5 leaves PP 4 without a layer (the stages are 0, 1, 2, 3, 5)")
    assert "pn-layer-error" in designer.layers.rows["blocks.3"].row._dom_classes
    designer.layers.rows["blocks.3"].pp.value = "3"
    designer.directives.rows[-1].remove.click()              # no row places PP 3 now
    (problem,) = designer.problems
    assert problem.layer in ("blocks.3", "head") and "{'PP': 3}" in problem.message


def test_a_deadlock_grid_is_a_grid_under_details():
    from piper_nb.ui.compute import Problem
    from piper_nb.ui.render import problems_html
    text = problems_html([Problem("deadlock: no device can make progress; set ranks=4\n"
                                  "      dev0   dev1\n  0  r0:F0  r1:F0", stage="compile")])
    head, _, rest = text.partition("<details>")
    assert "set ranks=4" in head and "dev0" not in head
    assert rest.startswith("<summary>details</summary><pre") and "r0:F0  r1:F0" in rest


def test_the_analytic_model_shows_compute_and_a_believable_bubble(designer):
    """Issue 59: under the analytic H100 model every device read "bubble 100%" with no
    visible compute bars (a small model's kernels priced at nothing)."""
    designer.views.cost.value = "analytic"
    trace = designer.trace
    compute = [e.duration for e in trace.events if e.kind in ("F", "B")]
    assert compute and min(compute) > 0.01 * trace.step_time      # bars one can see
    show(designer, "Timeline")
    shares = [int(x) for x in re.findall(r"dev\d+ (\d+)%", designer.views.timeline_info.value)]
    assert len(shares) == 2 and all(0 < s < 60 for s in shares), shares


def test_a_compile_regions_row_picks_its_backend_and_mode():
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    d = Designer(model, model.example_batch(batch_size=4, seed=0), debounce=None,
                 program=[pn.place({}, [0]), pn.compile_regions({}, backend="aot_eager")])
    try:
        assert d.problems == []
        row = d.directives.rows[1]
        assert row.widget("backend").value == "aot_eager" and row.widget("mode").value == "default"
        row.widget("mode").value = "max-autotune"
        assert d.state.rows[1]["mode"] == "max-autotune" and d.problems == []
        assert {i.data.compiled for i in d.plan.devices[0].instrs
                if i.kind in pn.ir.kinds.PASSES} == {"aot_eager:max-autotune"}
        assert 'mode="max-autotune"' in python_code(d.state)
    finally:
        d.close()


def test_a_context_parallel_row_picks_its_load_balance_and_rotation():
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    d = Designer(model, model.example_batch(batch_size=4, seed=0), debounce=None,
                 program=[pn.context_parallel({}, [0, 1])])
    try:
        assert d.problems == [] and d.plan.capture.cp.balance == "zigzag"
        row = d.directives.rows[0]
        assert row.widget("load_balance").value == "zigzag"
        row.widget("load_balance").value = "contiguous"
        assert d.state.rows[0]["load_balance"] == "contiguous" and d.problems == []
        assert d.plan.capture.cp.balance == "contiguous"
        assert 'load_balance="contiguous"' in python_code(d.state)
        assert row.widget("rotate").value == "all_gather"   # the point-to-point ring
        row.widget("rotate").value = "p2p"
        assert d.problems == [] and d.plan.capture.cp.rotate == "p2p"
        assert d.plan.capture.cp.rotations and 'rotate="p2p"' in python_code(d.state)
        row.widget("devices").value = "0,1 | 2,3"   # two groups: nothing runs on the second
        assert d.problems and "context" in " ".join(map(str, d.problems))
    finally:
        d.close()
