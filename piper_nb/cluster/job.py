"""This process as one rank of a batch job: `torchrun` or Slurm's `srun` started it.

Where `LocalCluster` has one driver and n workers, a job has n processes and no driver:
each runs the same training loop (`pn.train`, with this cluster) on the same batches, and
executes its own device's commands itself (`runtime.process.execute`, the workers' own
switch). After each command the ranks exchange their answers over a gloo group, so every
rank sees every loss and end time. An error on a rank is raised there at once as a
`pn.RuntimeFailure` naming the rank and the instruction, and the rank exits; its peers,
which may be waiting in a transfer with it, are ended by the launcher (torchrun stops the
job when a rank exits with an error, `srun --kill-on-bad-exit=1` does), never left to
hang until the process group's timeout.

`JobEnv.read()` reads the rank, world size, local rank and rendezvous address: torchrun's
`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`; or Slurm's
`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` and the first host of
`SLURM_JOB_NODELIST` (port `MASTER_PORT`, or 29500).
"""

from __future__ import annotations

import datetime
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from piper_nb.cluster.failure import worker_failure
from piper_nb.cluster.protocol import ClusterCommands
from piper_nb.errors import PlanError
from piper_nb.runtime.bundle import load_bundle
from piper_nb.runtime.comm import Comm
from piper_nb.runtime.process import describe, execute, pick_device
from piper_nb.runtime.worker import Worker

__all__ = ["JobEnv", "JobRank", "first_host", "job_commands"]

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class JobEnv:
    """Where this process sits in its job."""

    rank: int
    world: int
    local_rank: int
    host: str
    port: int
    launcher: str      # "torchrun" or "srun"

    @classmethod
    def read(cls, env=None) -> JobEnv:
        """From torchrun's variables, else Slurm's; a PlanError naming what is missing."""
        env = os.environ if env is None else env
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(_int(env, "RANK"), _int(env, "WORLD_SIZE"),
                       _int(env, "LOCAL_RANK", env["RANK"]), env.get("MASTER_ADDR", "127.0.0.1"),
                       _int(env, "MASTER_PORT", DEFAULT_PORT), "torchrun")
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodes:
                raise PlanError("piper_nb launch: srun set SLURM_PROCID but no "
                                "SLURM_JOB_NODELIST, so rank 0's host is unknown; set "
                                "MASTER_ADDR, or launch with srun inside an allocation")
            return cls(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                       _int(env, "SLURM_LOCALID", "0"),
                       env.get("MASTER_ADDR") or first_host(nodes),
                       _int(env, "MASTER_PORT", DEFAULT_PORT), "srun")
        raise PlanError("piper_nb launch runs as one rank of a job: start it with torchrun "
                        "(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) or srun (SLURM_PROCID, "
                        "SLURM_NTASKS, SLURM_JOB_NODELIST); neither set these variables. "
                        "In a notebook, train with pn.train(plan, ...) instead")


