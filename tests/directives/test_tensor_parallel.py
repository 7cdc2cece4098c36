"""`pn.tensor_parallel` before anything runs: the parts and collectives it compiles to, the
plan's text and JSON, the checks that read them, and a PlanError for every plan that
cannot hold (a degree that cannot divide heads or features, no plan, a member device
placed on its own, groups of different sizes, a colwise layer with no rowwise one)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import piper_nb as pn
from piper_nb.compiler.checks import check_plan
from piper_nb.ir.kinds import Op, Purpose
from piper_nb.plan.plan import DevicePlan

ONE = {"": {"PP": 0}}


def llama(**kw):
    cfg = dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8) | kw
    return pn.models.Llama(**cfg)


def compile_tp(model, program, ann=ONE, **kw):
    batch = model.example_batch(batch_size=4, seed=0)
    return pn.compile(pn.annotate(model, ann), program, batch, **kw)


def test_a_block_becomes_parts_with_an_all_reduce_each_way_between_them():
    blocks = {k: v for k, v in pn.models.Llama.tp_plan.items() if k.startswith("blocks")}
    plan = compile_tp(llama(layers=1), [pn.tensor_parallel({}, [0, 1], plan=blocks),
                                        pn.split({}, num=2)])
    # embed + norm | q k v attention o | residual + norm | gate up down | residual + head
    assert [dict(r.tags)["PART"] for r in plan.regions] == [0, 1, 2, 3, 4]
    text = plan[0].text()
    assert text[:6] == ["r0:F0", "r1:F0", "r1:AR_F0", "r2:F0", "r3:F0", "r3:AR_F0"]
    assert "r3:AR_B0" in text and "r1:AR_B0" in text
    assert plan[1].text() == text          # the member runs the group's first device's list
    tp = [i for i in plan[0].instrs if i.purpose == Purpose.TP]
    assert {i.data.group for i in tp} == {(0, 1)} and {i.data.grad for i in tp} == {False, True}
    dag = plan.dag
    assert any(n.op == Op.ALL_REDUCE and n.attr("purpose") == Purpose.TP for n in dag.nodes)
    assert "tensor-parallel collectives" in " ".join(dag.history)


def test_weights_are_a_devices_share_and_the_plan_round_trips_through_json():
    plan = compile_tp(llama(), [pn.tensor_parallel({}, [0, 1])])
    assert plan.params["blocks.0.mlp.up.weight"][0] == (32, 32)     # 64 features over 2
    assert plan.params["blocks.0.mlp.down.weight"][0] == (32, 32)
    assert plan.params["blocks.0.norm1.weight"][0] == (32,)         # replicated
    assert plan.tp_params["blocks.0.mlp.down.weight"] == (1, 2, 1)
    back = pn.Plan.from_json(plan.to_json())
    assert back.tp_groups == plan.tp_groups and back.tp_params == plan.tp_params
    assert [dp.text() for dp in back.devices] == [dp.text() for dp in plan.devices]


def test_the_models_own_plan_or_the_users():
    mine = {"blocks.*.mlp.up": "colwise", "blocks.*.mlp.gate": "colwise",
            "blocks.*.mlp.down": "rowwise"}
    plan = compile_tp(llama(), [pn.tensor_parallel({}, [0, 1], plan=mine)])
    assert {n.rsplit(".", 2)[-2] for n in plan.tp_params} == {"up", "gate", "down"}


def _without(dp: DevicePlan, k: int) -> DevicePlan:
    """A device's list without instruction k and its WAIT."""
    instrs = list(dp.instrs)
    wait = next(i for i, x in enumerate(instrs) if x.kind == Op.WAIT and x.data.target == k)
    kept = [i for i in range(len(instrs)) if i not in (k, wait)]
    remap = {old: new for new, old in enumerate(kept)}
    return DevicePlan(dp.device, tuple(
        instrs[i].with_data(target=remap[instrs[i].data.target])
        if instrs[i].kind == Op.WAIT else instrs[i] for i in kept))


def test_the_dry_run_and_the_nccl_check_see_a_missing_all_reduce():
    plan = compile_tp(llama(layers=1), [pn.tensor_parallel({}, [0, 1]), pn.split({}, num=2)])
    check_plan(plan)
    k = next(i for i, x in enumerate(plan[1].instrs) if x.purpose == Purpose.TP)
    broken = dataclasses.replace(plan, devices=(plan[0], _without(plan[1], k)))
    with pytest.raises(pn.PlanError, match="AR_F0|deadlock|stuck|collective"):
        check_plan(broken)


