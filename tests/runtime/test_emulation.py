"""NCCL emulated on CPU (`LocalCluster(comm="nccl-emulated")`): the runtime executes the stream
program and nothing else, as one thread per stream with FIFO communicators; a plan that
would hang on GPUs hangs here and is reported with its stuck streams; a tensor a CUDA
worker would hold on the host is refused before NCCL sees it."""

from __future__ import annotations

import dataclasses
import datetime
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import piper_nb as pn
from piper_nb.cluster.local import LocalCluster
from piper_nb.host import free_port

pytestmark = pytest.mark.dist
S = pn.schedules


@pytest.fixture(scope="module")
def emulated4():
    with LocalCluster(4, comm="nccl-emulated", timeout=120) as cluster:
        yield cluster


def _mlp_plan(stages: int, program, batch_size: int = 16):
    model = pn.models.MLP(dim=8, depth=stages)
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    batch = model.example_batch(batch_size, seed=0)
    return model, batch, pn.compile(spec, program, batch)


PROGRAMS = {
    "gpipe": (4, lambda: S.gpipe(4, 4, place=True)),
    "1f1b": (4, lambda: S.one_f_one_b(4, 4, place=True)),
    "interleaved": (8, lambda: S.interleaved_1f1b(4, 4, chunks=2, place=True)),
    "zb1p": (4, lambda: S.zero_bubble(4, 4, place=True)),
    "dualpipev": (8, lambda: S.dualpipev(4, 8, place=True)),
    "dualpipe": (4, lambda: S.dualpipe(4, 8, place=True)),
}


def _executed_equals_the_program(plan, outs) -> None:
    """What each stream of each device executed, in order, is the program's stream."""
    for d, out in enumerate(outs[:plan.world]):
        want = plan.streams()[d].streams()
        got = {k: tuple(v) for k, v in out["streams"].items()}
        assert got.keys() == want.keys(), d
        for stream in want:
            assert got[stream] == want[stream], (d, stream)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_every_builder_runs_exactly_its_stream_program_and_trains_like_one_process(
        name, emulated4, same):
    stages, program = PROGRAMS[name]
    model, batch, plan = _mlp_plan(stages, program())
    opt = pn.optim.SGD(0.1, momentum=0.9)
    emulated4.reset(plan, opt)
    _executed_equals_the_program(plan, emulated4.step(plan, batch, record_streams=True))
    result = pn.train(plan, batch, steps=2, optimizer=opt, cluster=emulated4)
    same(result, pn.reference_train(model, batch, 2, plan.microbatches, opt), model)


@pytest.mark.parametrize("strategy", ["pp2-dp2-zero3", "pp2-dp2-ep2"])
def test_data_and_expert_parallel_plans_run_their_programs(strategy, emulated4):
    from piper_nb.strategies import compile_strategy
    plan, batch = compile_strategy(strategy)
    emulated4.reset(plan, pn.optim.SGD(0.1))
    _executed_equals_the_program(plan, emulated4.step(plan, batch, record_streams=True))


@pytest.mark.full
def test_the_old_on_stream_coupling_hangs_and_the_stuck_streams_are_named(coupled):
    """The negative control: the runtime's former stream use, as a stream program."""
    model, batch, plan = _mlp_plan(2, S.one_f_one_b(2, 4, place=True))
    bad = dataclasses.replace(plan, stream_program=coupled(plan))
    with LocalCluster(2, comm="nccl-emulated", timeout=12) as cluster:
        with pytest.raises(pn.RuntimeFailure) as info:
            pn.train(bad, batch, steps=1, optimizer=pn.optim.SGD(0.1), cluster=cluster)
    text = str(info.value)
    assert "NCCL emulation" in text and "a GPU cluster would hang here" in text
    assert "pp: at wait(d" in text            # the pp stream waits for its own transfer:
    # the receive a peer cannot send yet; whichever device's bounded wait ends first reports
    recv, peer, link = {0: ("RECV_B0<1", 1, "p2p:1>0"),
                        1: ("RECV_F1<0", 0, "p2p:0>1")}[info.value.device]
    assert f"{recv} to complete" in text
    assert f"waiting for device {peer} to run its matching operation on {link}" in text


class SizeAcross(nn.Module):
    """The part after the experts reshapes by `h.shape`: placed on another device than the
    part that computed it, a size crosses devices as a tensor (`capture.split.pack_size`)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with pn.region("PP", 0):
            h = self.a(x)
            flat = h.reshape(-1, h.size(-1))
        with pn.region("EP", 0):
            e = self.b(flat)
        with pn.region("PP", 0):
            return self.c(e).reshape(h.shape) + h

    def loss_fn(self, out, y):
        return nn.functional.mse_loss(out, y)


def _size_plan():
    model = SizeAcross()
    batch = (torch.randn(8, 3, 4), torch.randn(8, 3, 4))
    program = [pn.place({"PP": 0, "SEG": 0}, [0]), pn.place({"EP": 0}, [0]),
               pn.place({"PP": 0, "SEG": 1}, [1]), pn.split({}, "MB", 2)]
    return model, batch, pn.compile(pn.annotate(model), program, batch)


def test_a_size_crossing_stages_is_sent_from_the_device(same):
    model, batch, plan = _size_plan()
    sizes = [v for v, info in plan.values.items() if info.dtype == "uint8"]
    assert sizes and any(set(sizes) & set(i.data.values) for i in plan[0].instrs if i.kind == "SEND")
    opt = pn.optim.SGD(0.1)
    with LocalCluster(2, comm="nccl-emulated", timeout=60) as cluster:
        result = pn.train(plan, batch, steps=2, optimizer=opt, cluster=cluster)
    same(result, pn.reference_train(model, batch, 2, plan.microbatches, opt))


def _host_size_rank(rank: int, port: int, blob: bytes, out) -> None:
    """A worker whose region outputs stay where they were made (as before sizes moved)."""
    import piper_nb.runtime.compute as compute
    from piper_nb.runtime.bundle import load_bundle
    from piper_nb.runtime.comm import Comm
    from piper_nb.runtime.worker import Worker
    compute.on_device = lambda t, device: t
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        worker = Worker(rank, load_bundle(blob), Comm(rank, torch.device("cpu"), "gloo",
                                                      emulated=True), torch.device("cpu"), 10)
        worker.reset(pn.optim.SGD(0.1))
        bundle = load_bundle(blob)
        batch = tuple(torch.randn(8, 3, 4) for _ in bundle.plan.batch_names)
        worker.step(batch)
        out.put((rank, "ok"))
    except Exception as err:
        out.put((rank, f"{type(err).__name__}: {err}"))
    finally:
        sys.stdout.flush()


def test_a_host_tensor_given_to_nccl_is_an_error():
    from piper_nb.runtime.bundle import make_bundle
    _, _, plan = _size_plan()
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_host_size_rank, args=(r, port, make_bundle(plan), out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert "would hold on the host" in got[0] and "NCCL refuses CPU tensors" in got[0]
    assert "r0:SEND_F0>1" in got[0]
