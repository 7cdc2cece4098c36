"""Bad programs fail before anything runs, with a PlanError naming the directive index."""

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import piper_nb as pn


@pytest.fixture(scope="module")
def setup():
    model = pn.models.MLP(dim=8, depth=4)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, {"layers.[0-1]": {"PP": 0}, "layers.[2-3]": {"PP": 1}})
    return spec, batch


P0 = {"op": "place", "filter": {"PP": 0}, "devices": [0]}
P1 = {"op": "place", "filter": {"PP": 1}, "devices": [1]}
SPLIT = {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2}

BAD = {
    "unknown op": ([P0, P1, {"op": "pipeline"}], 2, "unknown op 'pipeline'"),
    "unknown field": ([P0, {**P1, "device": [1]}], 1, "unknown field"),
    "missing devices": ([P0, {"op": "place", "filter": {"PP": 1}}], 1, "missing field 'devices'"),
    "filter not an object": ([P0, {**P1, "filter": [1]}], 1, "must be a"),
    "tag index a string": ([P0, {**P1, "filter": {"PP": "one"}}], 1, "non-negative integer"),
    "bad PASS": ([P0, P1, {"op": "order", "filters": [[{"PASS": "X"}]]}], 2, "PASS must be"),
    "unknown tag matches nothing": ([P0, P1, {"op": "place", "filter": {"TP": 0}, "devices": [0]}],
                                    2, "matches no compute"),
    "filter matches nothing": ([P0, {"op": "place", "filter": {"PP": 7}, "devices": [1]}],
                               1, "matches no compute"),
    "devices not a list": ([P0, {**P1, "devices": "1"}], 1, "devices must be"),
    "negative device": ([P0, {**P1, "devices": [-1]}], 1, "non-negative"),
    "repeated device": ([P0, {**P1, "devices": [1, 1]}], 1, "repeat"),
    "zero out of range": ([P0, P1, {"op": "replicate", "filter": {}, "devices": [0, 1],
                                    "zero": 4}], 2, "zero must be"),
    "microbatches do not divide": ([P0, P1, {**SPLIT, "num_microbatches": 3}], 2, "do not divide"),
    "microbatches not positive": ([P0, P1, {**SPLIT, "num_microbatches": 0}], 2, "positive"),
    "replicas do not divide": ([{"op": "replicate", "filter": {}, "devices": [0, 1, 2]}], 0,
                               "do not divide"),
    "cyclic order": ([P0, P1, SPLIT, {"op": "order", "filters": [
        [{"PP": 0, "MB": 0, "PASS": "B"}], [{"PP": 0, "MB": 0, "PASS": "F"}]]}], 3, "cycle"),
    "order across devices": ([P0, P1, SPLIT, {"op": "order", "filters": [
        [{"PP": 0, "MB": 0, "PASS": "F"}], [{"PP": 1, "MB": 0, "PASS": "F"}]]}], 3,
        "different devices"),
    "unknown schedule": ([P0, P1, {"op": "schedule", "name": "4f4b"}], 2, "unknown schedule|4f4b"),
    "dualpipe odd ranks": ([{"op": "schedule", "name": "dualpipe", "ranks": 3,
                             "microbatches": 6}], 0, "even"),
    "replicate off the placement": ([P0, P1, {"op": "replicate", "filter": {"PP": 0},
                                              "devices": [2, 3]}], 2, "replicated over"),
    "groups of different sizes": ([{**P0, "devices": [0, 1]}, {**P1, "devices": [2]}], None,
                                  "same size|same number"),
    "zero contradicts flags": ([P0, P1, {"op": "replicate", "filter": {}, "devices": [0, 1],
                                         "zero": 1, "shard_params": True}], 2, "contradicts"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_program_raises_plan_error_with_index(setup, name):
    spec, batch = setup
    program, index, message = BAD[name]
    with pytest.raises(pn.PlanError, match=message) as info:
        pn.compile(spec, pn.Program.from_json(json.dumps(program)), batch)
    assert info.value.directive == index
    if index is not None:
        assert str(info.value).startswith(f"directive #{index}")


def test_device_outside_the_world(setup):
    spec, batch = setup
    with pytest.raises(pn.PlanError, match="outside the world") as info:
        pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [5])], batch, world=2)
    assert info.value.directive == 1


