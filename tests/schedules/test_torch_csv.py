"""PyTorch pipelining's schedule CSV in and out, checked against torch's own functions.

torch's builders make a schedule's `pipeline_order` from stage objects of which they read
only `num_stages`, `group_size` and `group_rank`, so stand-ins build them here without a
process group. `_dump_csv` writes what they built; `_PipelineScheduleRuntime._load_csv`
reads our CSV back, validates it and lowers it to communication as torch runs it.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import piper_nb as pn
from piper_nb.schedules import (
    from_grid,
    from_torch_csv,
    grid_to_torch_csv,
    interleaved_1f1b_grid,
    parse_torch_csv,
)

S = pytest.importorskip("torch.distributed.pipelining.schedules")


def stage(index: int, stages: int, ranks: int) -> SimpleNamespace:
    return SimpleNamespace(stage_index=index, num_stages=stages, group_size=ranks, group_rank=0,
                           submod=torch.nn.Linear(1, 1))


# name -> (builder on rank 0's stages, stages, microbatches); 2 ranks each
BUILDERS = {
    "interleaved_1f1b": (lambda: S.ScheduleInterleaved1F1B([stage(0, 4, 2), stage(2, 4, 2)], 4), 4, 4),
    "one_stage_1f1b": (lambda: S.ScheduleInterleaved1F1B([stage(0, 2, 2)], 4), 2, 4),
    "interleaved_zero_bubble": (
        lambda: S.ScheduleInterleavedZeroBubble([stage(0, 4, 2), stage(2, 4, 2)], 4), 4, 4),
    "zbv_zero_bubble": (lambda: S.ScheduleZBVZeroBubble([stage(0, 4, 2), stage(3, 4, 2)], 4), 4, 4),
    "dualpipev": (lambda: S.ScheduleDualPipeV([stage(0, 4, 2), stage(3, 4, 2)], 6), 4, 6),
    "looped_bfs": (lambda: S.ScheduleLoopedBFS([stage(0, 4, 2), stage(2, 4, 2)], 4), 4, 4),
}


def torch_dump(name: str, tmp_path: Path, form: str = "compute_only") -> tuple[object, Path]:
    schedule = BUILDERS[name][0]()
    path = tmp_path / f"{name}.{form}.csv"
    schedule._dump_csv(str(path), form)
    return schedule, path


def torch_load(text: str, tmp_path: Path, stages: int, microbatches: int) -> dict:
    """torch's `_load_csv` on `text`: its validation and its lowering to send/recv run."""
    path = tmp_path / "ours.csv"
    path.write_text(text)
    runtime = S._PipelineScheduleRuntime([stage(0, stages, 2)], microbatches)
    runtime._load_csv(str(path))
    assert runtime.pipeline_order_with_comms   # lowered to communication as torch runs it
    return runtime.pipeline_order


def compute(order: dict) -> dict[int, list[str]]:
    return {r: [str(a) for a in row if a is not None and a.is_compute_op] for r, row in order.items()}


def mlp(stages: int):
    model = pn.models.MLP(dim=8, depth=stages)
    return model, pn.annotate(model, pn.cut_stages(model, stages)), model.example_batch(12)


@pytest.mark.parametrize("name", BUILDERS)
def test_torch_dump_reads_writes_and_loads_back_in_torch_unchanged(name, tmp_path):
    schedule, path = torch_dump(name, tmp_path)
    dumped = path.read_text().replace("\r\n", "\n")
    ours = grid_to_torch_csv(parse_torch_csv(path))
    assert ours == dumped                      # idle steps kept, overlapped pairs spelled alike
    _, stages, m = BUILDERS[name]
    assert torch_load(ours, tmp_path, stages, m) == schedule.pipeline_order


@pytest.mark.parametrize("name", ["zbv_zero_bubble", "dualpipev", "interleaved_1f1b"])
def test_communication_and_reshard_cells_are_skipped(name, tmp_path):
    _, compute_only = torch_dump(name, tmp_path)
    _, with_comms = torch_dump(name, tmp_path, "compute_comms")
    assert "SEND_F" in with_comms.read_text() and "REDUCE_GRAD" in with_comms.read_text()
    assert from_torch_csv(with_comms, place=True) == from_torch_csv(compute_only, place=True)


def test_a_torch_csv_gives_the_directives_of_the_equal_text_grid(tmp_path):
    _, path = torch_dump("interleaved_1f1b", tmp_path)
    assert from_torch_csv(path.read_text()) == from_grid(interleaved_1f1b_grid(2, 4, 2))
    assert from_torch_csv(path, place=True) == from_grid(interleaved_1f1b_grid(2, 4, 2), place=True)


