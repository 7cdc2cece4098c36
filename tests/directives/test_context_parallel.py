"""`pn.context_parallel` before anything runs: the parts and collectives it compiles to,
its JSON and the plan's, and a PlanError for every plan it cannot hold (a sequence the load
balance cannot cut, an attention it cannot rewrite, regions left whole, one device, tensor
parallelism beside it)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
from piper_nb.plan.plan import Plan

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "runtime"))
from plain import Attend  # noqa: E402

ONE = {"": {"PP": 0}}


def llama(**kw):
    return pn.models.Llama(**(dict(vocab=32, dim=32, layers=2, heads=4, kv_heads=2,
                                   hidden=64, seq=16) | kw))


def compile_cp(model, program, ann=ONE, batch_size=4):
    return pn.compile(pn.annotate(model, ann), program,
                      model.example_batch(batch_size=batch_size, seed=0))


def test_each_attention_cuts_its_layer_with_a_gather_each_way():
    plan = compile_cp(llama(layers=1), [pn.context_parallel({}, [0, 1]), pn.split({}, num=2)])
    assert [dict(r.tags)["PART"] for r in plan.regions] == [0, 1]
    # the first part reads the batch, cut along the sequence on each device
    assert [r.context for r in plan.regions] == [(2, "zigzag", ("inputs", "targets")),
                                                 (2, "zigzag", ())]
    for d in (0, 1):   # both members gather, and reduce-scatter in the backward
        assert plan[d].text()[:6] == ["r0:F0", "r0:AG_F0", "r1:F0", "r1:B0", "r1:RS_B0",
                                      "r0:B0"]
    again = Plan.from_json(plan.to_json())
    assert [r.context for r in again.regions] == [r.context for r in plan.regions]


def test_a_sequence_the_balance_cannot_cut_is_refused():
    with pytest.raises(pn.PlanError, match=r"16 tokens into 32 chunks .*pad the sequence to 32"):
        compile_cp(llama(), [pn.context_parallel({}, list(range(16)))])
    with pytest.raises(pn.PlanError, match="into 3 chunks"):
        compile_cp(llama(), [pn.context_parallel({}, [0, 1, 2], load_balance="contiguous")])


@pytest.mark.parametrize("model,words", [
    (Attend(mask="sdpa-window"), "its mask is not causal"),
    (Attend(dropout=0.1), "applies dropout"),
    (Attend(eager=True, mask="window"), "its mask is not causal"),
    (pn.models.MegatronGPT(vocab=32, dim=32, layers=1, heads=4, seq=16),
     "computes from the probabilities before their product with v"),
], ids=["mask", "dropout", "window", "eager-dropout"])
def test_an_attention_it_cannot_rewrite_is_refused_by_name(model, words):
    with pytest.raises(pn.PlanError, match=words) as err:
        compile_cp(model, [pn.context_parallel({}, [0, 1])])
    assert "context_parallel: region" in str(err.value)


def test_what_it_cannot_hold_is_a_plan_error():
    model = llama()
    with pytest.raises(pn.PlanError, match="leaves out regions"):
        compile_cp(model, [pn.context_parallel({"PP": 0}, [0, 1]), pn.place({"PP": 1}, [2])],
                   ann=pn.cut_stages(model, 2))
    with pytest.raises(pn.PlanError, match="is one device"):
        pn.context_parallel({}, [0])
    with pytest.raises(pn.PlanError, match="load_balance is one of zigzag, contiguous"):
        pn.context_parallel({}, [0, 1], load_balance="striped")
    # with TP, the context runs over the TP groups' first devices
    fix = r"context_parallel\(\{\}, \[0, 2\]\) with tensor_parallel\(\{\}, \[\[0, 1\], \[2, 3\]\]\)"
    with pytest.raises(pn.PlanError, match="device 1 of context group .* is a member of the "
                                           "tensor-parallel group .*" + fix):
        compile_cp(model, [pn.tensor_parallel({}, [0, 1]), pn.context_parallel({}, [0, 1])])
    with pytest.raises(pn.PlanError, match="device 2 of context group .* leads no "
                                           "tensor-parallel group.*" + fix):
        compile_cp(model, [pn.tensor_parallel({}, [0, 1]), pn.context_parallel({}, [0, 2])])
    with pytest.raises(pn.PlanError, match="rand_like.*draws random numbers on a device's "
                                           "share of the sequence"):
        compile_cp(Attend(noise=True), [pn.context_parallel({}, [0, 1])])


def test_a_dropout_on_a_share_draws_the_whole_sequences_mask():
    plan = compile_cp(Attend(embed_dropout=0.3), [pn.context_parallel({}, [0, 1])])
    code = "".join(m.code for m in plan.capture.modules)
    assert "share_dropout" in code and "F.dropout" not in code


class Pool(nn.Module):
    """Tokens mixed outside attention: a mean over the sequence (`"mean"`), a running sum
    along it (`"cumsum"`) or a linear layer across it (`"across"`)."""

    def __init__(self, how: str):
        super().__init__()
        self.embed, self.head, self.how = nn.Embedding(32, 16), nn.Linear(16, 32), how
        if how == "across":
            self.across = nn.Linear(16, 16)

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.how == "mean":
            x = x + x.mean(dim=1, keepdim=True)
        elif self.how == "cumsum":
            x = x.cumsum(dim=1)
        else:
            x = self.across(x.transpose(1, 2)).transpose(1, 2)
        return self.head(x)


@pytest.mark.parametrize("how", ["mean", "cumsum", "across"])
def test_tokens_mixed_outside_attention_are_refused(how):
    tokens = torch.randint(0, 32, (4, 16))
    with pytest.raises(pn.PlanError, match="mixes the tokens (of|across) the sequence"):
        pn.compile(pn.annotate(Pool(how), ONE), [pn.context_parallel({}, [0, 1])],
                   (tokens, tokens), loss_fn=lambda out, t: F.cross_entropy(
                       out.flatten(0, 1), t.flatten()))
