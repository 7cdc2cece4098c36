"""`pn.LocalCluster(n)`: n worker processes on this machine, kept up across `train` calls.

Workers are spawned (torch.multiprocessing, spawn context), join a gloo group (NCCL with
one GPU per rank) on 127.0.0.1 and a free port, and serve `runtime.process.serve`'s
commands. Each plan is shipped once (a pickled `Bundle`) and then reset and stepped on
command. A worker that raises surfaces here as `pn.RuntimeFailure` naming the device and
instruction; a worker that dies (or stops answering) as `pn.WorkerLost`. Either way the
whole group is killed at once, since its peers may be blocked in a transfer with it, and the
next call starts a fresh group: the cluster is usable again. Test hook: with the
environment variable `PIPER_NB_FAIL_AT="<device>:<instruction text>"` set in the driver
(e.g. `1:r1:B2`, or `0:wait(r0:RECV_B1<1)`), that worker raises there; append `:exit` to make
its process die instead. CPU workers are pinned one per core when there are enough cores
(`pin`, see `host.core_plan`). Scripts that start a cluster need an
`if __name__ == "__main__":` guard (workers are spawned, which re-imports the main module).
"""

from __future__ import annotations

import pickle
import queue
import time
from collections import Counter

import torch.multiprocessing as mp

from piper_nb.cluster.failure import worker_failure
from piper_nb.cluster.protocol import ClusterCommands
from piper_nb.errors import PlanError, RuntimeFailure, WorkerLost
from piper_nb.host import core_plan, free_port
from piper_nb.runtime.process import serve

__all__ = ["LocalCluster"]

_PINNED: Counter = Counter()   # core -> workers of running clusters in this process on it


class LocalCluster(ClusterCommands):
    """`n` local workers. `device` is "cpu" or "cuda"; `timeout` bounds every command (s).
    `pin`: None pins each CPU worker to a core of its own when there are at least `n`
    cores, True pins them round-robin in any case, False never pins; cores that other
    running clusters of this process hold are taken last. `comm="nccl-emulated"` runs
    CPU workers with NCCL's semantics (`runtime.emulation`: the stream program on one
    thread per stream, every communicator a FIFO, CPU tensors refused): a plan that would
    hang on GPUs hangs here too, and is reported after 80% of `timeout` with the streams
    that are stuck."""

    def __init__(self, n: int, *, device: str = "cpu", timeout: float = 300.0,
                 start_timeout: float = 120.0, pin: bool | None = None, comm: str = "native"):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"LocalCluster: n is a positive number of workers, got {n!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"LocalCluster: device is 'cpu' or 'cuda', got {device!r}")
        if comm not in ("native", "nccl-emulated"):
            raise ValueError(f"LocalCluster: comm is 'native' or 'nccl-emulated', got {comm!r}")
        if comm == "nccl-emulated" and device != "cpu":
            raise ValueError("LocalCluster: comm='nccl-emulated' emulates NCCL on CPU workers; "
                             "with device='cuda' the workers run NCCL itself")
        self.n, self.device, self.timeout, self.start_timeout = n, device, timeout, start_timeout
        self.comm = comm
        self.pin = pin
        self.cores: list = [None] * n                  # per rank: pinned cores, or None
        self._held: list[int] = []                     # cores counted in _PINNED for us
        self._procs: list = []
        self._conns: list = []
        self._results = None
        self._loaded: list[tuple[object, int]] = []   # (plan, key) shipped to this group
        self._next_key = 0
        self.info: list[dict] = []                     # per rank: backend, device, pid
        self.starts = 0

    # ---- life cycle --------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> LocalCluster:
        if self.running:
            return self
        self._kill()
        ctx = mp.get_context("spawn")
        port = free_port()
        self.cores = core_plan(self.n, self.pin, self.device, busy=_PINNED)
        self._held = [c for cores in self.cores for c in cores or ()]
        _PINNED.update(self._held)
        self._results = ctx.Queue()
        for rank in range(self.n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=serve, name=f"piper_nb-worker-{rank}", daemon=True,
                            args=(rank, self.n, port, self.device, child, self._results,
                                  self.timeout), kwargs={"cores": self.cores[rank],
                                                         "comm": self.comm})
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self.starts += 1
        ready = self._collect("start-up", self.start_timeout)
        self.info = [ready[r] for r in range(self.n)]
        return self

    def close(self) -> None:
        """Stop the workers (politely, then by force)."""
        for c in self._conns:
            try:
                c.send(("stop", None, None))
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.01))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        if self._results is not None:
            self._results.cancel_join_thread()
            self._results.close()
        _PINNED.subtract(self._held)
        self._held = []
        self._procs, self._conns, self._results, self._loaded = [], [], None, []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # interpreter shutdown: nothing left to clean
            pass

    def __repr__(self) -> str:
        return f"LocalCluster(n={self.n}, device={self.device!r}, running={self.running})"

    # ---- commands ----------------------------------------------------------------------
    def _send(self, op: str, key, payload, per_rank: list | None = None) -> dict[int, object]:
        try:
            for r, c in enumerate(self._conns):
                c.send((op, key, payload if per_rank is None else per_rank[r]))
            return self._collect(op, self.timeout)
        except (RuntimeFailure, PlanError):
            raise
        except BaseException:  # e.g. KeyboardInterrupt: replies would arrive out of step
            self._kill()
            raise

    def _collect(self, what: str, timeout: float) -> dict[int, object]:
        got: dict[int, object] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.n:
            try:
                rank, kind, blob = self._results.get(timeout=0.05)
            except queue.Empty:
                self._check_alive(what)
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.n) if r not in got]
                    self._kill()
                    raise WorkerLost(f"workers {missing} did not answer {what} within "
                                     f"{timeout:.0f} s; the cluster was stopped (the next call "
                                     "restarts it)", device=missing[0]) from None
                continue
            payload = pickle.loads(blob)
            if kind == "error":
                self._failure(rank, payload, what)
            got[rank] = payload
        return got

    def _check_alive(self, what: str) -> None:
        dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None]
        if dead:
            rank, code = dead[0]
            self._kill()
            raise WorkerLost(f"the worker of device {rank} died (exit code {code}) during {what}; "
                             "the cluster was stopped (the next call restarts it)", device=rank)

    def _failure(self, rank: int, info: dict, what: str) -> None:
        time.sleep(0.3)  # a dead peer makes the others fail too: report the death instead
        self._check_alive(what)
        self._kill()
        raise worker_failure(f"device {rank}", rank, info, what,
                             "the cluster was stopped; the next call restarts it")

    def _run(self, op: str, key, payload=None, per_rank: list | None = None) -> dict[int, object]:
        return self._send(op, key, payload, per_rank=per_rank)
