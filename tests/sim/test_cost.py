"""Cost models: uniform unit costs and the per-operator analytic model (the measured
profile: tests/profile)."""

from __future__ import annotations

import pytest

import piper_nb as pn
from piper_nb import PlanError
from piper_nb.plan.instr import Instr
from piper_nb.plan.sizes import message_bytes, value_bytes
from piper_nb.sim import CostModel, HardwareSpec


def plan2(microbatches: int = 2):
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = pn.schedules.one_f_one_b(ranks=2, microbatches=microbatches, place=True)
    return pn.compile(spec, program, model.example_batch(batch_size=2 * microbatches, seed=0))


def test_uniform_costs_split_b_into_bi_and_bw_and_overlap_into_fb():
    cost = CostModel.uniform(F=1, B=3, W=1, FB=3.5, comm=0.5, U=2)
    f, b = Instr.of("F", region=0, mb=0), Instr.of("B", region=1, mb=0)
    assert [cost.compute(Instr.of(k, region=0)) for k in ("F", "B", "BI", "BW", "U")] == \
        [1, 3, 2, 1, 2]
    assert cost.overlapped([f, b]) == 3.5
    assert cost.overlapped([f, Instr.of("BI", region=1)]) == 2.5     # FB - W
    assert CostModel.uniform().overlapped([f, b]) == 3           # no FB: F + B
    assert cost.message(None, Instr.of("SEND", peer=1), 0) == 0.5
    with pytest.raises(PlanError, match="W=3 is part of B=2"):
        CostModel.uniform(B=2, W=3)


def test_analytic_costs_sum_each_kernel_of_a_pass_and_price_links():
    """Two stages of Linear(8, 8) -> Tanh -> Linear(8, 8) -> Tanh in fp32: on a GPU whose
    memory and launches are free, each pass costs its matmuls' FLOPs at the fp32 peak
    times the matmul efficiency. Stage 0's input is the batch (no gradient): its backward
    runs three matmuls (both weight gradients, the second layer's input gradient), BI none;
    stage 1's four (B), two (BI, the input gradients) and three (BW: the weights', through
    the second layer's input gradient)."""
    plan = plan2()
    hw = HardwareSpec(name="toy", peak_flops=16e9, fp32_flops=1e9, matmul_efficiency=0.5,
                      hbm_bandwidth=1e30, launch_overhead=0.0,
                      nvlink_bandwidth=1e6, ib_bandwidth=1e5, node_size=1,
                      nvlink_latency=0.0, ib_latency=0.0)
    cost = CostModel.analytic(plan, hw)
    rows = plan.values["inputs"].shape[0]
    mm = 2 * rows * 8 * 8 / 0.5e9           # one Linear(8, 8)'s matmul at 0.5 x fp32 peak
    for region, (f, b, bi, bw) in enumerate([(2, 3, 0, 3), (2, 4, 2, 3)]):
        got = [cost.compute(Instr.of(k, region=region)) for k in ("F", "B", "BI", "BW")]
        assert got == pytest.approx([f * mm, b * mm, bi * mm, bw * mm]), region
    # the optimizer step streams its state: 28 bytes per parameter element
    assert cost.compute(Instr.of("U", region=0)) == pytest.approx(0.0)
    slow = CostModel.analytic(plan, HardwareSpec(name="toy2", peak_flops=16e9, hbm_bandwidth=1e6,
                                                 nvlink_bandwidth=1e6, ib_bandwidth=1e5))
    assert slow.compute(Instr.of("U", region=0)) == pytest.approx(
        2 * (8 * 8 + 8) * 28 / (1e6 * 0.85))
    send = next(i for i in plan[0].instrs if i.kind == "SEND")
    nbytes = message_bytes(plan, send)
    assert nbytes == value_bytes(plan.values[send.data.values[0]])
    # two nodes of one GPU: one network hop (NCCL's base latency, 8.4 us, and the hop's,
    # none here) and the bytes at the network's line rate x its efficiency (0.9)
    assert cost.message(plan, send, 0) == pytest.approx(8.4e-6 + nbytes / (1e5 * 0.9))
    assert CostModel.analytic(plan, "H100").meta["hardware"] == "H100"
    with pytest.raises(PlanError, match="unknown hardware"):
        CostModel.analytic(plan, "TPU9")


