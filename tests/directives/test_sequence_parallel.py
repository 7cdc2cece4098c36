"""`tensor_parallel(sequence_parallel=True)` at compile time: what runs on slices of the
sequence, the sums that lay them back and the norm weights' gradient sums as plan
instructions, and the PlanErrors for what cannot run on slices (item 7 of the
sequence-parallel issue). Training equality is in tests/runtime/test_sequence_parallel.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.sim.cost import HARDWARE

LAYERS = {"embed": {"PP": 0, "L": 0}, "blocks.0": {"PP": 0, "L": 1},
          "blocks.1": {"PP": 0, "L": 2}, "head": {"PP": 0, "L": 3}}


def llama(seq: int = 8, kv_heads: int = 2):
    return pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=kv_heads, hidden=64,
                           seq=seq)


def compile_sp(model, ann=LAYERS, devices=(0, 1), batch=None, **kw):
    batch = batch if batch is not None else model.example_batch(batch_size=4, seed=0)
    return pn.compile(pn.annotate(model, ann), [
        pn.tensor_parallel({}, list(devices), sequence_parallel=True, **kw)], batch)


def test_the_replicated_parts_run_on_slices_and_the_sums_are_instructions():
    whole = pn.compile(pn.annotate(llama(), LAYERS), [pn.tensor_parallel({}, [0, 1])],
                       llama().example_batch(batch_size=4, seed=0))
    plan = compile_sp(llama())
    stream = [v for r in plan.regions for v in r.outputs if v.startswith(("add", "model_embed"))]
    assert {plan.values[v].shape for v in stream} == {(4, 4, 32)}       # half the sequence
    assert {whole.values[v].shape for v in stream} == {(4, 8, 32)}
    tp = [i for i in plan[1].instrs if i.purpose == pn.Purpose.TP]
    # forward: the embedding's sum, then per layer two slices laid back whole before the
    # sharded parts and two sums after them; and the head's input laid back, its loss
    assert sum(not i.data.grad for i in tp) > sum(not i.data.grad for i in whole[1].instrs
                                                  if i.purpose == pn.Purpose.TP)
    assert all(i.data.group == (0, 1) for i in tp)
    # the slices go back whole by all-gathers, the row-parallel sums to slices by
    # reduce-scatters, each backward by the dual; all-reduces for the norm weights' copies
    kinds = {(i.kind, i.data.grad): set(i.data.values) for i in tp}
    assert all(v.startswith("pad_sequence") for v in kinds[(pn.Op.ALL_GATHER, False)])
    assert kinds[(pn.Op.REDUCE_SCATTER, True)] <= {v for i in tp for v in i.data.values
                                                    if v.startswith("pad_sequence")}
    assert kinds[(pn.Op.REDUCE_SCATTER, False)] and kinds[(pn.Op.ALL_GATHER, True)]
    assert plan.capture.tp.sums
    # the norm weights are read through copies made a part before, whose gradients the group
    # sums: a part of its own before each layer's first
    first = [r for r in plan.regions if dict(r.tags).get("PART") == 0 and dict(r.tags)["L"] == 1]
    assert first and first[0].inputs == () and first[0].params == ("blocks.0.norm1.weight",)
    assert plan.capture.tp.sequence
    assert pn.tensor_parallel({}, [0, 1], sequence_parallel=True).code().endswith(
        "sequence_parallel=True)")


def test_the_plan_simulates_and_round_trips_through_json():
    plan = compile_sp(llama())
    trace = pn.simulate(plan, pn.CostModel.uniform())
    assert trace.step_time > 0
    # a gather or a scatter moves half an all-reduce's bytes, so SP's pairs cost what TP's
    # all-reduces do (Korthikanti et al.), not twice that (links without latency: these
    # messages are tiny: the alpha-beta ring, not NCCL's per-collective base latency); the
    # inputs kept as slices are gathered once more before the backward
    # (`compiler.regather`), each as its forward's gather
    hw = dataclasses.replace(HARDWARE["H100"], nvlink_latency=0.0)
    whole = pn.compile(pn.annotate(llama(), LAYERS), [pn.tensor_parallel({}, [0, 1])],
                       llama().example_batch(batch_size=4, seed=0))

    def comm(p, again=False):
        ring = dataclasses.replace(pn.CostModel.analytic(p, hw), topology=None, contention=0)
        t = pn.simulate(p, ring)
        return sum(e.duration for e in t.events if e.device == 0 and e.stream == "tp"
                   and ("AG_R" in e.label) == again)
    assert 0.95 * comm(whole) < comm(plan) < 1.05 * comm(whole)
    gathers = [i for i in plan[0].instrs
               if i.purpose == pn.Purpose.TP and i.kind == pn.Op.ALL_GATHER]
    again = [i for i in gathers if i.data.regather]
    assert len(again) == 2 * 2 + 1   # QKV's and the MLP's input in each layer, the head's
    assert comm(plan, again=True) == pytest.approx(
        comm(plan) * len(again) / (len(gathers) - len(again)) / 2, rel=0.3)
    again = pn.Plan.from_json(plan.to_json())
    assert again.world == 2 and again.tp_groups == plan.tp_groups


def test_a_sequence_the_degree_cannot_divide_names_the_sizes():
    with pytest.raises(pn.PlanError, match=r"sequence of region .* \(6 tokens\) over 4 devices"
                                           r".*pad it to 8"):
        compile_sp(llama(seq=6, kv_heads=4), devices=(0, 1, 2, 3))


class _MeanOverSequence(nn.Module):
    """A block whose replicated part averages over the sequence (a pooled residual)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = x + self.down(F.relu(self.up(x)))
        return h - h.mean(dim=1, keepdim=True)


