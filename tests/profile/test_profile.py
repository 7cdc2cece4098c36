"""The profiled cost model: passes timed on an in-process worker, gloo links and
time-slicing measured by processes (`piper_nb.profile`), reached as `CostModel.profile`."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import piper_nb as pn
import piper_nb.profile.cost_model as prof
from piper_nb.plan.instr import Collective
from piper_nb.plan.sizes import message_bytes
from piper_nb.profile import CostModel, simulate
from piper_nb.profile import links as link_profile


def plan2(microbatches: int = 2):
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = pn.schedules.one_f_one_b(ranks=2, microbatches=microbatches, place=True)
    return pn.compile(spec, program, model.example_batch(batch_size=2 * microbatches, seed=0))


def _dp_plan_args():
    model = pn.models.MLP(dim=8, depth=2)
    spec = pn.annotate(model, pn.cut_stages(model, 1))
    return spec, [pn.split({}, "MB", 2), pn.replicate({}, [0, 1, 2, 3])], \
        model.example_batch(batch_size=8, seed=0)


def test_a_profiled_cost_model_times_every_pass_and_fits_the_link():
    plan = plan2()
    grads = [p.grad for p in plan.capture.model.parameters()]
    cost = CostModel.profile(plan, repeats=2, optimizer=pn.optim.AdamW(1e-3))
    assert cost.unit == "s" and cost.name == "profiled"
    for r in range(len(plan.regions)):
        assert all(cost.passes[(r, p)] >= 0 for p in ("F", "B", "BI", "BW", "U"))
        assert cost.passes[(r, "F")] > 0 and cost.passes[(r, "U")] > 0
    assert cost.latency >= 0 and cost.bandwidth > 0 and not math.isnan(cost.bandwidth)
    assert cost.links[("p2p", 2)] == (cost.latency, cost.bandwidth)
    assert {"SEND", "RECV", "WAIT"} <= set(cost.host.issue)
    assert all(lat >= 0 and bw > 0 for lat, bw in cost.host.issue.values())
    send = next(i for dp in plan.devices for i in dp.instrs if i.kind == "SEND")
    lat, bw = cost.host.issue["SEND"]    # gloo writes the message into its socket in the call
    assert cost.host.issue_time(plan, send) == pytest.approx(lat + message_bytes(plan, send) / bw)
    assert cost.host.sync and cost.host.cores >= 1 and cost.host.background >= 0
    assert set(cost.host.overhead) == {0, 1} and all(0 < v < 0.1 for v in cost.host.overhead.values())
    assert [p.grad for p in plan.capture.model.parameters()] == grads   # the model untouched
    trace = simulate(plan)                      # the default cost model is the profiled one
    assert trace.unit == "s" and trace.step_time > 0
    assert trace.meta["host_end"] >= max(e.end for e in trace.events)


def test_a_profile_without_links_runs_in_process():
    cost = CostModel.profile(plan2(), repeats=1, comm=False)
    assert cost.links == {} and cost.host.issue == {} and cost.bandwidth == math.inf


def test_a_profile_counts_the_cores_this_process_may_use(monkeypatch):
    import piper_nb.host as host
    monkeypatch.setattr(host, "usable_cores", lambda: [4, 5, 6])   # e.g. a cgroup's cpuset
    assert CostModel.profile(plan2(), repeats=1, comm=False).host.cores == 3


@pytest.mark.full
def test_links_get_more_repeats_when_processes_outnumber_cores(monkeypatch):
    asked = []

    def links(world, groups, repeats=21, timeout=180.0, largest=0, kinds=()):
        asked.append((world, repeats))
        return {("p2p", 2): (1e-4, 1e9), **{(k, g): (1e-4, 1e9) for k in link_profile._KINDS
                                             for g in groups}}
    monkeypatch.setattr(prof, "profile_links", links)
    spec, program, batch = _dp_plan_args()
    plan = pn.compile(spec, program, batch)               # 4 devices
    for cores, repeats in ((4, 21), (2, 42), (1, 84)):
        CostModel.profile(plan, repeats=1, cores=cores)
        assert asked[-1] == (4, repeats)


def test_links_fit_their_medians_plus_the_stalls_pooled_over_all_sizes():
    from piper_nb.profile.links import fit_links
    line = [(s, 1e-4 + s / 1e9) for s in (1 << 10, 1 << 20, 1 << 22)]   # 100 us + 1 GB/s
    stalls = [0.0, 3e-4, 0.0]     # one size's repeats caught a stall: it is spread over all
    raw = {"p2p/2": [(s, t + x, t) for (s, t), x in zip(line, stalls, strict=True)],
           "issue/SEND": [(s, t, t) for s, t in line],
           "issue/WAIT": [2e-6, 3e-6, 2e-6, 4e-3, 2e-6]}   # one WAIT met an undelivered message
    fitted = fit_links(raw)
    lat, bw = fitted[("p2p", 2)]
    smallest = line[0][1]
    assert lat == pytest.approx(smallest + 1e-4) and bw == pytest.approx(1e9)
    assert fitted[("issue", "SEND")] == (pytest.approx(smallest), pytest.approx(1e9))
    assert fitted[("issue", "WAIT")] == (2e-6, math.inf)   # the call's own cost: the median


def test_a_profile_times_expert_regions_whose_token_counts_follow_the_routing():
    from piper_nb.strategies import moe_annotation
    model = pn.models.TinyMoE(layers=2, experts=2, top_k=1)
    program = [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]), pn.split({}, "MB", 2)]
    plan = pn.compile(pn.annotate(model, moe_annotation(2, 2, 1)), program,
                      model.example_batch(batch_size=8, seed=0))
    cost = CostModel.profile(plan, repeats=1, comm=False)   # output gradients shaped as made
    regions = {i.region for dp in plan.devices for i in dp.instrs if i.kind == "B"}
    assert all(cost.passes[(r, "B")] > 0 for r in regions)


def test_token_exchanges_get_an_all_to_all_fit_of_their_own(monkeypatch):
    from piper_nb.strategies import moe_annotation
    asked = []

    def links(world, groups, repeats=21, timeout=180.0, largest=0, kinds=()):
        asked.append(kinds)
        return {("p2p", 2): (1e-4, 1e9), **{(k, g): (1e-4, 1e9) for k in (*link_profile._KINDS, *kinds)
                                             for g in groups}}
    monkeypatch.setattr(prof, "profile_links", links)
    CostModel.profile(plan2(), repeats=1)
    model = pn.models.TinyMoE(layers=2, experts=2, top_k=1)
    program = [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]), pn.split({}, "MB", 2)]
    moe = pn.compile(pn.annotate(model, moe_annotation(2, 2, 1)), program,
                     model.example_batch(batch_size=8, seed=0))
    cost = CostModel.profile(moe, repeats=1)
    assert asked == [(), ("ALL_TO_ALL",)] and ("ALL_TO_ALL", 2) in cost.links


@pytest.mark.full
def test_time_slicing_is_measured_with_a_process_per_device_when_they_outnumber_cores():
    import warnings

    from piper_nb.profile.time_slicing import profile_slicing
    plan = plan2()
    assert profile_slicing(plan, cores=2) == (1.0, ())        # a core each: nothing to pay
    with warnings.catch_warnings():
        warnings.simplefilter("error")                         # a failed measurement warns
        factor, jitter = profile_slicing(plan, rounds=3, cores=1)   # two share a core
    assert 1.0 <= factor < 3.0
    assert len(jitter) == 64 and list(jitter) == sorted(jitter)   # a pass over its median:
    assert jitter[0] <= 1.0 <= jitter[-1]                      # about 1, now and then more
    with pytest.warns(UserWarning, match="time-slicing profile failed .*in time"):
        assert profile_slicing(plan, cores=1, timeout=0.01) == (1.0, ())  # none ready so soon


def test_links_are_timed_up_to_the_plans_largest_message_and_fitted_on_the_large_ones():
    from piper_nb.profile.links import _fit, link_sizes
    assert link_sizes() == (1 << 10, 1 << 14, 1 << 17, 1 << 20)
    assert link_sizes(5 << 20)[-2:] == (4 << 20, 16 << 20)
    assert link_sizes(1 << 40)[-1] == 1 << 26                      # capped at 64 MiB
    # 1 ms latency, 1 GB/s; the small sizes' noise (a 3 ms stall at 16 KiB) is ignored
    points = [(s, 1e-3 + s / 1e9) for s in link_sizes(16 << 20)]
    points[1] = (points[1][0], 4e-3)
    lat, bw = _fit(points)
    assert lat == pytest.approx(1e-3, rel=0.01) and bw == pytest.approx(1e9, rel=0.01)


def test_a_profile_times_full_and_split_backwards_where_the_plan_runs_both():
    model = pn.models.TinyGPT(vocab=32, dim=16, layers=4, heads=2, seq=8)
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 4)),
                      pn.schedules.dualpipev(ranks=2, microbatches=4, place=True), batch)
    kinds = {(i.region, i.kind) for dp in plan.devices for i in dp.instrs}
    both = {r for r, k in kinds if k == "B" and (r, "BI") in kinds}
    assert both   # DualPipeV splits some of a region's backwards and not others
    cost = CostModel.profile(plan, repeats=1, comm=False)
    for r in both:
        assert {(r, "B"), (r, "BI"), (r, "BW")} <= set(cost.passes)


def test_a_profile_times_the_hosts_packing_around_each_buckets_collectives():
    from piper_nb.profile.passes import profile_packing
    plan = pn.compile(*_dp_plan_args())
    kinds = {(i.kind, i.bucket) for dp in plan.devices for i in dp.instrs
             if isinstance(i.data, Collective)}
    packing = profile_packing(plan, repeats=2)
    assert set(packing) == kinds and kinds
    assert all(before > 0 and after > 0 for before, after in packing.values())
    zero3 = pn.compile(_dp_plan_args()[0], [pn.split({}, "MB", 2),
                                            pn.replicate({}, [0, 1], zero=3)],
                       _dp_plan_args()[2])
    assert set(profile_packing(zero3, repeats=2)) == {("ALL_GATHER", 0), ("REDUCE_SCATTER", 0)}
    assert CostModel.profile(zero3, repeats=1, comm=False).host.packing.keys() == \
        {("ALL_GATHER", 0), ("REDUCE_SCATTER", 0)}


def test_a_profiled_update_steps_on_gradients_like_trainings_not_zeros():
    # all-zero gradients keep AdamW's second moments at zero, a slow path training never takes
    seen = []

    class Spy(torch.optim.AdamW):
        def step(self, closure=None):
            seen.extend(p.grad.abs().max().item() for g in self.param_groups
                        for p in g["params"])
            return super().step(closure)
    plan = pn.compile(*_dp_plan_args())
    CostModel.profile(plan, repeats=1, comm=False, optimizer=functools.partial(Spy, lr=1e-3))
    assert seen and all(0 < g < 1e-1 for g in seen)
