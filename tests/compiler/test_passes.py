"""The declared passes: three phases (capture, DAG, plan) run by one runner, one
signature, every DAG pass named in the DAG's history, and no directive dropped silently
(the experiment that once passed every test: a directive registered but never applied;
and tensor parallelism, whose sharding once ran outside every declared list)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

import piper_nb as pn
from piper_nb.capture.batch import Batch
from piper_nb.compiler import passes
from piper_nb.compiler.compile import _shapes
from piper_nb.compiler.passes import DAG, PHASES, PIPELINE, Pass, Phase, run_phase
from piper_nb.directives.base import Context, Directive
from piper_nb.directives.spec import REGISTRY, Place, Schedule, directive_from_json
from piper_nb.errors import InternalError


@dataclass(frozen=True)
class NoOp(Directive):
    """A directive whose module exists and is registered, but that no pass applies."""

    op: ClassVar[str] = "noop"
    filter: Any = None


def _model():
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, {"layers.[0-1]": {"PP": 0}, "layers.[2-3]": {"PP": 1}})
    return spec, model.example_batch(batch_size=8, seed=0)


def test_a_registered_directive_no_pass_applies_is_an_internal_error(monkeypatch):
    monkeypatch.setitem(REGISTRY, "noop", NoOp)
    spec, batch = _model()
    program = pn.Program([*pn.schedules.one_f_one_b(2, 2, place=True), {"op": "noop"}])
    assert isinstance(program[-1], NoOp)      # the registry reads it like any other op
    last = len(program) - 1
    with pytest.raises(InternalError, match=rf"directive #{last} \(noop, NoOp\) was consumed by no"):
        pn.compile(spec, program, batch)


def test_every_registered_directive_is_consumed_by_a_pass():
    consumed = {cls for ph in PHASES for p in ph.passes for cls in p.consumes}
    for op, cls in REGISTRY.items():
        if cls is Schedule:    # a schedule builder expands into the others before the passes
            continue
        assert cls in consumed, f"{op}: no pass of a phase of compiler.passes applies it"


def test_without_its_sharding_pass_a_tensor_parallel_program_is_consumed_by_no_pass(
        monkeypatch):
    """Tensor parallelism's capture pass is what applies the directive: take it out of its
    phase and the compile says so, instead of training every device on the whole model."""
    model = pn.models.TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    spec, batch = pn.annotate(model, {"": {"PP": 0}}), model.example_batch(4, seed=0)
    program = [pn.tensor_parallel({}, [0, 1])]
    assert pn.compile(spec, program, batch).tp_params     # with the pass: sharded
    without = Phase("capture", tuple(p for p in passes.CAPTURE.passes
                                     if p.name != "tensor-parallel sharding"))
    monkeypatch.setattr(passes, "CAPTURE", without)
    monkeypatch.setattr("piper_nb.compiler.compile.CAPTURE", without)
    with pytest.raises(InternalError, match=r"directive #0 \(tensor_parallel, TensorParallel\) "
                                            r"was consumed by no pass"):
        pn.compile(spec, program, batch)


def test_the_phases_run_in_order_and_every_pass_has_a_name():
    assert [ph.name for ph in PHASES] == ["capture", "DAG", "plan"]
    assert PIPELINE is DAG.passes
    names = [p.name for ph in PHASES for p in ph.passes]
    assert len(names) == len(set(names))
    assert [p.name for p in passes.PLAN.passes][0] == "lower"


def test_the_history_names_every_pass_in_order():
    spec, batch = _model()
    plan = pn.compile(spec, [*pn.schedules.one_f_one_b(2, 4, place=True)], batch)
    names = [entry.split(":")[0] for entry in plan.dag.history]
    assert names == [p.name for p in PIPELINE]
    assert "split: MB=4" in plan.dag.history and "place: 2 directives" in plan.dag.history


def test_a_pass_is_handed_only_its_kinds_with_their_program_index():
    spec, batch = _model()
    seen = []

    def spy(dag, directives, ctx):
        seen.append([(i, d.op) for i, d in directives])
        return dag

    program = [pn.place({"PP": 0}, [0]), pn.split({}, num=2), pn.place({"PP": 1}, [1])]
    phase = Phase("DAG", (*PIPELINE[:1], Pass("spy", spy, reads=(Place,)), *PIPELINE[1:]),
                  history=True)
    named = Batch.of(batch)
    capture = spec.capture(None, named)
    values = _shapes(capture, [], named, 4)["values"]
    dag = run_phase(phase, None, tuple(enumerate(program)), Context(capture, values), set())
    assert seen == [[(0, "place"), (2, "place")]]
    assert dag.history[1] == "spy"


def test_directive_order_in_the_program_does_not_change_the_plan():
    spec, batch = _model()
    program = [*pn.schedules.one_f_one_b(2, 4, place=True)]
    a = pn.compile(spec, program, batch)
    b = pn.compile(spec, list(reversed(program)), batch)
    assert a.devices == b.devices


def test_a_pass_error_names_the_directive_that_caused_it():
    spec, batch = _model()
    with pytest.raises(pn.PlanError, match=r"directive #2 \(split\)"):
        pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                          directive_from_json({"op": "split", "filter": {"PP": 0},
                                               "dim_name": "MB", "num_microbatches": 2})],
                   batch)


def test_an_error_of_a_pass_that_took_one_directive_names_that_row():
    """A pass raising without an index (the tensor-parallel collectives' placement check)
    is attributed to the one directive it was handed, so the Designer marks that row."""
    model = pn.models.TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    spec = pn.annotate(model, {"": {"PP": 0}})
    batch = model.example_batch(batch_size=4, seed=0)
    with pytest.raises(pn.PlanError, match=r"^directive #1 \(tensor_parallel\): .*a member of "
                                           r"the tensor-parallel group") as err:
        pn.compile(spec, [pn.place({}, [1]), pn.tensor_parallel({}, [0, 1]),
                          pn.split({}, "MB", 2)], batch)
    assert err.value.directive == 1
