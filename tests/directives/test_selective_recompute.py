"""`pn.recompute(filter, mode="selective")`: only the attention cores (scores, softmax,
dropout, probabilities times values) keep just their inputs and run again in the backward.
It trains like one process, attention dropout included, under 1F1B, a split backward
(ZB1P), ZeRO-3 (without dropout: see NO_DROPOUT) and TP 2 with SP; it keeps the layer's
activations but the cores'; its backward costs the cores' FLOPs more; the user's capture
is left as it was; bad filters are PlanErrors naming the fix."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

import piper_nb as pn
from piper_nb.capture.attention_core import CORE_PREFIX, cores
from piper_nb.directives.recompute import Recompute
from piper_nb.directives.spec import directive_from_json
from piper_nb.sim.op_counts import Kind, region_ops

SGD = pn.optim.SGD(lr=0.1)
RTOL, ATOL = 1e-5, 4e-5
LAYERS = {"embed": {"PP": 0, "L": 0}, "blocks.0": {"PP": 0, "L": 1},
          "blocks.1": {"PP": 1, "L": 2}, "head": {"PP": 1, "L": 3}}


def _GPT(p: float = 0.25):
    """Megatron's GPT layer, dropout on the attention probabilities too."""
    return pn.models.MegatronGPT(vocab=32, dim=32, layers=2, heads=4, seq=8, p=p)


SELECTIVE = pn.recompute({"L": "*"}, mode="selective")
# Data parallelism draws each replica's masks for its share of the microbatch, which one
# process does not (with or without recompute): the ZeRO-3 case runs without dropout.
NO_DROPOUT = {"zero3"}
PROGRAMS = {
    "1f1b": lambda: [*pn.schedules.one_f_one_b(2, 4, place=True), SELECTIVE],
    "zb1p": lambda: [*pn.schedules.zero_bubble(2, 4, place=True), SELECTIVE],
    "zero3": lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1], zero=3),
                      pn.split({}, "MB", 2), SELECTIVE],
    "tp2-sp": lambda: [pn.tensor_parallel({}, [0, 1], sequence_parallel=True),
                       pn.split({}, "MB", 2), SELECTIVE],
}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_selective_recompute_trains_like_one_process(cluster2, one_thread, name):
    model = _GPT(p=0.0 if name in NO_DROPOUT else 0.25)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, LAYERS)
    plan = pn.compile(spec, PROGRAMS[name](), batch)
    assert sum(str(n.target).startswith(CORE_PREFIX) for m in plan.capture.modules
               for n in m.graph.nodes) == 2            # one core a layer
    result = pn.train(plan, batch, 3, SGD, cluster=cluster2, seed=5)
    ref = pn.reference_train(spec, batch, 3, plan.reference_microbatches, SGD, seed=5)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    got = result.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")
    assert result.leftover == []


def _one_device(program_extra=(), model=None):
    model = model or _GPT()
    batch = model.example_batch(batch_size=4, seed=0)
    spec = pn.annotate(model, {k: {**v, "PP": 0} for k, v in LAYERS.items()})
    return spec, batch, pn.compile(spec, [pn.place({}, [0]), *program_extra], batch)


def test_only_the_attention_cores_keep_nothing():
    """The layer's saved bytes drop by exactly what the core's ops save, Table 2's 5as/h:
    the softmax output, the dropout's noise and the dropped probabilities (b a s s fp32
    each); q, k and v stay, as the core's inputs (views of the projection's output)."""
    spec, batch, plain = _one_device()
    *_, sel = _one_device([SELECTIVE])
    b, s, a = 4, 8, 4
    square = b * a * s * s * 4
    region = next(r.index for r in plain.regions if dict(r.tags).get("L") == 1)
    dropped = plain.saved[region] - sel.saved[region]
    assert dropped > 0
    assert len(cores(plain.capture.modules[region])) == 1
    assert dropped == 3 * square
    # the user's capture is untouched: the plain plan's module has no core call
    assert not any(str(n.target).startswith(CORE_PREFIX)
                   for n in plain.capture.modules[region].graph.nodes)


