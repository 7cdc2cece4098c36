"""The worker process: joins the process group, then serves the driver's commands.

A launcher (`pn.LocalCluster`, or an ipyparallel engine) starts `serve` once per rank. The
driver sends `(op, key, payload)` over a pipe: `load` a pickled `Bundle` (once per plan,
under `key`), `reset` parameters and optimizer, `step` on a batch, `state` to export the
parameters, `train_state` / `load_train_state` for checkpoints, `stop`. Every answer goes
to one shared results queue as `(rank, "ok" | "error" | "ready", pickled payload)`; an
error names the instruction that was running. After an error the worker keeps listening:
the driver decides (it stops or kills the whole group, since peers may be blocked in a
transfer with this one).

On CPU, `host.core_plan` gives each worker a core of its own when there are enough
(`pin_threads` at start-up, so gloo's threads, made later, inherit it): each rank's main
thread and gloo's threads then share its core and no other rank's, and steps come out
steadier (`benchmarks/bench_pinning.py`).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import traceback

import torch
import torch.distributed as dist

from piper_nb.host import pin_threads, usable_cores
from piper_nb.runtime.bundle import load_bundle
from piper_nb.runtime.comm import Comm
from piper_nb.runtime.worker import Worker

__all__ = ["serve", "pick_device", "execute", "describe"]

_LISTENERS: list[socket.socket] = []


def pick_device(kind: str, rank: int, world: int, local_rank: int | None = None,
                backend: str | None = None) -> tuple[torch.device, str]:
    """(device, backend) for `rank`: CUDA ranks share GPUs round-robin (by `local_rank` when
    ranks span machines); NCCL needs one each, so several ranks on one GPU use gloo, which
    stages buffers through host memory. `backend` overrides the choice (every rank of a group
    must agree, so a launcher spanning machines decides it)."""
    if kind == "cuda":
        count = torch.cuda.device_count()
        if count == 0:
            raise RuntimeError("device='cuda' but this machine has no CUDA device")
        device = torch.device("cuda", (rank if local_rank is None else local_rank) % count)
        torch.cuda.set_device(device)
        return device, backend or ("nccl" if count >= world else "gloo")
    return torch.device("cpu"), "gloo"


def _store(host: str, port: int, rank: int, world: int, timeout: datetime.timedelta):
    """The rendezvous store at `host:port`; rank 0 serves it on `host` only (a plain
    `tcp://` init would listen on every interface)."""
    if rank != 0:
        return dist.TCPStore(host, port, world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen()
    _LISTENERS.append(sock)  # the store serves on this socket's descriptor: keep it open
    return dist.TCPStore(host, port, world, True, timeout=timeout, master_listen_fd=sock.fileno())


def _warm_up() -> None:
    """Pay autograd's lazy imports now (backward with explicit gradients pulls in sympy,
    about a second), so the first measured step is not an outlier."""
    x = torch.ones(2, requires_grad=True)
    torch.autograd.backward([x * 2], [torch.ones(2)])


def describe(err: BaseException, worker: Worker | None) -> dict:
    """A worker's error as its driver reports it: the instruction, the error, the traceback."""
    instr = None
    if worker is not None and worker.current >= 0:
        instr = worker.text(worker.current)
    return {"instruction": instr, "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc()}


def execute(workers: dict, op: str, key, payload, make_worker):
    """One driver command on this rank's `workers` (by plan key): `load` makes one with
    `make_worker(bundle blob)`; the answer to send back (None for most)."""
    worker = workers.get(key)
    if op == "load":
        workers[key] = make_worker(payload)
    elif op == "unload":
        workers.pop(key, None)
    elif op == "reset":
        worker.reset(*payload)
    elif op == "step":
        return worker.step(*payload)
    elif op == "state":
        return worker.export_state()
    elif op == "train_state":
        return worker.train_state()
    elif op == "load_train_state":
        worker.load_train_state(payload)
    else:
        raise ValueError(f"unknown command {op!r}")
    return None


def _put(results, rank: int, kind: str, payload) -> None:
    results.put((rank, kind, pickle.dumps(payload)))


def serve(rank: int, world: int, port: int, device_kind: str, conn, results,
          timeout: float, threads: int = 1, *, host: str = "127.0.0.1",
          local_rank: int | None = None, backend: str | None = None,
          cores: tuple[int, ...] | None = None, comm: str = "native") -> None:
    """Run worker `rank` of `world` until the driver says stop or goes away. The group meets
    at `host:port` (rank 0's machine); `local_rank` picks the GPU on this machine; `cores`
    (from `core_plan`) pins the process before any of torch's or gloo's threads start;
    `comm="nccl-emulated"` runs NCCL's semantics over gloo (`runtime.emulation`)."""
    own_core = bool(cores) and len(cores) == 1 and world <= len(usable_cores())
    pin_threads(cores)
    torch.set_num_threads(threads)
    _warm_up()
    try:
        device, backend = pick_device(device_kind, rank, world, local_rank, backend)
        limit = datetime.timedelta(seconds=timeout)
        # NCCL: bound to this rank's GPU, so communicators are made eagerly, not at first use
        bound = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=_store(host, port, rank, world, limit), rank=rank,
                                world_size=world, timeout=limit, **bound)
        channel = Comm(rank, device, backend, emulated=comm == "nccl-emulated")
        channel.own_core = own_core and device.type == "cpu"
    except BaseException as err:  # report, then let the driver clean up
        _put(results, rank, "error", describe(err, None))
        return
    _put(results, rank, "ready", {"backend": backend, "device": str(device), "pid": os.getpid(),
                                  "cores": list(cores) if cores else None})
    workers: dict[int, Worker] = {}
    while True:
        try:
            op, key, payload = conn.recv()
        except (EOFError, OSError):
            break  # the driver is gone
        if op == "stop":
            break
        try:
            out = execute(workers, op, key, payload,
                          lambda blob: Worker(rank, load_bundle(blob), channel, device, timeout))
            _put(results, rank, "ok", out)
        except BaseException as err:
            _put(results, rank, "error", describe(err, workers.get(key)))
    try:
        dist.destroy_process_group()
    except Exception:  # the group may be broken after a failure; the process ends anyway
        pass
    # a normal interpreter exit spends ~2 s in torch's and gloo's teardown: flush and leave
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