def test_compute_never_placed(setup):
    spec, batch = setup
    with pytest.raises(pn.PlanError, match=r"never placed: F\[PP=1\]"):
        pn.compile(spec, [pn.place({"PP": 0}, [0])], batch)


def test_idle_devices(setup):
    spec, batch = setup
    with pytest.raises(pn.PlanError, match=r"devices \[1\] get no work"):
        pn.compile(spec, [pn.place({}, [0]), pn.place({"PP": 1}, [2])], batch)


def test_hand_written_grid_that_deadlocks_prints_the_grid(setup):
    spec, batch = setup
    # rank 1 wants the backward of microbatch 1 before its forward of microbatch 0 arrives
    # from rank 0, which itself waits for rank 1's gradient of microbatch 0: no cycle on one
    # device, but the two devices wait for each other.
    grid = """
    0F0 0B0 0F1 0B1
    1F1 1B1 1F0 1B0
    """
    with pytest.raises(pn.PlanError, match="deadlock") as info:
        pn.compile(spec, pn.schedules.from_grid(grid, place=True), batch)
    text = str(info.value)
    assert "dev0" in text and "dev1" in text and ">" in text and "(>x< marks" in text
    # the user wrote a grid, not order directives: the message names the grid
    assert "the schedule grid (pn.schedules.from_grid)" in text
    assert "reorder them in the grid's rows" in text
    assert "order directive" not in text


def test_a_schedule_placed_against_its_grid_is_named(setup):
    import piper_nb.models
    model = piper_nb.models.MLP(dim=8, depth=8)
    spec = pn.annotate(model, pn.cut_stages(model, 4))
    swapped = [pn.place({"PP": s}, [d]) for s, d in ((0, 0), (1, 1), (2, 0), (3, 1))]
    with pytest.raises(pn.PlanError, match=r"the DualPipeV schedule \(pn.schedules.dualpipev\) "
                                           r"runs 0F2 and then 3F0 on one rank, but they are "
                                           r"placed on devices \[0\] and \[1\]"):
        pn.compile(spec, [*swapped, *pn.schedules.dualpipev(ranks=2, microbatches=4)],
                   model.example_batch(batch_size=8, seed=0))


def test_collective_order_mismatch_is_caught(setup):
    from piper_nb.compiler.checks import check_collective_order
    from piper_nb.plan.instr import Instr
    from piper_nb.plan.plan import DevicePlan, Plan

    a = Instr.of("ALL_REDUCE", "AR[PP=0]#b0", "dp", group=(0, 1), bucket=0, purpose="grad")
    b = Instr.of("ALL_REDUCE", "AR[PP=1]#b1", "dp", group=(0, 1), bucket=1, purpose="grad")
    plan = Plan(world=2, devices=(DevicePlan(0, (a, b)), DevicePlan(1, (b, a))),
                microbatches=1, batch_size=1, loss_scale=1.0)
    with pytest.raises(pn.PlanError, match="devices 0 and 1 .* collective #0 differently"):
        check_collective_order(plan)


TAGS = st.sampled_from(["PP", "MB", "EP", "PASS", "X", 3, ""])
VALUES = st.one_of(st.integers(-2, 4), st.sampled_from(["*", "F", "B", "BW", "zz"]), st.none(),
                   st.lists(st.integers(0, 3), max_size=2))
