"""Stamping a stack of identical layers (`capture.stamp`): the prefix exported, which
layers are stamped from which, and a stamped capture computing what the whole model
computes (loss and every parameter's gradient), for a plain stack (Llama), alternating
sliding and full attention (Gemma2, Mistral's window), dense and sparse layers mixed
(Qwen3-MoE with a dense first layer), and a stack whose layers differ only by their index
in the code (GPT-2 scaling attention by 1 / (layer_idx + 1)), which must not be stamped.
An 8-layer Llama stamped trains under PP 2 like one process."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
import piper_nb.capture.export as export_mod
import piper_nb.capture.stamp as stamp_mod
from piper_nb.capture.front_ends import front_end
from piper_nb.capture.loss import model_loss
from piper_nb.capture.stamp import find_stack, prefix

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 64, 8, 4
_COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, attn_implementation="eager",
               pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama(layers=8):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=layers,
                                                                  **_COMMON))


def gemma2(layers=8):
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        num_hidden_layers=layers, sliding_window=4, head_dim=8, **_COMMON))


def mistral(layers=6):
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        num_hidden_layers=layers, sliding_window=4, **_COMMON))


def qwen3_moe(layers=7):
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        num_hidden_layers=layers, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        decoder_sparse_step=1, mlp_only_layers=[0], head_dim=8, **_COMMON))


def gpt2(scaled: bool, layers=6):
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
        scale_attn_by_inverse_layer_idx=scaled))


def ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def test_the_prefix_holds_two_members_of_every_later_group_past_layer_0():
    assert prefix((0,) * 8) == 3                      # layers 1 and 2 compared
    assert prefix((0, 1) * 4) == 5                    # 1, 3 and 2, 4
    assert prefix((0, 1, 1, 1, 1, 1)) == 3            # a first layer of its own
    assert prefix((0, 0, 0, 1)) is None               # a group only at the end


def test_groups_follow_class_shapes_and_attention_type():
    torch.manual_seed(0)
    root = pn.capture.front_ends._WithLoss(gemma2(), model_loss, "microbatch")
    stack = find_stack(root)
    assert stack.path == "model.model.layers"
    assert stack.groups == (0, 1, 0, 1, 0, 1, 0, 1)   # sliding, full, ...
    assert stack.keep == 5 and stack.templates == {5: 3, 6: 4, 7: 3}
    root = pn.capture.front_ends._WithLoss(qwen3_moe(), model_loss, "microbatch")
    stack = find_stack(root)
    assert stack.groups == (0, 1, 1, 1, 1, 1, 1) and stack.keep == 3   # dense first layer


@pytest.fixture
def stamps(monkeypatch) -> list[bool]:
    """What each call of `stamp` returned while the test runs, in order."""
    calls: list[bool] = []
    real = export_mod.stamp

    def spy(gm, root, stack):
        calls.append(real(gm, root, stack))
        return calls[-1]
    monkeypatch.setattr(export_mod, "stamp", spy)
    return calls


def _capture(model, batch, stamps: list[bool]) -> tuple:
    """(the front end's graph, whether it was stamped)."""
    stamps.clear()
    fe = front_end(model, model_loss, {"inputs": batch, "targets": batch}, "export")
    return fe.gm, bool(stamps and stamps[-1])


@pytest.mark.parametrize("make,stamped", [(llama, True), (gemma2, True), (mistral, True),
                                          (qwen3_moe, True), (lambda: gpt2(False), True),
                                          (lambda: gpt2(True), False)],
                         ids=["llama", "gemma2", "mistral", "qwen3_moe", "gpt2", "gpt2_scaled"])
def test_a_stamped_capture_computes_what_the_model_computes(make, stamped, stamps):
    torch.manual_seed(0)
    model = make()
    batch = ids()
    gm, was = _capture(model, batch, stamps)
    assert was == stamped
    loss = gm(batch, batch)[0]
    loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    want = model(batch, labels=batch).loss
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=lambda m, n=n: f"{n}: {m}")


def test_a_stamped_graph_names_each_layers_own_module_path(stamps, monkeypatch):
    torch.manual_seed(0)
    model = llama()
    gm, was = _capture(model, ids(), stamps)
    assert was
    paths = {export_mod.export_module_path(n).split(".")[:3][-1] for n in gm.graph.nodes
             if export_mod.export_module_path(n).startswith("model.layers.")}
    assert paths == {str(i) for i in range(8)}
    monkeypatch.setattr(stamp_mod, "ENABLED", False)
    whole, was = _capture(model, ids(), stamps)
    assert not was
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert ops == [str(n.target) for n in whole.graph.nodes if n.op == "call_function"]


@pytest.mark.dist
def test_a_stamped_llama_trains_under_pp2_like_one_process(cluster2, one_thread, stamps, same):
    torch.manual_seed(0)
    model = llama()
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (8, SEQ), generator=g)
    batch = (x, torch.roll(x, -1, dims=1))
    opt = pn.optim.SGD(lr=0.05, momentum=0.9)
    ref = pn.reference_train(model, batch, steps=2, microbatches=4, optimizer=opt)
    ann = {"model.embed_tokens": {"PP": 0}, "model.norm": {"PP": 1}, "lm_head": {"PP": 1},
           **{f"model.layers.{i}": {"PP": i // 4} for i in range(8)}}
    plan = pn.compile(pn.annotate(model, ann), [
        pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
        *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batch)
    assert stamps == [True]
    same(pn.train(plan, batch, steps=2, optimizer=opt, cluster=cluster2), ref, model)


class _Stack(torch.nn.Module):
    """Six linear + tanh layers; `counted` makes forward insist on seeing all six."""

    def __init__(self, counted: bool):
        super().__init__()
        self.counted = counted
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()) for _ in range(6))

    def forward(self, x):
        if self.counted and len(self.layers) != 6:
            raise ValueError("this model runs six layers")
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("counted", [False, True])
def test_a_forward_that_needs_every_layer_is_exported_whole(counted, stamps):
    torch.manual_seed(0)
    model = _Stack(counted)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    fe = front_end(model, lambda out, t: ((out - t) ** 2).mean(), {"inputs": x, "targets": y},
                   "export")
    assert stamps == ([] if counted else [True])
    torch.testing.assert_close(fe.gm(x, y)[0], ((model(x) - y) ** 2).mean())


def test_layers_marked_by_pipe_split_or_region_scopes_are_not_stamped(stamps):
    """Stage marks numbered by position (pipe_split) or scopes set around each layer would
    be copied from the template: such a stack is exported whole, and its six stages stay."""
    from torch.distributed.pipelining import pipe_split

    class Split(_Stack):
        def forward(self, x):
            for i, layer in enumerate(self.layers):
                x = layer(x)
                if i < len(self.layers) - 1:
                    pipe_split()
            return x

    class Scoped(_Stack):
        def forward(self, x):
            for i, layer in enumerate(self.layers):
                with pn.region("PP", i // 3):
                    x = layer(x)
            return x

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    for make, stages in ((Split, 6), (Scoped, 2)):
        torch.manual_seed(0)
        model = make(False)
        stamps.clear()
        cap = pn.annotate(model, {}).capture(lambda out, t: ((out - t) ** 2).mean(),
                                             {"inputs": x, "targets": y}, "export")
        assert stamps == [False]
        assert len({dict(r.tags)["PP"] for r in cap.regions}) == stages
