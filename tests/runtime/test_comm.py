"""The communicator layout NCCL needs, run on gloo by two real processes: one group per
direction of a pair (a receive waiting on one direction does not hold up the other), the
collective groups and token-count groups made and warmed up once, at load. (On gloo the
runtime keeps point-to-point on the default group: gloo matches by tag.)"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from piper_nb.host import free_port
from piper_nb.runtime.comm import Comm, Pending

pytestmark = pytest.mark.dist


def _rank(rank: int, port: int, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        comm = Comm(rank, torch.device("cpu"), "gloo", per_direction=True)   # NCCL's layout
        comms = ["group:0,1", "p2p:0>1", "p2p:1>0"]   # as plan.streams.communicators orders
        comm.ensure_groups(comms, counted=[(0, 1)])
        made = (len(comm.groups), len(comm.pairs), len(comm.cpu_groups))
        comm.ensure_groups(comms, counted=[(0, 1)])   # idempotent
        assert (len(comm.groups), len(comm.pairs), len(comm.cpu_groups)) == made
        assert comm.pairs[(0, 1)] is not comm.pairs[(1, 0)]
        peer = 1 - rank
        # each rank posts its receive first, then sends: with both directions on one
        # in-order stream this would wait forever; on two it cannot
        recv = comm.recv([((3,), torch.float32)], peer, tag=5, comm=f"p2p:{peer}>{rank}")
        works = comm.start(recv)
        sent = comm.start(comm.send([torch.full((3,), float(rank))], peer, tag=5,
                                    comm=f"p2p:{rank}>{peer}"))
        comm.wait_works(works, 30.0)
        got = comm.results(Pending(0, works, recv.bufs, 0.0))
        for w in sent:
            w.wait()
        counts = comm.gather_counts([rank + 1, 7], (0, 1))
        out.put((rank, made, float(got[0][0]), counts))
    finally:
        dist.destroy_process_group()


def test_each_direction_of_a_pair_has_its_own_group_made_once_at_load():
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, rest) for r, *rest in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, (made, got, counts) in results.items():
        assert made == (1, 2, 1)
        assert got == float(1 - rank)
        assert counts == [[1, 7], [2, 7]]


def test_blocking_wait_is_refused_where_nccl_runs(monkeypatch):
    """TORCH_NCCL_BLOCKING_WAIT=1 makes the host block at every WAIT right after the issue:
    not the stream program the checks approved. Refused where NCCL (or its emulation) runs."""
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    with pytest.raises(RuntimeError, match="TORCH_NCCL_BLOCKING_WAIT is set.*Unset it"):
        Comm(0, torch.device("cpu"), "gloo", emulated=True)
    Comm(0, torch.device("cpu"), "gloo")   # gloo itself never reads it