def _int(env, name: str, default=None) -> int:
    value = env.get(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise PlanError(f"piper_nb launch: {name}={value!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `gpu[003-010,017],cpu1` -> `gpu003`."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if m is None:
        raise PlanError(f"piper_nb launch: cannot read the Slurm node list {nodelist!r}; "
                        "set MASTER_ADDR to rank 0's host")
    prefix, ranges = m.group(1), m.group(2)
    return prefix if ranges is None else prefix + ranges.split(",")[0].split("-")[0]


class JobRank(ClusterCommands):
    """This process's rank of a job (`env`, default `JobEnv.read()`), as the cluster
    `pn.train` drives: `pn.train(plan, batch, steps, optimizer, cluster=JobRank())` on
    every rank trains the plan once. `device` is "cpu" (gloo) or "cuda" (NCCL, the GPU of
    the local rank); `timeout` bounds every command and the rendezvous (s)."""

    def __init__(self, env: JobEnv | None = None, *, device: str = "cpu",
                 timeout: float = 600.0):
        if device not in ("cpu", "cuda"):
            raise ValueError(f"JobRank: device is 'cpu' or 'cuda', got {device!r}")
        self.env = env or JobEnv.read()
        self.n, self.rank, self.device_kind, self.timeout = (self.env.world, self.env.rank,
                                                             device, timeout)
        self._loaded, self._next_key, self._workers = [], 0, {}
        self._channel = self._device = self._control = None

    @property
    def writes_checkpoints(self) -> bool:
        """Rank 0 writes a job's checkpoints (every rank gathers their states, and every
        rank reads the newest one back when the job is restarted)."""
        return self.rank == 0

    def _key(self, plan) -> int:
        if plan.world != self.n:
            raise PlanError(f"the plan runs on {plan.world} devices and this job has "
                            f"{self.n} ranks ({self.env.launcher}); launch it with "
                            f"{plan.world} processes")
        return super()._key(plan)

    def start(self) -> JobRank:
        if self._channel is not None:
            return self
        limit = datetime.timedelta(seconds=self.timeout)
        # one GPU per rank of each node: NCCL, whatever the world's size
        self._device, backend = pick_device(
            self.device_kind, self.rank, self.n, self.env.local_rank,
            backend="nccl" if self.device_kind == "cuda" else None)
        bound = {"device_id": self._device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=self._store(limit), rank=self.rank,
                                world_size=self.n, timeout=limit, **bound)
        self._control = dist.new_group(backend="gloo") if backend != "gloo" else None
        self._channel = Comm(self.rank, self._device, backend)
        return self

    def _store(self, limit: datetime.timedelta) -> dist.Store:
        """The rendezvous store. torchrun's agent serves one at MASTER_ADDR:MASTER_PORT and
        keeps it across the restarts of `--max-restarts`, so each round meets under its
        own prefix (a restarted round would otherwise read the dead round's addresses);
        under srun rank 0 serves it."""
        agent = self.env.launcher == "torchrun" and os.environ.get(
            "TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(self.env.host, self.env.port, self.n,
                              is_master=not agent and self.rank == 0, timeout=limit,
                              wait_for_workers=False)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"piper_nb/round{restart}/", store)

    def close(self) -> None:
        if self._channel is not None and dist.is_initialized():
            dist.destroy_process_group()
        self._channel = None

    def __enter__(self) -> JobRank:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, op: str, key, payload=None, per_rank: list | None = None) -> dict[int, object]:
        mine = payload if per_rank is None else per_rank[self.rank]
        try:
            out = execute(self._workers, op, key, mine, self._make_worker)
        except Exception as err:   # this rank stops now; its peers may wait in a transfer
            raise worker_failure(f"rank {self.rank}", self.rank,
                                 describe(err, self._workers.get(key)), op,
                                 "this rank stops, and the launcher stops the others: torchrun "
                                 "does, srun with --kill-on-bad-exit=1") from err
        answers: list = [None] * self.n
        dist.all_gather_object(answers, out, group=self._control)
        return dict(enumerate(answers))

    def _make_worker(self, blob: bytes) -> Worker:
        return Worker(self.rank, load_bundle(blob), self._channel, self._device, self.timeout)

    def __repr__(self) -> str:
        return (f"JobRank(rank={self.rank}, world={self.n}, launcher={self.env.launcher!r}, "
                f"device={self.device_kind!r})")




def job_commands(path, devices: int, steps: int, device: str = "cpu") -> str:
    """The commands that run the plan directory `path` (absolute in what they print) as a
    job of `devices` ranks: torchrun on one machine, and an sbatch script for Slurm."""
    path = Path(path).resolve()
    flags = f"--steps {steps} --out {path / 'out'}" + (" --device cuda" if device == "cuda"
                                                        else "")
    gpus = "#SBATCH --gpus-per-task=1\n" if device == "cuda" else ""
    return (f"# one machine: {devices} ranks under torchrun\n"
            f"torchrun --standalone --nproc-per-node {devices} -m piper_nb launch {path} "
            f"{flags}\n\n"
            f"# Slurm: save as job.sbatch, then `sbatch job.sbatch` (the plan directory on a "
            f"filesystem every node mounts)\n"
            f"#!/bin/bash\n#SBATCH --job-name=piper-nb\n#SBATCH --ntasks={devices}\n{gpus}"
            f"#SBATCH --time=01:00:00\nexport MASTER_PORT=29500\n"
            f"srun --kill-on-bad-exit=1 python -m piper_nb launch {path} {flags}\n")
