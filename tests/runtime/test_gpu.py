"""The runtime on CUDA: one rank with NCCL, two ranks sharing one GPU through gloo
(buffers staged via host memory), and, where the machine has the GPUs, NCCL data
parallel, pipelines (point-to-point) and PP x DP, each against the CPU reference;
CUDA-event timing. Skipped without CUDA (and each multi-GPU case without its GPUs)."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb import optim
from piper_nb.cluster.local import LocalCluster
from piper_nb.train import reference_train, train

pytestmark = [pytest.mark.gpu, pytest.mark.dist,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _gpt():
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=False)
    return model, model.example_batch(batch_size=8, seed=0)


def _compare(result, ref):
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses), **TOL)
    got = result.state_dict()
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(got[name], value, **TOL)
    assert result.leftover == []
    for e in result.trace.events:
        assert 0 <= e.start <= e.end <= result.step_times[-1] + 1e-3


def test_single_rank_nccl():
    model, batch = _gpt()
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.place({}, [0]), pn.split({}, "MB", 4)], batch)
    opt = optim.AdamW(1e-3)
    with LocalCluster(1, device="cuda") as cluster:
        assert cluster.info[0]["backend"] == "nccl" and cluster.info[0]["device"] == "cuda:0"
        result = train(plan, batch, 3, opt, cluster=cluster)
    _compare(result, reference_train(model, batch, 3, 4, opt))


@pytest.mark.parametrize("reduce_dtype", ["fp32", "bf16"])
def test_bf16_on_one_gpu_trains_like_the_bf16_reference(reduce_dtype):
    """bf16 on CUDA (two ranks through gloo staging, so both reduction dtypes cross a real
    process group); bf16 tolerance as tests/runtime/test_precision.py explains."""
    model, batch = _gpt()
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    plan = pn.compile(spec, [pn.replicate({}, [0, 1], zero=1), pn.split({}, "MB", 2)], batch,
                      precision="bf16", reduce_dtype=reduce_dtype)
    opt = optim.SGD(0.05, momentum=0.9)
    with LocalCluster(2, device="cuda") as cluster:
        result = train(plan, batch, 3, opt, cluster=cluster, clip_grad_norm=1.0)
    ref = reference_train(model, batch, 3, 2, opt, precision="bf16", clip_grad_norm=1.0)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=1.6e-2, atol=0)
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(result.state_dict()[name], value, rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize("zero", [0, 3])
def test_two_ranks_share_one_gpu(zero):
    model, batch = _gpt()
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [pn.replicate({}, [0, 1], zero=zero), pn.split({}, "MB", 2)]
    plan = pn.compile(spec, program, batch)
    opt = optim.SGD(0.1, momentum=0.9)
    with LocalCluster(2, device="cuda") as cluster:
        result = train(plan, batch, 3, opt, cluster=cluster)
        pipe = pn.compile(spec, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                                 *pn.schedules.one_f_one_b(ranks=2, microbatches=4)], batch)
        piped = train(pipe, batch, 3, opt, cluster=cluster)
    _compare(result, reference_train(model, batch, 3, 2, opt))
    _compare(piped, reference_train(model, batch, 3, 4, opt))


def _nccl(stages: int, program, world: int) -> None:
    """Train `program` on `world` ranks, one GPU each over NCCL; compare with the reference."""
    model, batch = _gpt()
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, stages)), program, batch)
    opt = optim.AdamW(1e-3)
    with LocalCluster(world, device="cuda") as cluster:
        assert {i["backend"] for i in cluster.info} == {"nccl"}
        result = train(plan, batch, 3, opt, cluster=cluster)
    _compare(result, reference_train(model, batch, 3, plan.microbatches, opt))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
def test_two_ranks_nccl_data_parallel_zero3():
    _nccl(2, [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)], 2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU per rank")
@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev"])
def test_two_ranks_nccl_pipeline(schedule):
    """NCCL point-to-point: each direction of the pair on its own communicator."""
    if schedule == "dualpipev":
        _nccl(4, pn.schedules.dualpipev(2, 4, place=True), 2)
    else:
        _nccl(2, pn.schedules.one_f_one_b(2, 4, place=True), 2)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="NCCL needs one GPU per rank")
def test_four_ranks_nccl_pp2_dp2_zero3():
    _nccl(2, [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
              pn.replicate({"PP": 0}, [0, 2], zero=3), pn.replicate({"PP": 1}, [1, 3], zero=3),
              *pn.schedules.one_f_one_b(2, 4)], 4)