FILTERS = st.dictionaries(TAGS, VALUES, max_size=3)
DEVICES = st.one_of(st.lists(st.integers(-1, 4), max_size=4), st.integers(0, 3), st.text(max_size=2))
DIRECTIVE = st.one_of(
    st.fixed_dictionaries({"op": st.just("place"), "filter": FILTERS, "devices": DEVICES}),
    st.fixed_dictionaries({"op": st.just("replicate"), "filter": FILTERS, "devices": DEVICES},
                          optional={"zero": st.integers(-1, 4), "shard_grads": st.booleans(),
                                    "bucket_size": st.one_of(st.floats(-1, 2), st.none())}),
    st.fixed_dictionaries({"op": st.just("split"), "filter": FILTERS,
                           "num_microbatches": st.integers(-1, 5)},
                          optional={"dim_name": st.sampled_from(["MB", "PASS", "", 1])}),
    st.fixed_dictionaries({"op": st.just("order"),
                           "filters": st.lists(st.lists(FILTERS, max_size=2), max_size=4)}),
    st.fixed_dictionaries({"op": st.just("shard"), "filter": FILTERS, "devices": DEVICES}),
    st.fixed_dictionaries({"op": st.sampled_from(["schedule", "nope", 3])},
                          optional={"name": st.sampled_from(["1f1b", "dualpipev", "gpipe", "x"]),
                                    "ranks": st.integers(-1, 4),
                                    "microbatches": st.integers(-1, 8)}),
    st.dictionaries(st.text(max_size=3), VALUES, max_size=3),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(DIRECTIVE, max_size=6))
def test_random_json_programs_raise_nothing_but_plan_error(setup, program):
    spec, batch = setup
    try:
        plan = pn.compile(spec, pn.Program.from_json(json.dumps(program)), batch)
    except pn.PlanError:
        return
    assert plan.world >= 1


def test_a_deadlock_through_a_stage_that_comes_back_is_explained_in_model_terms():
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.shared, self.mid = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.shared(self.mid(self.shared(self.inp(x))))

        def loss_fn(self, out, y):
            return F.mse_loss(out, y)

    spec = pn.annotate(Shared(), {"inp": {"PP": 0}, "shared": {"PP": 0}, "mid": {"PP": 1}})
    f = lambda mb, **tags: {**tags, "MB": mb, "PASS": "F"}
    # device 0 runs the second call of microbatch 0 before the first of microbatch 1, which
    # device 1 needs first
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]), pn.split({}, "MB", 2),
               pn.order([[f(0, PP=0, SEG=0)], [f(0, PP=0, SEG=1)], [f(1, PP=0, SEG=0)]]),
               pn.order([[f(1, PP=1)], [f(0, PP=1)]])]
    batch = (torch.randn(4, 4), torch.randn(4, 4))
    with pytest.raises(pn.PlanError, match=r"deadlock.*the order directives #3, #4 put .*"
                                           r"\{PP=0,SEG=1\} runs shared of stage "
                                           r"\{PP=0\} again, after other stages"):
        pn.compile(spec, program, batch)


def test_compile_leaves_the_model_and_the_random_state_as_they_were():
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 4))
    model.loss_fn = lambda out, y: ((out - y) ** 2).mean()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(8, 4), torch.randn(8, 4))
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    spec = pn.annotate(model, {"0": {"PP": 0}, "1": {"PP": 0}, "3": {"PP": 1}})
    pn.compile(spec, pn.schedules.one_f_one_b(2, 2, place=True), batch)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_a_model_with_nothing_to_train_is_refused():
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).requires_grad_(False)
    model.loss_fn = lambda out, y: ((out - y) ** 2).mean()
    spec = pn.annotate(model, {"0": {"PP": 0}, "1": {"PP": 1}})
    with pytest.raises(pn.PlanError, match="nothing to train: all 4 parameters are frozen"):
        pn.compile(spec, pn.schedules.one_f_one_b(2, 2, place=True),
                   (torch.randn(8, 4), torch.randn(8, 4)))
