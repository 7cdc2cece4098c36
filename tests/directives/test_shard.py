"""`shard`: experts spread over a device group, ALL_TO_ALL on the edges around them."""

import pytest
import torch

import piper_nb as pn
from piper_nb.ir.kinds import Op
from piper_nb.strategies import moe_annotation


def moe(layers=2, experts=2, stages=2):
    model = pn.models.TinyMoE(layers=layers, experts=experts)
    return model, pn.annotate(model, moe_annotation(layers, experts, stages))


def pp2_dp2_ep2(mb=4, zero=0, stream=None):
    """PP0 on [0, 2], PP1 on [1, 3], both replicated, each stage's experts sharded."""
    return [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
            pn.replicate({"PP": 0}, [0, 2], zero=zero), pn.replicate({"PP": 1}, [1, 3], zero=zero),
            pn.shard({"PP": 0, "EP": "*"}, [0, 2], stream=stream),
            pn.shard({"PP": 1, "EP": "*"}, [1, 3], stream=stream),
            pn.split({}, "MB", mb)]


@pytest.fixture(scope="module")
def moe2():
    model, spec = moe()
    return model, spec, model.example_batch(batch_size=8, seed=0)


def a2a(plan, device):
    return [(str(i), i.node) for i in plan[device].instrs if i.kind == "ALL_TO_ALL"]


def test_pp2_dp2_ep2_compiles_with_all_to_all_on_every_device(moe2):
    _, spec, batch = moe2
    plan = pn.compile(spec, pp2_dp2_ep2(), batch)  # runs matching, collective order, dry run
    assert plan.world == 4
    for dev, stage in ((0, 0), (2, 0), (1, 1), (3, 1)):
        seq = a2a(plan, dev)
        assert [n for _, n in seq[:8]] == [
            x for m in range(4) for x in (f"ALL_TO_ALL[PP={stage},MB={m}]#dispatch",
                                          f"ALL_TO_ALL[PP={stage},SEG=1,MB={m}]#combine")]
        assert [n for _, n in seq[8:]] == [
            x for m in range(4) for x in (f"ALL_TO_ALL[PP={stage},SEG=1,MB={m}]#dispatch.grad",
                                          f"ALL_TO_ALL[PP={stage},MB={m}]#combine.grad")]
        a, c = 4 * stage, 4 * stage + 3          # the router side and the combine side
        assert [s for s, _ in seq] == (
            [x for m in range(4) for x in (f"r{a}:DISPATCH_F{m}", f"r{c}:COMBINE_F{m}")]
            + [x for m in range(4) for x in (f"r{c}:DISPATCH_B{m}", f"r{a}:COMBINE_B{m}")])
    # each replica runs its stage, only its own expert, and the all-to-all around it
    assert plan[0].text()[:6] == ["r0:F0", "r0:DISPATCH_F0", "r1:F0", "r3:COMBINE_F0", "r3:F0",
                                  "r3:SEND_F0>1"]
    assert plan[2].text()[:6] == ["r0:F0", "r0:DISPATCH_F0", "r2:F0", "r3:COMBINE_F0", "r3:F0",
                                  "r3:SEND_F0>3"]
    assert plan[1].text()[:7] == ["r4:RECV_F0<0", "r4:F0", "r4:DISPATCH_F0", "r5:F0",
                                  "r7:COMBINE_F0", "r4:RECV_F1<0", "r7:F0"]
    assert plan[3].text()[:7] == ["r4:RECV_F0<2", "r4:F0", "r4:DISPATCH_F0", "r6:F0",
                                  "r7:COMBINE_F0", "r4:RECV_F1<2", "r7:F0"]
    assert plan[0].text()[-3:] == ["r0:U", "r1:U", "r3:U"]
    assert plan[3].text()[-4:] == ["b1:AR", "r4:U", "r6:U", "r7:U"]


def test_experts_run_on_one_device_each_and_are_not_replicated(moe2):
    _, spec, batch = moe2
    plan = pn.compile(spec, pp2_dp2_ep2(), batch)
    owner = {"PP=0,EP=0": (0,), "PP=0,EP=1": (2,), "PP=1,EP=0": (1,), "PP=1,EP=1": (3,)}
    for n in plan.dag.nodes:
        if n.op in (Op.F, Op.B, Op.U) and n.tag("EP") is not None:
            assert n.devices == owner[plan.regions[n.region].name], n.id
    expert_params = {p for r in plan.regions if "EP" in dict(r.tags) for p in r.params}
    assert expert_params and not expert_params & {p for b in plan.buckets for p in b.params}
    # the surrounding regions stay data parallel
    assert sorted(b.group for b in plan.buckets) == [(0, 2), (1, 3), (1, 3)]