def test_the_gradient_check_sees_a_gradient_share_never_summed():
    # the backward all-reduce dropped on every member alike: the group still agrees, so
    # only the gradient-flow check can tell the next backward would read one share
    plan = compile_tp(llama(layers=1), [pn.tensor_parallel({}, [0, 1]), pn.split({}, num=2)])
    k = next(i for i, x in enumerate(plan[0].instrs) if x.purpose == Purpose.TP and x.data.grad)
    broken = dataclasses.replace(plan, devices=tuple(_without(dp, k) for dp in plan.devices))
    with pytest.raises(pn.PlanError, match="share of the gradient of .* all-reduce of those "
                       "shares has not completed"):
        check_plan(broken)


def test_the_simulator_times_the_collectives_and_the_memory_model_divides_weights():
    model = llama()
    plan = compile_tp(model, [pn.tensor_parallel({}, [0, 1]), pn.split({}, num=2)])
    trace = pn.simulate(plan, pn.CostModel.uniform(comm=0.5))
    tp = [e for e in trace.events if e.kind == "ALL_REDUCE"]
    assert tp and all(e.end - e.start == pytest.approx(0.5) for e in tp)
    whole = compile_tp(model, [pn.place({}, [0]), pn.split({}, num=2)])
    full = pn.simulate(whole, pn.CostModel.uniform())
    def peak(t):
        return max(s.params for s in t.memory if s.device == 0)
    ratio = peak(trace) / peak(full)
    assert 0.5 < ratio < 0.75   # the projections halve; embeddings, norms and head stay


@pytest.mark.parametrize("kw, degree, match", [
    (dict(kv_heads=2), 4, "kv_heads=2, which 4 devices cannot divide"),
    (dict(kv_heads=4, hidden=66), 4, "66 output features, which 4 devices cannot divide"),
])
def test_a_degree_that_cannot_divide_names_the_module_and_the_sizes(kw, degree, match):
    with pytest.raises(pn.PlanError, match=match):
        compile_tp(llama(**kw), [pn.tensor_parallel({}, list(range(degree)))])


def test_a_vocab_parallel_embedding_is_a_sharded_part_summed_by_an_all_reduce():
    model = llama(layers=1)
    plan = compile_tp(model, [pn.tensor_parallel({}, [0, 1])])   # the model's own plan
    assert plan.params["embed.weight"][0] == (16, 32)
    assert plan.params["head.proj.weight"][0] == (16, 32)
    # ids and the range mask | the lookup | norm | attention | norm | MLP | norm | the
    # head and each device's share of its loss | the loss
    assert [dict(r.tags)["PART"] for r in plan.regions] == list(range(9))
    assert plan[0].text()[:3] == ["r0:F", "r1:F", "r1:AR_F"]


def test_a_partial_sum_the_region_returns_is_summed_before_it_is_sent():
    model = llama()   # four stages: the embedding is one of its own, returning a partial sum
    plan = compile_tp(model, [pn.place({"PP": s}, [2 * (s % 2)]) for s in range(4)]
                      + [pn.tensor_parallel({"PP": "*"}, [[0, 1], [2, 3]])],
                      ann=pn.cut_stages(model, 4))
    assert [r.name for r in plan.regions][:3] == ["PP=0,PART=0", "PP=0,PART=1", "PP=0,PART=2"]
    text = plan[0].text()
    assert text.index("r1:AR_F") < text.index("r2:F") < text.index("r2:SEND_F>2")


@pytest.mark.parametrize("model, plan, match", [
    (llama(vocab=33), {"embed": "vocab"}, "embed \\(vocab\\) has 33 rows, which 2 devices"),
    (pn.models.TinyGPT(vocab=32, dim=32, layers=1, heads=4, seq=8), {"tok": "vocab"},
     "tok.weight \\(vocab\\) is tied to head.proj.weight \\(kept whole\\)"),
    (llama(), {"embed": "colwise"}, "embed is an embedding, which takes vocab or replicate"),
    (llama(), {"blocks.*.mlp.up": "vocab"}, "blocks.0.mlp.up \\(vocab\\) is a linear layer "
     "whose output reaches more than a cross-entropy's logits"),
])
def test_what_a_vocab_parallel_embedding_cannot_be(model, plan, match):
    with pytest.raises(pn.PlanError, match=match):
        compile_tp(model, [pn.tensor_parallel({}, [0, 1], plan=plan)])


