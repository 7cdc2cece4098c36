"""Checkpoints in PyTorch's distributed format: a PP 2 x DP 2 ZeRO-3 run's checkpoint loads
into a plain model and optimizer with DCP's own API, resumes on other plans (tensor-parallel
with ZeRO-3, PP 4) training equal to one process, survives a SIGKILL in the middle of its
write, and the old format still resumes, with a note."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dist_cp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import piper_nb as pn
from piper_nb import schedules as S
from piper_nb.cluster import checkpoint as ck
from piper_nb.cluster import dcp
from piper_nb.cluster.dcp_layout import boxes
from piper_nb.cluster.local import LocalCluster

ROOT = Path(__file__).resolve().parents[2]
HALVES = {"embed": {"PP": 0}, "blocks.0": {"PP": 0}, "blocks.1": {"PP": 0},
          "blocks.2": {"PP": 1}, "blocks.3": {"PP": 1}, "head": {"PP": 1}}
QUARTERS = {"embed": {"PP": 0}, "blocks.0": {"PP": 0}, "blocks.1": {"PP": 1},
            "blocks.2": {"PP": 2}, "blocks.3": {"PP": 3}, "head": {"PP": 3}}
PP2_DP2_ZERO3 = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
                 pn.replicate({"PP": 0}, [0, 2], zero=3),
                 pn.replicate({"PP": 1}, [1, 3], zero=3), *S.one_f_one_b(2, 2)]
TP2_DP2_ZERO3 = [pn.replicate({}, [0, 2], zero=3), pn.tensor_parallel({}, [[0, 1], [2, 3]]),
                 pn.split({}, num=2)]
PP4 = [*(pn.place({"PP": i}, [i]) for i in range(4)), *S.one_f_one_b(4, 4)]


@pytest.fixture(scope="module")
def cluster4():
    with LocalCluster(4) as c:
        yield c


def _gpt(tied: bool = False):
    torch.manual_seed(0)
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=tied)
    return model, model.example_batch(batch_size=8, seed=0)


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 5), (2, 3, 2, 3), ()])
def test_boxes_cover_every_flat_range_once_in_order(shape):
    n = max(1, int(torch.tensor(shape).prod())) if shape else 1
    t = torch.arange(n).reshape(shape)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            flat = []
            for (offsets, sizes), a, b in boxes(shape, lo, hi):
                box = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                assert box.numel() == b - a and box.reshape(-1).tolist() == list(range(a, b))
                flat += box.reshape(-1).tolist()
            assert flat == list(range(lo, hi))


@pytest.mark.dist
@pytest.mark.parametrize("tied", [False, True])
def test_a_pp2_dp2_zero3_checkpoint_loads_into_plain_pytorch_with_dcp(cluster4, tmp_path, tied):
    model, batch = _gpt(tied)
    opt = functools.partial(torch.optim.AdamW, lr=1e-2)
    plan = pn.compile(pn.annotate(model, HALVES), PP2_DP2_ZERO3, batch)
    run = pn.train(plan, batch, 3, opt, cluster=cluster4, checkpoint_dir=tmp_path)
    path = ck.latest(tmp_path)
    assert path.name == "step-000003" and sorted(p.name for p in path.glob("*.distcp")) == [
        f"__{d}_0.distcp" for d in range(4)]                        # a file per device

    torch.manual_seed(1)                                            # other weights to load over
    plain = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=tied)
    optimizer = opt(plain.parameters())
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {**plain.state_dict(),
             "optimizer": get_optimizer_state_dict(plain, optimizer, options=options)}
    dist_cp.load(state, checkpoint_id=path)                         # DCP's own API
    set_optimizer_state_dict(plain, optimizer, state["optimizer"], options=options)

    params = dict(plain.named_parameters())
    assert params.keys() == run.params.keys()
    for name, p in params.items():
        assert torch.equal(p.detach(), run.params[name]), name
    for name, want in run.optimizer_state["state"].items():
        got = optimizer.state[params[name]]
        assert got.keys() == want.keys(), name
        for k, v in want.items():
            assert torch.equal(torch.as_tensor(got[k]), torch.as_tensor(v)), (name, k)


@pytest.mark.dist
def test_a_dcp_checkpoint_resumes_on_other_plans_equal_to_one_process(cluster4, tmp_path):
    """PP 2 x DP 2 ZeRO-3 writes step 2; TP 2 x DP 2 ZeRO-3 (fused qkv blocks inside ZeRO's
    flat shards) resumes to step 4 and writes; PP 4 resumes that to step 5."""
    model, batch = _gpt()
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = pn.reference_train(model, batch, 5, 4, opt)
    plans = [pn.compile(pn.annotate(model, ann), program, batch) for ann, program in
             ((HALVES, PP2_DP2_ZERO3), ({"": {"PP": 0}}, TP2_DP2_ZERO3), (QUARTERS, PP4))]
    assert plans[1].tp_params and plans[1].world == 4
    trained = []
    for plan, steps in zip(plans, (2, 4, 5), strict=True):
        run = pn.train(plan, batch, steps, opt, cluster=cluster4, checkpoint_dir=tmp_path,
                       resume=True, progress=lambda step, *_: trained.append(step))
        torch.testing.assert_close(run.losses, ref.losses[:steps], rtol=1e-5, atol=0)
    assert trained == [1, 2, 3, 4, 5]                               # each from the last
    assert [m.step for m in run.metrics] == [1, 2, 3, 4, 5]
    for name, want in ref.params.items():
        torch.testing.assert_close(run.params[name], want, rtol=1e-5, atol=1e-6)


WRITER = """
import os, sys, time, functools, torch, piper_nb as pn
from piper_nb.cluster import dcp
from piper_nb.cluster.local import LocalCluster

