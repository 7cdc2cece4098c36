"""Collectives as NCCL runs them over a topology (`sim.collectives`, `sim.topology`), and
compute slowed by the communication it overlaps (`sim.contention`)."""

from __future__ import annotations

import dataclasses

import pytest

import piper_nb as pn
from piper_nb.ir.kinds import COMM, COMPUTE
from piper_nb.sim.collectives import Algorithm, bus_bandwidth, collective_time, p2p_time

H100 = pn.Topology.of("H100")            # 8 GPUs a node, NVLink 450 GB/s, 50 GB/s a GPU
NVLINK = 450e9 * 0.8
NET = 50e9 * 0.9
GB = 1e9


def test_a_large_all_reduce_in_a_node_streams_at_nvlinks_bus_bandwidth():
    big = collective_time("ALL_REDUCE", range(8), 4 * GB, H100)
    assert big.algorithm == Algorithm.RING
    # nccl-tests' definitions: busbw = bytes / time x 2(n-1)/n
    assert big.bus_bandwidth == pytest.approx(NVLINK, rel=0.01)
    assert big.seconds == pytest.approx(2 * 7 / 8 * 4 * GB / NVLINK, rel=0.01)
    gather = collective_time("ALL_GATHER", range(8), 4 * GB, H100)
    assert gather.seconds == pytest.approx(big.seconds / 2, rel=0.01)   # (n-1)/n, not 2(n-1)/n
    scatter = collective_time("REDUCE_SCATTER", range(8), 4 * GB, H100)
    assert scatter.seconds == gather.seconds


def test_the_tree_wins_small_all_reduces_over_many_nodes_and_the_ring_large_ones():
    group = range(128)                   # 16 nodes
    small = collective_time("ALL_REDUCE", group, 4096, H100)
    large = collective_time("ALL_REDUCE", group, 2 * GB, H100)
    assert small.algorithm == Algorithm.TREE and large.algorithm == Algorithm.RING
    # a small buffer pays latency: log-depth beats 2(n-1) hops
    ring_only = min(collective_time("ALL_GATHER", group, 4096, H100).seconds, 1.0)
    assert small.seconds < 2 * ring_only
    # inside one node there is no tree: NCCL's trees cross nodes
    assert collective_time("ALL_REDUCE", range(8), 4096, H100).algorithm == Algorithm.RING


def test_ranks_map_to_nodes_as_torchrun_numbers_them():
    assert H100.node(7) == 0 and H100.node(8) == 1
    assert H100.spread(range(8)) == (1, 8)
    assert H100.spread(range(4, 12)) == (2, 4)
    assert H100.spread(range(0, 256, 8)) == (32, 1)
    # one GPU per node: its own adapter; eight: the node's eight adapters, under NVLink
    assert bus_bandwidth(H100, range(0, 256, 8)) == pytest.approx(NET)
    assert bus_bandwidth(H100, range(4, 12)) == pytest.approx(min(NVLINK, 4 * NET))
    assert bus_bandwidth(H100, range(128)) == pytest.approx(min(NVLINK, 8 * NET))


def test_a_group_that_spans_nodes_is_slower_than_one_inside_a_node():
    inside = collective_time("ALL_REDUCE", range(8), GB, H100).seconds
    spread = collective_time("ALL_REDUCE", range(0, 64, 8), GB, H100).seconds
    assert spread > 5 * inside                       # one adapter each vs NVLink
    assert spread == pytest.approx(2 * 7 / 8 * GB / NET, rel=0.05)
    two_nodes = pn.Topology.of("H100", gpus_per_node=4)
    assert collective_time("ALL_REDUCE", range(8), GB, two_nodes).seconds > inside