def test_an_lm_head_read_only_by_its_loss_gets_a_vocab_parallel_cross_entropy():
    model = llama(layers=1)
    plan = compile_tp(model, [pn.tensor_parallel({}, [0, 1],
                                                 plan={**model.tp_plan, "head.proj": "vocab"})])
    assert plan.params["head.proj.weight"][0] == (16, 32)   # half the vocabulary
    # ... | MLP | norm | the head on its classes | the loss from 2 log-sum-exps and a logit
    *_, head, loss = plan.regions
    assert "head.proj.weight" in head.params and loss.has_loss and not loss.params
    reduced = [plan.values[v] for i in plan[0].instrs if i.region == head.index
               and i.purpose == pn.Purpose.TP and not i.data.grad for v in i.data.values]
    assert [v.shape for v in reduced] == [(32, 3)]


def _weighted(logits, targets):
    return nn.functional.cross_entropy(logits.reshape(-1, 32), targets.reshape(-1),
                                       weight=torch.ones(32))


def test_a_vocab_parallel_cross_entropy_takes_no_class_weights():
    model = llama(layers=1)
    with pytest.raises(pn.PlanError, match="a vocabulary-parallel cross-entropy does not take "
                       "class weights; gather the logits"):
        compile_tp(model, [pn.tensor_parallel({}, [0, 1],
                                              plan={**model.tp_plan, "head.proj": "colwise"})],
                   loss_fn=_weighted)


class _NormedMLP(nn.Module):
    """up -> a norm (or softmax) over up's features -> down: a device holds only a share of
    the features the norm reduces over."""

    def __init__(self, reduce):
        super().__init__()
        self.up, self.down, self.reduce = nn.Linear(16, 32), nn.Linear(32, 16), reduce

    def forward(self, x):
        return self.down(self.reduce(self.up(x)))


@pytest.mark.parametrize("reduce, op", [
    (nn.LayerNorm(32), "model.reduce"), (lambda h: h.softmax(-1), "softmax"),
    (lambda h: h - h.mean(dim=-1, keepdim=True), "mean"),
])
def test_a_reduction_over_a_devices_share_of_the_features_is_refused(reduce, op):
    model = _NormedMLP(reduce)
    batch = (torch.randn(4, 16), torch.randn(4, 16))
    program = [pn.tensor_parallel({}, [0, 1], plan={"up": "colwise", "down": "rowwise"})]
    with pytest.raises(pn.PlanError, match=f"{op}.* reduces over dimension 1 of \\[4, 32\\], "
                       "which each device holds only a share of"):
        pn.compile(pn.annotate(model, {"": {"PP": 0}}), program, batch,
                   loss_fn=nn.functional.mse_loss)


def test_a_tied_head_in_a_stage_no_filter_matches_is_told():
    model = pn.models.TinyGPT(vocab=32, dim=32, layers=2, heads=4, seq=8)   # tied weights
    plan = {"tok": "vocab", "head.proj": "colwise_gather_output"}
    with pytest.raises(pn.PlanError, match="region PP=1 reads embed.tok.weight whole, which "
                       "region PP=0 shards"):
        compile_tp(model, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                           pn.tensor_parallel({"PP": 0}, [0, 1], plan=plan)],
                   ann=pn.cut_stages(model, 2))


def test_a_model_without_a_plan_is_told_how_to_give_one():
    model = pn.models.MLP(dim=16, depth=2)
    with pytest.raises(pn.PlanError, match="no tensor-parallel plan of its own; give one"):
        compile_tp(model, [pn.tensor_parallel({}, [0, 1])], ann={"layers": {"PP": 0}})


def test_a_member_device_is_not_placed_on_its_own():
    model = llama()
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               pn.tensor_parallel({"PP": 0}, [0, 1]), pn.split({}, num=2)]
    with pytest.raises(pn.PlanError, match="member of the tensor-parallel group"):
        compile_tp(model, program, ann=pn.cut_stages(model, 2))


def test_bad_arguments():
    with pytest.raises(pn.PlanError, match="differ in size"):
        pn.tensor_parallel({}, [[0, 1], [2, 3, 4]])
    with pytest.raises(pn.PlanError, match="unknown style 'diagonal'"):
        pn.tensor_parallel({}, [0, 1], plan={"layers.*.up": "diagonal"})


class _ColwiseOnly(nn.Module):
    """A colwise layer whose share reaches the loss with no rowwise layer after it."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 8)

    def forward(self, x):
        return self.up(x)

    def example_batch(self, batch_size, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 8, generator=g)

    def loss_fn(self, out, y):
        return ((out - y) ** 2).mean()


def test_a_colwise_layer_with_no_rowwise_one_after_it():
    with pytest.raises(pn.PlanError, match="without a rowwise layer"):
        compile_tp(_ColwiseOnly(), [pn.tensor_parallel({}, [0, 1], plan={"up": "colwise"})],
                   ann={"up": {"PP": 0}})
