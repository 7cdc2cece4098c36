"""The peers of `bench_runtime.py`: PyTorch's own distributed training, one process per rank.

`PeerGroup(case, world)` spawns `world` processes (torch.multiprocessing, spawn context),
each joining its own gloo group on 127.0.0.1 with one intra-op thread, and builds one of:

* "eager"      one rank, a plain loop: forward and backward per microbatch, then the step
* "1f1b"       `torch.distributed.pipelining.Schedule1F1B`, one `PipelineStage` per rank
* "dualpipev"  `ScheduleDualPipeV`, stages r and 2N-1-r on rank r (V-style placement)
* "ddp"        `DistributedDataParallel`, `no_sync()` on all but the last microbatch
* "fsdp2"      `fully_shard` on the root only (`case["wrap"] == "root"`, the default: one
               parameter group, like piper_nb's one bucket) or per layer + root ("layers"),
               with its defaults: reduce-scatter every microbatch, parameters resharded after
               backward (the root is not resharded after forward; FSDP2 skips that for the
               root since backward needs them at once): ZeRO-3 state, like piper_nb's plan
* "fsdp2_acc"  the same, with `set_requires_gradient_sync(False)` and
               `set_reshard_after_backward(False)` on all but the last microbatch (FSDP2's
               gradient-accumulation recipe: unsharded params and grads between microbatches)

A kind with `+compile` (`"eager+compile"`, `"1f1b+compile"`, `"fsdp2+compile"`) compiles
with `torch.compile` (inductor) what torchtitan's `apply_compile` compiles: each layer of
the model, before the stages are cut and before `fully_shard`.

All with `torch.optim.SGD(lr)`. Processes are pinned to cores exactly as `pn.LocalCluster`
pins its workers (`runtime.process.core_plan`, same `pin` argument), so placement is no
difference between the systems. `run(k)` trains k steps; every step is timed like piper_nb's
workers do it: a barrier, then wall time on each rank from there to the end of its
optimizer step; the step time is the maximum over ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
import traceback

import torch
import torch.multiprocessing as mp

from piper_nb.host import core_plan, free_port, pin_threads

__all__ = ["PeerGroup", "KINDS"]

KINDS = ("eager", "1f1b", "dualpipev", "ddp", "fsdp2", "fsdp2_acc")
COMPILED = "+compile"


def _compile_layers(model) -> None:
    """Each layer through torch.compile, in place (torchtitan's `apply_compile`)."""
    for i, layer in enumerate(model.layers):
        model.layers[i] = torch.compile(layer)


def _model_and_batch(case: dict):
    import piper_nb as pn
    model = getattr(pn.models, case["model"])(**case["config"])
    return model, model.example_batch(batch_size=case["batch"], seed=0)


def _pipeline(case: dict, rank: int, world: int, model, batch):
    """Stage modules cut exactly like piper_nb's annotation (`case["stages"]`: layer lists)."""
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleDualPipeV
    cpu = torch.device("cpu")
    layers = case["stages"]
    n = len(layers)
    mods = [nn.Sequential(*[model.layers[i] for i in idx]) for idx in layers]
    if case["kind"] == "1f1b":
        mine = [rank]
        stages = [PipelineStage(mods[rank], rank, n, cpu)]
        sched = Schedule1F1B(stages[0], case["microbatches"], loss_fn=model.loss_fn)
    else:
        mine = [rank, n - 1 - rank]
        stages = [PipelineStage(mods[s], s, n, cpu) for s in mine]
        sched = ScheduleDualPipeV(stages, case["microbatches"], loss_fn=model.loss_fn)
    params = [p for s in mine for p in mods[s].parameters()]
    opt = torch.optim.SGD(params, lr=case["lr"])
    first, last = 0 in mine, n - 1 in mine
    x, y = batch

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        losses: list = []
        kwargs = {"target": y, "losses": losses} if last else {}
        sched.step(*((x,) if first else ()), **kwargs)
        opt.step()
        return float(sum(v.detach().double() for v in losses)) / case["microbatches"]
    return step


def _data_parallel(case: dict, rank: int, world: int, model, batch):
    from piper_nb.runtime.layout import batch_part
    m = case["microbatches"]
    parts = [(batch_part(batch[0], m, k, rank, world), batch_part(batch[1], m, k, rank, world))
             for k in range(m)]
    kind = case["kind"]
    if kind == "eager":
        net = model
    elif kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        if case.get("wrap", "root") == "layers":
            for layer in model.layers:
                fully_shard(layer)
        net = fully_shard(model)
    opt = torch.optim.SGD(net.parameters(), lr=case["lr"])
    loss_fn = model.loss_fn

    def sync(k: int):
        last = k == m - 1
        if kind == "eager":
            return contextlib.nullcontext()
        if kind == "ddp":
            return contextlib.nullcontext() if last else net.no_sync()
        if kind == "fsdp2_acc":
            net.set_requires_gradient_sync(last)
            net.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for k, (xi, yi) in enumerate(parts):
            with sync(k):
                loss = loss_fn(net(xi), yi) / m
                loss.backward()
            total += float(loss.detach().double())
        opt.step()
        return total / world
    return step


def _serve(rank: int, world: int, port: int, case: dict, conn, cores=None) -> None:
    pin_threads(cores)
    torch.set_num_threads(1)
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))
        model, batch = _model_and_batch(case)
        if case["kind"].endswith(COMPILED):
            case = dict(case, kind=case["kind"].removesuffix(COMPILED))
            _compile_layers(model)
        build = _pipeline if case["kind"] in ("1f1b", "dualpipev") else _data_parallel
        step = build(case, rank, world, model.train(), batch)
        conn.send(("ready", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "stop":
                break
            times, losses = [], []
            for _ in range(arg):
                dist.barrier()
                t0 = time.perf_counter()
                loss = step()
                times.append(time.perf_counter() - t0)
                losses.append(loss)
            conn.send(("ok", (times, losses)))
    except BaseException as err:  # report; the driver stops the group
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {type(err).__name__}: {err}\n"
                                f"{traceback.format_exc()}"))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    conn.close()
    os._exit(0)  # skip torch's and gloo's slow interpreter teardown