def test_a_kernel_costs_its_roofline_and_at_least_a_launch():
    from piper_nb.sim.op_counts import Kind, OpTally
    from piper_nb.sim.roofline import kernel_time
    hw = pn.sim.HARDWARE["H200"]
    big = OpTally(Kind.MATMUL, "bfloat16", 2 * 8192**3, 3 * 2 * 8192**2, 1)
    assert kernel_time(big, hw) == pytest.approx(2 * 8192**3 / (989e12 * 0.8))
    # a matmul of one row is bounded by the bytes of its weight, not its FLOPs
    thin = OpTally(Kind.MATMUL, "bfloat16", 2 * 8192**2, 2 * (8192**2 + 2 * 8192), 1)
    assert kernel_time(thin, hw) == pytest.approx(thin.nbytes / (4.8e12 * 0.85))
    add = OpTally(Kind.MEMORY, "float32", 0, 3 * 4 * 2**24, 1)   # 3 tensors of 16 Mi floats
    assert kernel_time(add, hw) == pytest.approx(add.nbytes / (4.8e12 * 0.85))
    tiny = OpTally(Kind.MEMORY, "float32", 0, 12, 1)
    assert kernel_time(tiny, hw) == hw.launch_overhead
    flash = OpTally(Kind.ATTENTION, "bfloat16", 1e12, 1e6, 1)
    assert kernel_time(flash, hw) == pytest.approx(1e12 / (989e12 * 0.35))


def test_ring_collectives_move_their_share_of_the_bucket():
    cost = CostModel(latency=0.0, bandwidth=100.0)
    plan = pn.compile(*_dp_plan_args())
    ar = next(i for i in plan[0].instrs if i.kind == "ALL_REDUCE")
    n, nbytes = len(ar.data.group), message_bytes(plan, ar)
    assert cost.message(plan, ar, 0) == pytest.approx(2 * (n - 1) / n * nbytes / 100)


def _dp_plan_args():
    model = pn.models.MLP(dim=8, depth=2)
    spec = pn.annotate(model, pn.cut_stages(model, 1))
    return spec, [pn.split({}, "MB", 2), pn.replicate({}, [0, 1, 2, 3])], \
        model.example_batch(batch_size=8, seed=0)


def test_time_slicing_phases_in_from_one_task_a_core_to_two():
    from piper_nb.sim.time_slicing import slicing_slowdown
    assert slicing_slowdown(0.5, 1.2) == slicing_slowdown(1.0, 1.2) == 1.0
    assert slicing_slowdown(1.5, 1.2) == pytest.approx(1.5 * 1.1)
    assert slicing_slowdown(2.0, 1.2) == pytest.approx(2.4)
    assert slicing_slowdown(3.0, 1.2) == pytest.approx(3.6)
    assert slicing_slowdown(3.0, 1.0) == 3.0


def test_jitter_is_each_pass_over_its_own_median_in_quantiles():
    from piper_nb.sim.time_slicing import jitter_quantiles
    samples = {(0, "F"): [1.0, 1.0, 1.0, 5.0], (0, "B"): [2.0, 2.0, 2.0, 2.0],
               (1, "F"): [7.0, 7.0]}                           # too few to have a median
    assert jitter_quantiles(samples, n=8) == (1.0,) * 7 + (5.0,)
    assert jitter_quantiles({}, n=8) == ()




def test_compiled_is_a_setting_that_fuses_the_element_wise_work():
    """The same plan priced compiled costs no more per pass, and less over the step (the
    backward's element-wise kernels between its matmuls fuse); eager is the default."""
    plan = plan2()
    eager, fused = CostModel.analytic(plan, "H100"), CostModel.analytic(plan, "H100",
                                                                          compiled=True)
    assert fused.name == "analytic(H100, compiled)" and eager.name == "analytic(H100)"
    totals = [0.0, 0.0]   # compiled, eager
    for region in (0, 1):
        for kind in ("F", "B", "BI", "BW"):
            got, was = (c.compute(Instr.of(kind, region=region)) for c in (fused, eager))
            assert got <= was, (region, kind)
            totals = [totals[0] + got, totals[1] + was]
    assert totals[0] < totals[1]