def test_the_backward_costs_the_cores_flops_once_more():
    *_, plain = _one_device()
    *_, sel = _one_device([SELECTIVE])
    a, b = (pn.CostModel.analytic(p, "H100").passes for p in (plain, sel))
    region = next(r.index for r in plain.regions if dict(r.tags).get("L") == 1)
    assert a[(region, "F")] == pytest.approx(b[(region, "F")])
    assert b[(region, "B")] > a[(region, "B")] and b[(region, "BI")] > a[(region, "BI")]
    # the backwards run the core's two products of b a s s d multiply-adds again, as kernels
    ops = [region_ops(p)[region] for p in (plain, sel)]

    def matmuls(tallies) -> Counter:
        out = Counter()
        for t in tallies:
            if t.kind == Kind.MATMUL:
                out[t.flops] += t.count
        return out
    assert matmuls(ops[1]["F"]) == matmuls(ops[0]["F"])
    for kind in ("B", "BI"):
        assert matmuls(ops[1][kind]) - matmuls(ops[0][kind]) == Counter({2 * 4 * 4 * 8 * 8 * 8: 2})


def test_bad_filters_are_plan_errors_naming_the_fix():
    with pytest.raises(pn.PlanError, match="drop MB from the filter"):
        pn.recompute({"MB": 0}, mode="selective")
    with pytest.raises(pn.PlanError, match="not one of full, selective"):
        pn.recompute({}, mode="some")
    mlp = pn.models.MLP(dim=16, depth=2)
    batch = (torch.randn(4, 16), torch.randn(4, 16))
    with pytest.raises(pn.PlanError, match=r"directive #1 \(recompute\).*hold no attention "
                                           r"core.*use mode='full'"):
        pn.compile(pn.annotate(mlp), [pn.place({}, [0]), pn.recompute({}, mode="selective")],
                   batch, loss_fn=F.mse_loss)


def test_json_code_and_row():
    d = pn.recompute({"PP": 1}, mode="selective")
    assert directive_from_json(d.to_json()) == d
    assert d.code() == 'pn.recompute({"PP": 1}, mode="selective")'
    assert pn.recompute({"PP": 1}).code() == 'pn.recompute({"PP": 1})'
    assert directive_from_json({"op": "recompute", "filter": {}}) == pn.recompute({})
    assert Recompute.row(2, 4)["op"] == "recompute"


@pytest.mark.parametrize("attention", ["sdpa", "flash"])
def test_a_fused_attention_is_a_core_of_its_own(attention):
    """`scaled_dot_product_attention`, and a flash kernel's output (its log-sum-exp unread),
    keep only q, k and v: one core a layer, and fewer saved bytes."""
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8,
                            attention=attention)
    batch = model.example_batch(4, seed=0)
    spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks": {"PP": 0, "L": 1},
                               "head": {"PP": 0}})
    plain = pn.compile(spec, [pn.place({}, [0])], batch)
    sel = pn.compile(spec, [pn.place({}, [0]), pn.recompute({"L": 1}, mode="selective")], batch)
    region = next(r.index for r in sel.regions if dict(r.tags).get("L") == 1)
    calls = [n for n in sel.capture.modules[region].graph.nodes
             if str(n.target).startswith(CORE_PREFIX)]
    assert len(calls) == 2
    assert sel.saved[region] < plain.saved[region]


@pytest.mark.dist
def test_a_flash_llama_with_tp_and_sp_trains_like_one_process(cluster2, one_thread):
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8,
                            attention="flash")
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, {"embed": {"PP": 0}, "blocks.0": {"PP": 0, "L": 1},
                               "blocks.1": {"PP": 0, "L": 2}, "head": {"PP": 0}})
    plan = pn.compile(spec, [pn.tensor_parallel({}, [0, 1], sequence_parallel=True),
                             pn.split({}, "MB", 2), SELECTIVE], batch)
    result = pn.train(plan, batch, 2, SGD, cluster=cluster2)
    ref = pn.reference_train(spec, batch, 2, plan.reference_microbatches, SGD)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    got = result.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


def test_a_selective_plan_compiled_again_for_another_batch_keeps_its_cores():
    """A plan retrained on a batch of another size compiles its program again from its own
    capture, whose attention cores run again already: they stay as they are."""
    from piper_nb.compiler.compile import rebatch
    spec, batch, plan = _one_device([SELECTIVE])
    again = rebatch(plan, _GPT().example_batch(batch_size=2, seed=1))
    assert again.batch_size == 2
    assert sum(str(n.target).startswith(CORE_PREFIX) for m in again.capture.modules
               for n in m.graph.nodes) == 2
