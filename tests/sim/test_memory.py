"""The memory model: ZeRO's model-state bytes (REFERENCES.md) from the same accounting the
simulator uses, and the timeline of activations and gathered parameters."""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb import PlanError
from piper_nb.sim import CostModel, MemorySettings, simulate, zero_model_states
from piper_nb.sim.memory import MIXED_PRECISION_ADAM, device_model_states

PAPER = {0: lambda n: 16, 1: lambda n: 4 + 12 / n, 2: lambda n: 2 + 14 / n, 3: lambda n: 16 / n}


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_paper_bytes_per_parameter(n, zero):
    psi = 7_500_000_000 // 8 * 8
    assert zero_model_states(psi, n, zero) == pytest.approx(PAPER[zero](n) * psi)


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_paper_bytes_on_every_device_of_a_compiled_plan(n, zero):
    model = pn.models.MLP(dim=8, depth=2)            # 144 parameters, divisible by 4 and 8
    psi = sum(p.numel() for p in model.parameters())
    spec = pn.annotate(model, pn.cut_stages(model, 1))
    plan = pn.compile(spec, [pn.split({}, "MB", 2), pn.replicate({}, list(range(n)), zero=zero)],
                      model.example_batch(batch_size=2 * n, seed=0))
    for d in range(n):
        states = device_model_states(plan, d, MIXED_PRECISION_ADAM)
        assert sum(states.values()) == pytest.approx(PAPER[zero](n) * psi)


def test_optimizer_state_bytes_follow_the_optimizer():
    assert MemorySettings().optim_per_param() == 0                 # plain SGD
    assert MemorySettings(optimizer="momentum").optim_per_param() == 4
    assert MemorySettings(optimizer="adamw").optim_per_param() == 8
    assert MemorySettings(optimizer="adamw", optim_bytes=12).optim_per_param() == 12
    with pytest.raises(PlanError, match="unknown optimizer"):
        MemorySettings(optimizer="lion").optim_per_param()


def test_activations_live_from_f_to_b_and_are_gone_at_the_end(compile_schedule):
    model = pn.models.MLP(dim=8, depth=16)
    plan = compile_schedule(model, pn.schedules.one_f_one_b, 4, 4, 8)
    trace = simulate(plan, CostModel.uniform())
    for d in trace.devices:
        samples = [m for m in trace.memory if m.device == d]
        assert len(samples) == len(plan.devices[d].instrs)     # one per instruction
        assert [m.time for m in samples] == sorted(m.time for m in samples)
        assert samples[-1].activations == 0
        peak = max(m.activations for m in samples)
        assert peak >= plan.saved[d] * trace.live_stashes(d)
        assert trace.peak_memory[d] == max(m.total for m in samples)


def test_gradients_and_optimizer_state_are_counted_while_they_exist():
    model = pn.models.MLP(dim=8, depth=4)
    full = sum(p.numel() * 4 for p in model.parameters())
    spec = pn.annotate(model, pn.cut_stages(model, 1))
    plan = pn.compile(spec, [pn.split({}, "MB", 2), pn.replicate({}, [0, 1], zero=0)],
                      model.example_batch(batch_size=8, seed=0))
    kinds = [i.kind for i in plan.devices[0].instrs]
    for first_step in (False, True):
        settings = MemorySettings(optimizer="adamw", first_step=first_step)
        mem = [m for m in simulate(plan, CostModel.uniform(), memory=settings).memory
               if m.device == 0]
        grads = [m.grads for m in mem]
        assert grads[kinds.index("B") - 1] == 0 and grads[kinds.index("B")] == full
        assert grads[-1] == 0                                   # the update dropped them
        assert mem[-1].optim == 2 * full                        # AdamW: two fp32 states
        assert mem[0].optim == (0 if first_step else 2 * full)  # steady state: held throughout


def test_zero3_gathers_full_parameters_only_around_their_passes():
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 1))
    plan = pn.compile(spec, [pn.split({}, "MB", 2), pn.replicate({}, [0, 1], zero=3)],
                      model.example_batch(batch_size=8, seed=0))
    trace = simulate(plan, CostModel.uniform(comm=0.5))
    full = sum(p.numel() * 4 for p in model.parameters())
    instrs = plan.devices[0].instrs
    params = [m.params for m in trace.memory if m.device == 0]
    assert params[-1] == full // 2                                  # the shard between uses
    for i, ins in enumerate(instrs):
        if ins.kind in ("F", "B"):    # gathered: the shard + the full bucket (+ a prefetch)
            assert params[i] in (full // 2 + full, full // 2 + 2 * full)
    # a gather in flight holds its receive buffer; overlapping gathers share one bucket
    assert max(params) == full // 2 + 2 * full


def test_gpu_allowances_add_a_share_per_device_and_per_communicator():
    from piper_nb.sim.memory import communicators
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
               *pn.schedules.one_f_one_b(2, 4)]
    plan = pn.compile(spec, program, model.example_batch(16, seed=0))
    # device 0: the group (0, 2) and the two directions with device 1
    assert communicators(plan, 0) == 3
    plain = pn.simulate(plan, pn.CostModel.uniform())
    gpu = pn.simulate(plan, pn.CostModel.uniform(),
                      memory=pn.MemorySettings.for_cuda(reserve_bytes=1000, buffer_bytes=10,
                                                        channels=2))
    seen = pn.simulate(plan, pn.CostModel.uniform(),   # what max_memory_allocated sees
                       memory=pn.MemorySettings.for_cuda(reserve_bytes=1000, buffer_bytes=10,
                                                         channels=2, nccl=False))
    for a, b, c in zip(plain.memory, gpu.memory, seen.memory, strict=True):
        assert b.buffers - a.buffers == 1000 + 20 * communicators(plan, a.device)
        assert c.buffers - a.buffers == 1000      # NCCL's own buffers on neither side
        assert (a.params, a.grads, a.activations) == (b.params, b.grads, b.activations)