def test_all_to_all_nodes_carry_values_owners_and_token_counts(moe2):
    _, spec, batch = moe2
    plan = pn.compile(spec, pp2_dp2_ep2(stream="a2a"), batch)
    dag = plan.dag
    nodes = {n.id: n for n in dag.nodes if n.op == Op.ALL_TO_ALL}
    assert len(nodes) == 2 * 4 * 4  # stages x microbatches x (dispatch, combine, and grads)
    ins = [plan.regions[r].inputs[0] for r in (1, 2)]       # each expert's gathered tokens
    outs = [plan.regions[r].outputs[0] for r in (1, 2)]     # each expert's output
    d = nodes["ALL_TO_ALL[PP=0,MB=1]#dispatch"]
    assert (d.devices, d.stream, d.mb) == ((0, 2), "a2a", 1)
    assert (d.attr("purpose"), d.attr("grad"), d.attr("values")) == ("dispatch", False, tuple(ins))
    assert d.attr("owners") == ((ins[0], 0), (ins[1], 2))
    assert d.attr("split_by") == ((ins[0], ins[0]), (ins[1], ins[1]))
    c = nodes["ALL_TO_ALL[PP=0,SEG=1,MB=1]#combine"]
    assert (c.attr("purpose"), c.attr("grad"), c.attr("values")) == ("combine", False, tuple(outs))
    assert c.attr("owners") == ((outs[0], 0), (outs[1], 2))
    assert c.attr("split_by") == ((outs[0], ins[0]), (outs[1], ins[1]))
    gd = nodes["ALL_TO_ALL[PP=0,SEG=1,MB=1]#dispatch.grad"]
    assert (gd.attr("purpose"), gd.attr("grad")) == ("dispatch", True)
    assert gd.attr("owners") == c.attr("owners") and gd.attr("split_by") == c.attr("split_by")
    gc = nodes["ALL_TO_ALL[PP=0,MB=1]#combine.grad"]
    assert (gc.attr("purpose"), gc.attr("grad")) == ("combine", True)
    assert gc.attr("owners") == d.attr("owners") and gc.attr("split_by") == d.attr("split_by")
    # producers on every member -> all-to-all -> consumers
    assert {(dag[e.src].id, e.values) for e in dag.in_edges(d.id)} == {
        ("F[PP=0,MB=1]", tuple(ins))}
    assert {(dag[e.dst].id, e.values) for e in dag.out_edges(d.id)} == {
        ("F[PP=0,EP=0,MB=1]", (ins[0],)), ("F[PP=0,EP=1,MB=1]", (ins[1],))}
    assert {e.src for e in dag.in_edges(c.id)} == {"F[PP=0,EP=0,MB=1]", "F[PP=0,EP=1,MB=1]"}
    assert {e.dst for e in dag.out_edges(c.id)} == {"F[PP=0,SEG=1,MB=1]"}
    assert {e.src for e in dag.in_edges(gd.id)} == {"B[PP=0,SEG=1,MB=1]"}
    assert {e.dst for e in dag.out_edges(gc.id)} == {"B[PP=0,MB=1]"}
    # no expert edge is left to send/recv
    for n in dag.nodes:
        if n.op in (Op.SEND, Op.RECV):
            assert "EP" not in dict(n.tags), n.id
    again = type(dag).from_text(dag.text())
    assert (again.nodes, again.edges) == (dag.nodes, dag.edges)


def emulate_forward(plan, inputs, targets):
    """Run the regions like the runtime would, with one process standing in for every replica:
    dispatch = concatenate each replica's tokens in group order, combine = split them back by
    the counts of the `split_by` value. Returns the mean of the replicas' losses."""
    dag = plan.dag
    fwd = [n for n in dag.nodes if n.op == Op.ALL_TO_ALL and not n.attr("grad")]
    dispatched = {v for n in fwd if n.attr("purpose") == "dispatch" for v in n.attr("values")}
    split_by = {v: s for n in fwd if n.attr("purpose") == "combine" for v, s in n.attr("split_by")}
    experts = {n.region for n in dag.nodes if n.attr("ep_group") is not None}
    width = len(fwd[0].devices)
    vals = [{"inputs": x, "targets": y}
            for x, y in zip(inputs.chunk(width), targets.chunk(width), strict=True)]
    losses = []
    for info, mod in zip(plan.capture.regions, plan.capture.modules, strict=True):
        if info.index in experts:
            assert set(info.inputs) <= dispatched
            outs = mod(*(torch.cat([vals[i][v] for i in range(width)]) for v in info.inputs))
            for name, out in zip(info.outputs, outs, strict=True):
                counts = [vals[i][split_by[name]].shape[0] for i in range(width)]
                for i, part in enumerate(out.split(counts)):
                    vals[i][name] = part
            continue
        for i in range(width):
            outs = mod(*(vals[i][v] for v in info.inputs))
            for name, out in zip(info.outputs, outs, strict=True):
                if name == "loss":
                    losses.append(out)
                else:
                    vals[i][name] = out
    return sum(losses) / width