class _Seq(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.embed, self.block = nn.Embedding(16, 8), block
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def _loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _compile_seq(block, ann):
    model = _Seq(block)
    ids = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))
    return pn.compile(pn.annotate(model, ann), [pn.tensor_parallel(
        {}, [0, 1], plan={"block.up": "colwise", "block.down": "rowwise"},
        sequence_parallel=True)], (ids, ids), loss_fn=_loss)


def test_what_needs_the_whole_sequence_gets_it_laid_back_first():
    """A mean over the sequence in a replicated part (and a loss over every token) reads the
    whole sequence: the slices are laid back before it, in a part of its own after."""
    ann = {"embed": {"PP": 0, "L": 0}, "block": {"PP": 0, "L": 1}, "head": {"PP": 0, "L": 2}}
    plan = _compile_seq(_MeanOverSequence(), ann)
    block = [r for r in plan.regions if dict(r.tags)["L"] == 1]
    pads = [v for r in block for v in r.outputs if v.startswith("pad_sequence")]
    assert len(pads) >= 2   # before the MLP's colwise layer, and before the mean
    assert all(plan.values[v].shape == (2, 4, 8) for v in pads)


class _Bernoulli(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = x + self.down(F.relu(self.up(x)))
        return h * torch.bernoulli(torch.full_like(h, 0.5))


def test_a_random_op_on_slices_that_is_not_dropout_is_refused():
    ann = {"embed": {"PP": 0, "L": 0}, "block": {"PP": 0, "L": 1}, "head": {"PP": 0, "L": 2}}
    with pytest.raises(pn.PlanError, match="bernoulli|random"):
        _compile_seq(_Bernoulli(), ann)


def test_a_region_without_sequence_parallelism_after_one_gets_the_whole_sequence():
    model = llama()
    batch = model.example_batch(batch_size=4, seed=0)
    plan = pn.compile(pn.annotate(model, LAYERS), [
        pn.place({}, [0]), pn.tensor_parallel({"L": 1}, [0, 1], sequence_parallel=True),
        pn.tensor_parallel({"L": 2}, [0, 1])], batch)
    into = [v for r in plan.regions if dict(r.tags)["L"] == 2 for v in r.inputs]
    shapes = [plan.values[v].shape for v in into if len(plan.values[v].shape) == 3]
    assert shapes and all(s[1] == 8 for s in shapes)   # laid back whole on the way out