class PeerGroup:
    """`world` spawned ranks training `case` with PyTorch's own parallelism."""

    def __init__(self, case: dict, world: int, timeout: float = 300.0, pin: bool | None = None,
                 serve=None):
        """Spawn `world` ranks each running `serve` (default `_serve`) on `case`."""
        serve = _serve if serve is None else serve
        if case["kind"].removesuffix(COMPILED) not in KINDS:
            raise ValueError(f"unknown peer kind {case['kind']!r}; the kinds are {KINDS}")
        self.case, self.world, self.timeout = case, world, timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        cores = core_plan(world, pin)
        self.procs, self.conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, args=(rank, world, port, case, child, cores[rank]),
                            daemon=True, name=f"peer-{case['kind']}-{rank}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        self._collect()

    def _collect(self) -> list:
        out = []
        deadline = time.monotonic() + self.timeout
        for rank, c in enumerate(self.conns):
            while not c.poll(0.1):
                if not self.procs[rank].is_alive() or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"peer rank {rank} ({self.case['kind']}) died or hung")
            kind, payload = c.recv()
            if kind == "error":
                self.close()
                raise RuntimeError(f"peer {self.case['kind']} failed: {payload}")
            out.append(payload)
        return out

    def run(self, steps: int) -> tuple[list[float], list[float]]:
        """Train `steps` steps: (step times in s, max over ranks; losses summed over ranks)."""
        for c in self.conns:
            c.send(("run", steps))
        res = self._collect()
        times = [max(r[0][s] for r in res) for s in range(steps)]
        losses = [sum(r[1][s] for r in res) for s in range(steps)]
        return times, losses

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(("stop", None))
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []

    def __enter__(self) -> PeerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