def test_all_to_all_and_point_to_point_use_the_link_between_the_pair():
    a2a = collective_time("ALL_TO_ALL", range(8), GB, H100)
    assert a2a.seconds == pytest.approx(7 / 8 * GB / NVLINK, rel=0.01)
    across = collective_time("ALL_TO_ALL", range(16), GB, H100)
    assert across.seconds == pytest.approx(8 / 16 * GB / NET, rel=0.01)   # half leave the node
    assert p2p_time(0, 7, GB, H100) == pytest.approx(GB / NVLINK, rel=0.01)
    assert p2p_time(7, 8, GB, H100) == pytest.approx(GB / NET, rel=0.01)


def test_the_topology_states_defaults_and_refuses_nonsense():
    assert H100.gpus_per_node == 8 and H100.network_bandwidth == 50e9
    assert pn.Topology.of("A100").network_bandwidth == 25e9
    assert pn.Topology.of("H100", contention=0.0).contention == 0.0
    with pytest.raises(pn.PlanError, match="unknown field"):
        pn.Topology.of("H100", nics=8)
    with pytest.raises(pn.PlanError, match="gpus_per_node=0"):
        pn.Topology.of("H100", gpus_per_node=0)
    with pytest.raises(pn.PlanError, match="network_efficiency=1.5 must be in"):
        pn.Topology.of("H100", network_efficiency=1.5)
    with pytest.raises(pn.PlanError, match="contention"):
        pn.Topology.of("H100", contention=-0.1)


def dp_plan(devices=(0, 1), dim=256, batch=8):
    """An MLP replicated over `devices` in four microbatches: gradients reduced in buckets
    while later backwards run."""
    model = pn.models.MLP(dim=dim, depth=4)
    spec = pn.annotate(model, {f"layers.{i}": {"L": i} for i in range(4)})
    program = [pn.place({}, list(devices)), pn.replicate({}, list(devices)),
               pn.split({}, "MB", 4)]
    return pn.compile(spec, program, model.example_batch(batch_size=batch, seed=0))


def test_the_cost_model_prices_messages_over_its_topology():
    plan = dp_plan((0, 1))
    same_node = pn.CostModel.analytic(plan, "H100")
    apart = pn.CostModel.analytic(plan, "H100", topology=pn.Topology.of("H100", gpus_per_node=1))
    reduce = next(i for i in plan[0].instrs if i.kind == "ALL_REDUCE")
    assert apart.message(plan, reduce, 0) > same_node.message(plan, reduce, 0)
    assert same_node.meta["topology"] == "H100" and same_node.contention == 0.19
    with pytest.raises(pn.PlanError, match="topology is a pn.Topology"):
        pn.CostModel.analytic(plan, "H100", topology={"gpus_per_node": 8})


def test_compute_beside_communication_runs_slower_by_the_contention():
    """Each pass takes its work plus c / (1 + c) of the time communication overlapped it
    (it advances at 1 / (1 + c) meanwhile); none overlapped: as without contention."""
    plan = dp_plan((0, 1), dim=2048, batch=8192)   # each reduction overlaps a backward
    cost = pn.CostModel.analytic(plan, "H100")
    free = pn.simulate(plan, dataclasses.replace(cost, contention=0.0))
    slowed = pn.simulate(plan, cost)
    c = cost.contention
    overlapped = 0
    for d in (0, 1):
        comm = [(e.start, e.end) for e in slowed.events
                if e.device == d and e.kind in COMM and e.end > e.start]
        for e in slowed.events:
            if e.device != d or e.kind not in COMPUTE:
                continue
            o = sum(max(0.0, min(e.end, b) - max(e.start, a)) for a, b in comm)
            work = cost.compute(next(i for i in plan[d].instrs if str(i) == e.label))
            assert e.duration == pytest.approx(work + o * c / (1 + c), rel=0.02, abs=1e-9)
            overlapped += o > 0
    assert overlapped > 0
    assert slowed.step_time > free.step_time
    # one device, nothing to overlap: contention changes nothing
    alone = dp_plan((0,))
    one = pn.CostModel.analytic(alone, "H100")
    assert pn.simulate(alone, one).step_time == \
        pn.simulate(alone, dataclasses.replace(one, contention=0.0)).step_time