@pytest.mark.parametrize("name", ["zbv_zero_bubble", "dualpipev", "one_stage_1f1b"])
def test_a_compiled_plan_writes_the_schedule_torch_gave_it(name, tmp_path):
    schedule, path = torch_dump(name, tmp_path)
    _, stages, m = BUILDERS[name]
    _, spec, batch = mlp(stages)
    plan = pn.compile(spec, from_torch_csv(path, place=True), batch)
    assert compute(torch_load(plan.to_torch_csv(), tmp_path, stages, m)) == compute(
        schedule.pipeline_order)


def test_a_plan_with_data_parallel_replicas_writes_a_row_per_device():
    _, spec, batch = mlp(2)
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
               *pn.schedules.one_f_one_b(2, 2)]
    plan = pn.compile(spec, program, batch)
    rows = plan.to_torch_csv().splitlines()
    assert rows[0] == rows[2] == "0F0,0F1,0B0,0B1" and rows[1] == rows[3] == "1F0,1B0,1F1,1B1"
    assert plan.to_torch_csv(devices=[2, 3]) == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"


def test_grids_write_as_torch_csv():
    assert grid_to_torch_csv("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1") == "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n"
    assert grid_to_torch_csv(pn.schedules.dualpipev_grid(1, 2)).splitlines()[0].startswith("0F0,")


@pytest.mark.parametrize("text, match", [
    ("0F0,0B0\n1F0,1X0,1B0", r"rank 1 \(line 2\) column 1: cannot read schedule action '1X0'"),
    ("0F0,(0B0;1SEND_F0)OVERLAP_F_B", r"rank 0 \(line 1\) column 1: .* action '1SEND_F0'"),
    ("0F0,,0B0\n1F0,,,1B0,1F1", r"rank 1 slot 4: 1F1 has no backward"),
    ("0F0,,0RECV_B0,0B0\n,1B0,,1F0", r"rank 1 slot 1: 1B0 comes before 1F0 \(slot 3\)"),
    ("0F0,0B0\n\n1F0,1B0", r"rank 1 has no actions"),   # a blank line is an idle rank
    ("", r"it is empty"),
])
def test_bad_csv_names_the_rank_and_column(text, match):
    with pytest.raises(pn.PlanError, match=match) as e:
        from_torch_csv(text)
    assert "torch schedule CSV" in str(e.value)


def test_trailing_blank_lines_and_padding_are_no_ranks():
    assert from_torch_csv(" 0F0 ,, 0B0,\n\n") == from_grid("0F0 0B0")


def test_microbatches_must_match_the_csv():
    with pytest.raises(pn.PlanError, match=r"microbatches=3 but the grid runs microbatches 0..0"):
        from_torch_csv("0F0,0B0", microbatches=3)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["one_stage_1f1b", "zbv_zero_bubble"])
def test_a_schedule_written_by_pytorch_trains_like_one_process(name, cluster2, one_thread, tmp_path):
    """torch's 1F1B on 2 ranks and 4 microbatches (its runtime's builder, one stage per
    rank), and its ZB-V with I/W: loaded from its CSV, trained, equal to the reference."""
    _, path = torch_dump(name, tmp_path)
    model, spec, batch = mlp(BUILDERS[name][1])
    plan = pn.compile(spec, from_torch_csv(path, place=True), batch)
    assert plan.microbatches == 4
    opt = pn.optim.SGD(0.05, momentum=0.9)
    result = pn.train(plan, batch, 2, opt, cluster=cluster2)
    ref = pn.reference_train(model, batch, 2, plan.microbatches, opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=4e-5)
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=4e-5)
    assert any(not torch.equal(v, got[k]) for k, v in model.state_dict().items())


def test_gpipe_of_a_single_stage_schedule_reads_without_its_reduce_grad(tmp_path):
    """Single-stage schedules have no `_dump_csv`; the multi-stage one writes their order."""
    order = S.ScheduleGPipe(stage(0, 2, 2), 4).pipeline_order
    path = tmp_path / "gpipe.csv"
    S.PipelineScheduleMulti._dump_csv(SimpleNamespace(pipeline_order=order), str(path))
    assert "REDUCE_GRAD" in path.read_text()
    assert from_torch_csv(path) == pn.schedules.gpipe(2, 4)