writes = []
real_write, real_resolve = dcp.write, dcp._Planner.resolve_data

def write(*args, **kwargs):
    writes.append(1)
    return real_write(*args, **kwargs)

def resolve(self, item):
    if len(writes) == 2 and len(self.data) > 4:     # the second checkpoint, partly on disk
        self.__dict__["n"] = self.__dict__.get("n", 0) + 1
        if self.n == 4:
            open(sys.argv[2], "w").close()
            time.sleep(120)
    return real_resolve(self, item)

dcp.write, dcp._Planner.resolve_data = write, resolve

if __name__ == "__main__":
    model = pn.models.MLP(dim=16, depth=4)
    batches = [model.example_batch(batch_size=8, seed=s) for s in range(3)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                       *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batches[0])
    with LocalCluster(2) as cluster:
        pn.train(plan, batches, 3, pn.optim.AdamW(1e-2), cluster=cluster,
                 checkpoint_dir=sys.argv[1])
"""


@pytest.mark.dist
def test_a_sigkill_in_the_middle_of_a_write_leaves_the_previous_checkpoint(tmp_path):
    script, marker, ckpts = tmp_path / "writer.py", tmp_path / "writing", tmp_path / "ckpt"
    script.write_text(textwrap.dedent(WRITER))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script), str(ckpts), str(marker)], env=env,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), proc.communicate(timeout=10)[0]
        os.kill(proc.pid, signal.SIGKILL)                       # the writer, mid-write
        proc.wait(timeout=30)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)                 # its workers
        except ProcessLookupError:
            pass
    torn = [p for p in ckpts.iterdir() if p.name.startswith(".step-000002")]
    assert torn and any(torn[0].glob("*.distcp"))               # killed with files half written
    assert [s for s, _ in ck.checkpoints(ckpts)] == [1]
    whole, side = dcp.read(ck.latest(ckpts))
    assert int(whole["train_state.step"]) == side["step"] == 1

    model = pn.models.MLP(dim=16, depth=4)
    batches = [model.example_batch(batch_size=8, seed=s) for s in range(3)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)),
                      [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                       *S.one_f_one_b(ranks=2, microbatches=4)], batches[0])
    with LocalCluster(2) as cluster:
        full = pn.train(plan, batches, 3, pn.optim.AdamW(1e-2), cluster=cluster)
        resumed = pn.train(plan, batches, 3, pn.optim.AdamW(1e-2), cluster=cluster,
                           checkpoint_dir=ckpts, resume=True)
    assert resumed.losses == full.losses
    for name, want in full.params.items():
        assert torch.equal(resumed.params[name], want), name
    assert not any(p.name.startswith(".step-") for p in ckpts.iterdir())   # swept on write


@pytest.mark.dist
def test_a_checkpoint_in_the_old_format_still_resumes_with_a_note(cluster4, tmp_path):
    model, batch = _gpt()
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    plan = pn.compile(pn.annotate(model, HALVES), PP2_DP2_ZERO3, batch)
    full = pn.train(plan, batch, 3, opt, cluster=cluster4)
    pn.train(plan, batch, 2, opt, cluster=cluster4, checkpoint_dir=tmp_path,
             checkpoint_format="piper_nb")
    assert ck.latest(tmp_path).name == "step-000002.pt"
    with pytest.warns(UserWarning, match="piper_nb's own checkpoint format, which still "
                                         "resumes this run; .* PyTorch's DCP"):
        run = pn.train(plan, batch, 3, opt, cluster=cluster4, checkpoint_dir=tmp_path,
                       resume=True)
    assert run.losses == full.losses
    assert ck.latest(tmp_path).name == "step-000003"               # written as DCP from now on
    with pytest.raises(ValueError, match="checkpoint_format"):
        pn.train(plan, batch, 3, opt, cluster=cluster4, checkpoint_dir=tmp_path,
                 checkpoint_format="safetensors")


@pytest.mark.dist
def test_a_bf16_run_resumes_bit_for_bit_from_its_fp32_masters(cluster4, tmp_path):
    """bf16 weights, fp32 masters (`optimizer.state.<name>.master`) and momenta round
    trip: the same plan resumed ends where the uninterrupted run does, bit for bit; PP 4
    resumes it as close to one bf16 process as bf16 allows. (SGD: Adam would turn the
    zero gradient of the key bias, rounded differently by each plan, into steps of lr.)"""
    model, batch = _gpt()
    opt = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    plan = pn.compile(pn.annotate(model, HALVES), PP2_DP2_ZERO3, batch, precision="bf16")
    full = pn.train(plan, batch, 4, opt, cluster=cluster4)
    pn.train(plan, batch, 2, opt, cluster=cluster4, checkpoint_dir=tmp_path)
    shutil.copytree(ck.latest(tmp_path), tmp_path / "pp4" / "step-000002")  # for PP 4 below
    whole, _ = dcp.read(ck.latest(tmp_path))
    name = "blocks.0.mlp.0.weight"
    assert whole[name].dtype == torch.bfloat16
    assert whole[f"optimizer.state.{name}.master"].dtype == torch.float32
    assert torch.equal(whole[f"optimizer.state.{name}.master"].bfloat16(), whole[name])
    again = pn.train(plan, batch, 4, opt, cluster=cluster4, checkpoint_dir=tmp_path,
                     resume=True)
    assert again.losses == full.losses
    for n, want in full.params.items():
        assert torch.equal(again.params[n], want), n
    pp4 = pn.compile(pn.annotate(model, QUARTERS), PP4, batch, precision="bf16")
    ref = pn.reference_train(model, batch, 4, 4, opt, precision="bf16")
    resumed = pn.train(pp4, batch, 4, opt, cluster=cluster4, checkpoint_dir=tmp_path / "pp4",
                       resume=True)
    torch.testing.assert_close(resumed.losses, ref.losses, rtol=2e-2, atol=2e-2)
    for n, want in ref.params.items():
        torch.testing.assert_close(resumed.params[n].float(), want.float(), rtol=2e-2,
                                   atol=2e-2)


@pytest.mark.dist
def test_a_transformers_llama_on_tp2_dp2_zero1_loads_into_a_plain_llama(cluster4, tmp_path):
    """Llama from transformers on its own TP plan, TP 2 x DP 2 with ZeRO-1 (Adam moments as
    flat pieces of tensor-parallel shards): DCP's API loads the checkpoint into a fresh
    `LlamaForCausalLM` and its optimizer, equal to the run bit for bit."""
    transformers = pytest.importorskip("transformers")
    config = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    ids = torch.randint(3, 32, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    opt = functools.partial(torch.optim.AdamW, lr=1e-2)
    plan = pn.compile(pn.annotate(model, {"": {"PP": 0}}),
                      [pn.replicate({}, [0, 2], zero=1),
                       pn.tensor_parallel({}, [[0, 1], [2, 3]]), pn.split({}, num=2)], batch)
    assert "lm_head.weight" in plan.tp_params
    run = pn.train(plan, batch, 2, opt, cluster=cluster4, checkpoint_dir=tmp_path)
    torch.manual_seed(1)
    plain = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    optimizer = opt(plain.parameters())
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    state = {**plain.state_dict(),
             "optimizer": get_optimizer_state_dict(plain, optimizer, options=options)}
    dist_cp.load(state, checkpoint_id=ck.latest(tmp_path))
    set_optimizer_state_dict(plain, optimizer, state["optimizer"], options=options)
    params = dict(plain.named_parameters())
    for name, p in params.items():
        assert torch.equal(p.detach(), run.params[name]), name
    for name, want in run.optimizer_state["state"].items():
        for k, v in want.items():
            got = optimizer.state[params[name]][k]
            assert torch.equal(torch.as_tensor(got), torch.as_tensor(v)), (name, k)
