"""Expert parallelism: ALL_TO_ALL around sharded experts trains exactly like the reference.

TinyMoE with top-1 routing, so every replica sends each expert a different number of tokens
in every microbatch (and the counts change as the router trains): PP 2 x DP 2 x EP 2 on 4
ranks (each stage's experts sharded over its replicas), with and without a 1F1B order, with
ZeRO 0, 1 and 3 on the surrounding regions, and DP 2 x EP 2 without a pipeline on 2 ranks
(also with three experts over two devices, an expert no token reaches, and on CUDA).
"""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb import optim
from piper_nb.capture.region_code import RegionTracer
from piper_nb.cluster.local import LocalCluster
from piper_nb.runtime.bundle import load_bundle, make_bundle
from piper_nb.strategies import moe_annotation
from piper_nb.train import reference_train, train

pytestmark = pytest.mark.dist

OPTIMIZERS = {"sgd": optim.SGD(0.1, momentum=0.9), "adamw": optim.AdamW(1e-3)}
STEPS = 3


def _moe(stages: int = 2, experts: int = 2, top_k: int = 1):
    model = pn.models.TinyMoE(layers=2, experts=experts, top_k=top_k)
    spec = pn.annotate(model, moe_annotation(2, experts, stages))
    return model, spec, model.example_batch(batch_size=8, seed=0)


def _pp2_dp2_ep2(mb: int, zero: int, order: bool) -> list:
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=zero),
               pn.replicate({"PP": 1}, [1, 3], zero=zero),
               pn.shard({"PP": 0, "EP": "*"}, [0, 2]), pn.shard({"PP": 1, "EP": "*"}, [1, 3])]
    if order:
        return program + pn.schedules.one_f_one_b(ranks=2, microbatches=mb)
    return program + [pn.split({}, "MB", mb)]


def _run(model, spec, batch, program, cluster, opt_name, same):
    plan = pn.compile(spec, program, batch)
    assert any(i.kind == "ALL_TO_ALL" for dp in plan.devices for i in dp.instrs)
    opt = OPTIMIZERS[opt_name]
    result = train(plan, batch, STEPS, opt, cluster=cluster)
    same(result, reference_train(model, batch, STEPS, plan.microbatches, opt), model)
    return plan, result


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("mb, zero, order", [(2, 0, False), (4, 0, True), (4, 1, False),
                                             (2, 3, True)])
def test_pp2_dp2_ep2(cluster4, same, opt, mb, zero, order):
    model, spec, batch = _moe()
    plan, result = _run(model, spec, batch, _pp2_dp2_ep2(mb, zero, order), cluster4, opt, same)
    a2a = [e for e in result.trace.events if e.kind == "ALL_TO_ALL"]
    assert len(a2a) == 4 * mb * 4  # devices x microbatches x (dispatch, combine, both grads)


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_dp2_ep2_without_pipeline(cluster2, same, opt):
    model, spec, batch = _moe(stages=1)
    program = [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]), pn.split({}, "MB", 2)]
    _run(model, spec, batch, program, cluster2, opt, same)


def test_uneven_experts_top2(cluster2, same):
    """Three experts over two devices (device 0 holds experts 0 and 2), two per token."""
    model, spec, batch = _moe(stages=1, experts=3, top_k=2)
    program = [pn.replicate({}, [0, 1], zero=1), pn.shard({"EP": "*"}, [0, 1]),
               pn.split({}, "MB", 2)]
    _run(model, spec, batch, program, cluster2, "adamw", same)


def test_an_expert_without_tokens(cluster2, same):
    """Expert 1 of the first block gets no token at all: empty pieces, an empty expert pass."""
    model, spec, batch = _moe(stages=1)
    with torch.no_grad():
        model.blocks[0].moe.router.bias[1] = -30.0
    program = [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]), pn.split({}, "MB", 2)]
    _run(model, spec, batch, program, cluster2, "sgd", same)
    assert _routed(model, batch[0], parts=4)[0][1] == [0, 0, 0, 0]


def _routed(model, inputs, parts: int) -> list[list[list[int]]]:
    """Per block and expert, the tokens each part of the batch routes to it (top-1)."""
    seen = []
    hooks = [b.moe.router.register_forward_hook(lambda m, a, out: seen.append(out))
             for b in model.blocks]
    with torch.no_grad():
        model(inputs)
    for h in hooks:
        h.remove()
    out = []
    for logits in seen:
        top = logits.argmax(-1).chunk(parts)
        out.append([[int((t == e).sum()) for t in top] for e in range(logits.shape[-1])])
    return out


def test_token_counts_differ_between_replicas_and_microbatches():
    """The routing the tests above rely on is uneven, else every count would be the same."""
    model, _, (x, _) = _moe()
    counts = _routed(model, x, parts=4)  # 2 microbatches x 2 replicas
    assert all(len(set(per_part)) > 1 for block in counts for per_part in block)


def test_regions_passing_sizes_survive_the_bundle():
    """TinyMoE's regions pass `x.shape` across (capture.split.pack_size); unpickling a
    GraphModule traces its code again, which must keep those calls (capture.split.RegionTracer)."""
    model, spec, batch = _moe(stages=1)
    plan = pn.compile(spec, [pn.place({}, [0]), pn.split({}, "MB", 2)], batch)
    assert any("pack_size" in m.code for m in plan.capture.modules)
    modules = load_bundle(make_bundle(plan)).modules
    assert all(m._tracer_cls is RegionTracer for m in plan.capture.modules)
    x = batch[0][:2]
    vals = {"inputs": x, "targets": batch[1][:2]}
    for info, mod, again in zip(plan.regions, plan.capture.modules, modules, strict=True):
        args = [vals[v] for v in info.inputs]
        outs, outs2 = mod(*args), again(*args)
        for name, a, b in zip(info.outputs, outs, outs2, strict=True):
            assert torch.equal(a, b), name
            vals[name] = a


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dp2_ep2_on_cuda():
    """NCCL with a GPU per rank, else two ranks sharing one GPU through gloo (host staging)."""
    model, spec, batch = _moe(stages=1)
    program = [pn.replicate({}, [0, 1]), pn.shard({"EP": "*"}, [0, 1]), pn.split({}, "MB", 2)]
    plan = pn.compile(spec, program, batch)
    opt = OPTIMIZERS["adamw"]
    with LocalCluster(2, device="cuda") as cluster:
        result = train(plan, batch, STEPS, opt, cluster=cluster)
    ref = reference_train(model, batch, STEPS, 2, opt)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1e-4, atol=1e-4)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(result.state_dict()[name], value, rtol=1e-4, atol=1e-4)
    assert result.leftover == []