def test_all_to_all_attrs_reproduce_the_eager_model(moe2):
    model, spec, (x, y) = moe2
    plan = pn.compile(spec, pp2_dp2_ep2(mb=1), (x, y))
    loss = emulate_forward(plan, x, y)
    eager = model.loss_fn(model(x), y)
    torch.testing.assert_close(loss, eager)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(eager, params),
                    strict=True):
        torch.testing.assert_close(a, b)


def test_data_parallel_experts_without_pipeline():
    model, spec = moe(stages=1)
    plan = pn.compile(spec, [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]),
                             pn.split({}, "MB", 2)], model.example_batch(8))
    # two MoE blocks in one stage: r0 -> experts -> r3 -> experts -> r6, then back
    assert [s for s, _ in a2a(plan, 0)] == (
        [x for m in range(2) for x in (f"r0:DISPATCH_F{m}", f"r3:COMBINE_F{m}",
                                       f"r3:DISPATCH_F{m}", f"r6:COMBINE_F{m}")]
        + [x for m in range(2) for x in (f"r6:DISPATCH_B{m}", f"r3:COMBINE_B{m}",
                                         f"r3:DISPATCH_B{m}", f"r0:COMBINE_B{m}")])
    assert [str(i) for i in plan[1].compute()][:5] == ["r0:F0", "r2:F0", "r3:F0", "r5:F0",
                                                       "r6:F0"]


def test_uneven_experts_are_allowed():
    model, spec = moe(experts=3)
    plan = pn.compile(spec, pp2_dp2_ep2(mb=2), model.example_batch(8))
    on = {d: sorted(plan.regions[i.region].name for i in plan[d].compute() if i.kind == "U")
          for d in (0, 2)}
    assert on == {0: ["PP=0", "PP=0,EP=0", "PP=0,EP=2", "PP=0,SEG=1"],
                  2: ["PP=0", "PP=0,EP=1", "PP=0,SEG=1"]}
    d = next(n for n in plan.dag.nodes if n.id == "ALL_TO_ALL[PP=0,MB=0]#dispatch")
    assert [o for _, o in d.attr("owners")] == [0, 2, 0]


def test_two_blocks_per_stage_share_a_segment_between_combine_and_dispatch():
    model, spec = moe(layers=4)
    plan = pn.compile(spec, pp2_dp2_ep2(mb=2, zero=3), model.example_batch(8))
    ids = {n.id for n in plan.dag.nodes if n.op == Op.ALL_TO_ALL and n.mb == 0}
    assert {"ALL_TO_ALL[PP=0,SEG=1,MB=0]#combine", "ALL_TO_ALL[PP=0,SEG=1,MB=0]#dispatch",
            "ALL_TO_ALL[PP=0,SEG=1,MB=0]#dispatch.grad",
            "ALL_TO_ALL[PP=0,SEG=1,MB=0]#combine.grad"} <= ids
    assert len(ids) == 16


def test_shard_over_one_device_needs_no_all_to_all():
    model, spec = moe(stages=1)
    plan = pn.compile(spec, [pn.place({}, [0]), pn.shard({"EP": "*"}, [0])],
                      model.example_batch(4))
    assert not any(i.kind == "ALL_TO_ALL" for i in plan[0].instrs)


def test_shard_round_trips_through_piper_json():
    program = pn.Program(pp2_dp2_ep2(stream="ep"))
    again = pn.Program.from_json(program.to_json())
    assert again == program
    assert '{"op": "shard", "filter": {"PP": 0, "EP": "*"}, "devices": [0, 2]' in program.to_json()


@pytest.mark.parametrize("bad, index, message", [
    (lambda p: p[:4] + [pn.shard({"PP": 0}, [0, 2])] + p[5:], 4, "without an EP tag"),
    (lambda p: p[:4] + [pn.shard({"PP": 7, "EP": "*"}, [0, 2])] + p[5:], 4, "matches no region"),
    (lambda p: p[:5] + [pn.shard({"PP": 1, "EP": "*"}, [1, 2])] + p[6:], 5,
     r"replicate the surrounding regions over the same devices.*pn.replicate\({'PP': 1}, \[1, 2\]"),
    (lambda p: p[:4] + [pn.shard({"PP": 0, "EP": "*"}, [0, 2, 1])] + p[5:], 4,
     r"leave devices \[1\] without an expert"),
    (lambda p: p + [pn.shard({"EP": 1}, [0])], 7, "already sharded"),
    (lambda p: [p[0], pn.place({"PP": 0, "SEG": 1}, [2, 0]), *p[1:]], 5, "different orders"),
])
def test_bad_shard_programs_name_the_directive(moe2, bad, index, message):
    _, spec, batch = moe2
    with pytest.raises(pn.PlanError, match=message) as info:
        pn.compile(spec, bad(pp2_dp2_ep2()), batch)
    assert info.value.directive == index and info.value.op == "shard"
