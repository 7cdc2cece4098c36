"""`pn.IPyParallelCluster`: run plans on ipyparallel engines, on this machine or across many.

`IPyParallelCluster(n)` starts a controller bound to 127.0.0.1 and `n` local engines;
`IPyParallelCluster.connect(...)` attaches to an `ipcluster` started elsewhere with any
launcher (Slurm, MPI, SSH). Each engine keeps one runtime worker (`cluster.engine`), the
same `runtime.process.serve` command loop `pn.LocalCluster` runs, and relays commands to it;
the process group meets at engine 0's address on a port engine 0 picks. `cluster.engine_roster`
picks the engines and tells when one is gone. The cluster speaks
`LocalCluster`'s protocol (`reset`, `step`, `state`, plus `train_state` / `load_train_state`
for checkpoints), so `pn.train` and the Designer take either.

Nothing here blocks without a bound: the driver polls its engines (each answer comes within
`poll` seconds, so answers double as heartbeats) and calls an engine lost when it misses
`lost_after` seconds of them, or at once when a local engine's process is gone. A lost
engine raises `pn.WorkerLost` naming its device; a worker that raises, `pn.RuntimeFailure`.
Either way every worker is killed (their engines stay up, so no peer waits in a transfer)
and the next call starts fresh workers, replacing lost engines this cluster started.
Ctrl-C while a step runs lets it finish for up to `grace` seconds (the workers stay
loaded), else, or on a second Ctrl-C, kills the workers; either way the cluster stays
usable. Workers are told the same test hook as LocalCluster's (`PIPER_NB_FAIL_AT`).
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
import logging
import pickle
import time
from typing import NoReturn

from piper_nb.cluster import engine as eng
from piper_nb.cluster.engine_roster import Roster, engine_error
from piper_nb.cluster.failure import worker_failure
from piper_nb.cluster.protocol import ClusterCommands
from piper_nb.errors import RuntimeFailure, WorkerLost
from piper_nb.extras import require
from piper_nb.runtime.process import serve

__all__ = ["IPyParallelCluster"]

_SERVE = set(inspect.signature(serve).parameters)


class _Abandon(Exception):
    """Internal: after Ctrl-C the running command cannot finish cleanly; kill the workers."""


class IPyParallelCluster(ClusterCommands):
    """`n` ipyparallel engines, one device each. See the module docstring.

    `device`: "cpu" (gloo) or "cuda" (one GPU per engine by local rank; NCCL when every host
    has a GPU per engine). `ip`: the address the controller listens on (loopback unless you
    ask). `timeout`: bound on any one command and on every transfer (s). `poll`: the longest
    an engine sits on a request. `lost_after`: silence after which an engine is lost.
    `grace`: how long Ctrl-C lets the running step finish. Other keyword arguments go to
    `ipyparallel.Cluster` (e.g. `profile_dir=`, `engines="mpi"`).
    """

    def __init__(self, n: int, *, device: str = "cpu", ip: str = "127.0.0.1", timeout: float = 300.0,
                 start_timeout: float = 120.0, poll: float = 0.5, lost_after: float = 20.0,
                 grace: float = 10.0, threads: int = 1, _client=None, **cluster_options):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"IPyParallelCluster: n is a positive number of engines, got {n!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"IPyParallelCluster: device is 'cpu' or 'cuda', got {device!r}")
        if not 0 < poll <= 5 or lost_after <= 0 or grace < 0:
            raise ValueError("IPyParallelCluster: poll must be in (0, 5] s, lost_after > 0, grace >= 0")
        self.n, self.device, self.timeout, self.start_timeout = n, device, timeout, start_timeout
        self.poll, self.lost_after, self.grace, self.threads = poll, lost_after, grace, threads
        self._ipp = None                       # the ipyparallel.Cluster when we started it
        client = _client
        if client is None:
            ipp = require("ipyparallel", "IPyParallelCluster")
            opts = {"engine_launcher_class": "local", "log_level": logging.ERROR, "delay": 0,
                    **cluster_options}
            self._ipp = ipp.Cluster(n=n, controller_ip=ip, **opts)
            self._ipp.start_cluster_sync()
            client = self._ipp.connect_client_sync()
            client.wait_for_engines(n, timeout=start_timeout, interactive=False)
        self.client = client
        self.roster = Roster(client, self._ipp)
        self.engine_ids: list[int] = []        # rank -> engine id, while workers are up
        self.info: list[dict] = []             # per rank: engine, host, pids, backend, device
        self._up = False
        self._seq = 0
        self._loaded: list[tuple[object, int]] = []
        self._next_key = 0
        self.starts = 0

    @classmethod
    def connect(cls, cluster_id: str | None = None, profile: str | None = None,
                url_file: str | None = None, *, profile_dir: str | None = None, n: int | None = None,
                wait: float = 60.0, **options) -> IPyParallelCluster:
        """Attach to a running `ipcluster` (any launcher) by its client connection file
        (`url_file`) or by `profile` (or `profile_dir`) and `cluster_id`; use `n` engines
        (waiting up to `wait` s for them), default all that are registered."""
        ipp = require("ipyparallel", "IPyParallelCluster.connect")
        if url_file:   # ipyparallel takes the file as its first argument (url_file= is ignored)
            client = ipp.Client(str(url_file), timeout=wait)
        else:
            kw = {"profile": profile, "profile_dir": profile_dir, "cluster_id": cluster_id}
            client = ipp.Client(**{k: v for k, v in kw.items() if v is not None}, timeout=wait)
        if n is not None:
            client.wait_for_engines(n, timeout=wait)
        count = n if n is not None else len(client.ids)
        if count < 1:
            raise RuntimeFailure("the ipyparallel cluster has no engines; start some with "
                                 "`ipcluster engines` or wait for the batch job")
        return cls(count, _client=client, **options)

    # ---- life cycle --------------------------------------------------------------------
    @property
    def owned(self) -> bool:
        """True when this object started the engines (and so stops and replaces them)."""
        return self._ipp is not None

    @property
    def running(self) -> bool:
        return self._up

    def start(self) -> IPyParallelCluster:
        """Start a worker on each of `n` engines and join them into one process group."""
        if self._up:
            return self
        ids = self.roster.pick(self.n, self.device == "cuda", self.start_timeout, self.poll)
        hosts = [self.roster.hello[e] for e in ids]
        single = len({h["machine"] for h in hosts}) == 1   # host name + boot time
        if not single and "host" not in _SERVE:
            raise RuntimeFailure("the engines span several machines, but this piper_nb's "
                                 "runtime.process.serve cannot rendezvous off this host (no host=)")
        host = "127.0.0.1" if single else hosts[0]["ip"]   # engine 0's machine
        try:
            port = self.roster.call(ids[0], eng.free_port, host).result(self.poll + 10)
        except Exception as err:
            self.roster.dead.add(ids[0])
            raise WorkerLost(f"engine {ids[0]} (device 0) did not give a rendezvous port: {err}",
                             device=0) from err
        self._seq, self._loaded, self.engine_ids = 0, [], ids
        try:
            spawned = [self.roster.call(e, eng.spawn, self._worker_args(r, hosts, host, port), single)
                       for r, e in enumerate(ids)]   # one machine: gloo stays on loopback too
            for ar in spawned:
                ar.result(self.start_timeout)
            ready = self._gather(0, {r: self.roster.call(e, eng.result, 0, self.poll)
                                     for r, e in enumerate(ids)}, "start-up", self.start_timeout)
        except BaseException:
            self._kill_workers()
            raise
        self._up = True
        self.info = [{"engine": e, "host": h["host"], "engine_pid": h["pid"], **ready[r]}
                     for r, (e, h) in enumerate(zip(ids, hosts, strict=True))]
        self.starts += 1
        return self

    def _worker_args(self, rank: int, hosts: list[dict], host: str, port: int) -> dict:
        """`runtime.process.serve`'s arguments for `rank`: the GPU by local rank (position among
        the engines on its machine, modulo the GPUs it sees); NCCL when every engine then
        has a GPU of its own (`gpus_apart`), gloo through host memory otherwise."""
        local = sum(h["machine"] == hosts[rank]["machine"] for h in hosts[:rank])
        backend = None
        if self.device == "cuda":
            backend = "nccl" if gpus_apart(hosts) else "gloo"
        return {"rank": rank, "world": self.n, "port": port, "device_kind": self.device,
                "timeout": self.timeout, "threads": self.threads, "host": host, "local_rank": local,
                "backend": backend}

    def restart(self) -> IPyParallelCluster:
        """Kill the workers, replace lost engines (when this cluster started them), start anew."""
        self._kill_workers()
        return self.start()

    def close(self) -> None:
        """Stop the workers; stop the engines and controller too when this object started them."""
        if self._up:
            live = [e for e in self.engine_ids if e not in self.roster.dead]
            ars = [self.roster.call(e, eng.stop) for e in live]
            cf.wait(ars, timeout=10)
            self._up = False
        if self._ipp is not None:
            self._ipp.stop_cluster_sync()
            self._ipp = None
        if self.client is not None:
            self.client.close()
            self.client = None

    def __enter__(self) -> IPyParallelCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = "local" if self.owned else "connected"
        return (f"IPyParallelCluster(n={self.n}, device={self.device!r}, {where}, "
                f"engines={self.engine_ids or None}, running={self.running})")

    # ---- workers -----------------------------------------------------------------------
    def _kill_workers(self) -> None:
        """Kill every worker (engines stay); wait a moment for the engines to confirm."""
        live = [e for e in self.engine_ids if e not in self.roster.dead]
        ars = {e: self.roster.call(e, eng.kill) for e in live}
        cf.wait(list(ars.values()), timeout=self.poll + 10)
        self.roster.dead.update(e for e, ar in ars.items() if self.roster.gone(ar))
        self._up, self._loaded = False, []

    # ---- commands ----------------------------------------------------------------------
    def _command(self, op: str, key, payloads: list | None, shared=None) -> dict[int, object]:
        """Send `op` to every rank (`payloads[r]`, or `shared` to all) and gather answers."""
        self._seq += 1
        seq, calls, size = self._seq, {}, 0
        blob = pickle.dumps((op, key, shared)) if payloads is None else None
        try:
            for r, e in enumerate(self.engine_ids):
                b = blob if payloads is None else pickle.dumps((op, key, payloads[r]))
                size = max(size, len(b))
                calls[r] = self.roster.call(e, eng.send, seq, b, self.poll)
        except BaseException:   # some ranks may have the command and others not: start over
            self._kill_workers()
            raise
        return self._gather(seq, calls, op, self.timeout, slack=size / 1e6)

    def _gather(self, seq: int, calls: dict, what: str, timeout: float,
                slack: float = 0.0) -> dict[int, object]:
        """Answers to command `seq` by rank. `slack`: extra seconds the first answer may take
        (a large payload still in transit, at 1 MB/s)."""
        try:
            return self._collect(seq, calls, what, timeout, slack)
        except KeyboardInterrupt:
            self._interrupted(seq, calls, what)
            raise

    def _collect(self, seq: int, calls: dict, what: str, timeout: float,
                 slack: float) -> dict[int, object]:
        got: dict[int, object] = {}
        asked = dict.fromkeys(calls, time.monotonic() + slack)  # when the last request was due
        deadline = time.monotonic() + timeout
        checked = 0.0
        while len(got) < len(calls):
            cf.wait([ar for r, ar in calls.items() if r not in got], timeout=0.25,
                    return_when=cf.FIRST_COMPLETED)
            now = time.monotonic()
            for r, ar in calls.items():
                if r in got:
                    continue
                if not ar.done():
                    if now - asked[r] > self.poll + self.lost_after:
                        self._lost(r, f"its engine has not answered for {now - asked[r]:.0f} s", what)
                    continue
                kind, payload = self._answer(r, ar, what)
                if kind == "pending":
                    calls[r] = self.roster.call(self.engine_ids[r], eng.result, seq, self.poll)
                    asked[r] = now
                elif kind == "error":
                    self._failure(r, payload, what)
                else:
                    got[r] = payload
            if now - checked > 0.5:
                checked = now
                dead = self.roster.local_dead(self.engine_ids)
                if dead:
                    self._lost(dead[0], "its engine process is gone", what)
            if now > deadline and len(got) < len(calls):
                missing = [r for r in calls if r not in got]
                self._kill_workers()
                raise WorkerLost(f"devices {missing} did not finish {what} within {timeout:.0f} s; the "
                                 "workers were stopped (the next call restarts them)", device=missing[0])
        return got

    def _answer(self, rank: int, ar, what: str) -> tuple[str, object]:
        try:
            kind, blob = ar.result(0)
        except Exception as err:
            if engine_error(err):  # the controller saw the engine go
                self._lost(rank, "the controller reports its engine gone", what)
            self._kill_workers()
            raise RuntimeFailure(f"{self._where(rank)} raised while relaying {what}: {err}; the "
                                 "workers were stopped", device=rank, original=str(err)) from err
        if kind == "dead":
            self._lost(rank, f"its worker process died (exit code {blob})", what, engine_gone=False)
        if kind == "unknown":
            self._kill_workers()
            raise RuntimeFailure(f"engine {self.engine_ids[rank]} (device {rank}) lost track of {what}; "
                                 "the workers were stopped (the next call restarts them)", device=rank)
        if kind == "pending":
            return kind, None
        return kind, pickle.loads(blob)

    def _where(self, rank: int) -> str:
        return f"device {rank} ({self.roster.where(self.engine_ids[rank])})"

    def _lost(self, rank: int, why: str, what: str, engine_gone: bool = True) -> NoReturn:
        if engine_gone:
            self.roster.dead.add(self.engine_ids[rank])
        self._kill_workers()
        raise WorkerLost(f"{self._where(rank)} was lost during {what}: {why}; the other workers were "
                         "stopped (the next call restarts them)", device=rank)

    def _failure(self, rank: int, info: dict, what: str) -> NoReturn:
        """A worker raised. A dead peer makes the others fail too: report a death instead."""
        time.sleep(0.3)
        probes = {r: self.roster.call(e, eng.status) for r, e in enumerate(self.engine_ids)}
        cf.wait(list(probes.values()), timeout=self.poll + 3)
        gone = self.roster.local_dead(self.engine_ids)
        silent = sorted(set(gone) | {r for r, ar in probes.items() if self.roster.gone(ar)})
        for r in silent:
            self.roster.dead.add(self.engine_ids[r])
        if silent:
            why = "its engine process is gone" if silent[0] in gone else "its engine stopped answering"
            self._lost(silent[0], why, what)
        exited = [(r, ar.result()) for r, ar in probes.items()
                  if ar.exception() is None and ar.result() is not None]
        if exited:
            r, code = exited[0]
            self._lost(r, f"its worker process died (exit code {code})", what, engine_gone=False)
        self._kill_workers()
        raise worker_failure(self._where(rank), rank, info, what,
                             "the workers were stopped; the next call restarts them")

    def _interrupted(self, seq: int, calls: dict, what: str) -> None:
        """Ctrl-C: let the running command finish within `grace` s, else kill the workers."""
        if not self._up:
            return
        try:
            deadline = time.monotonic() + self.grace
            pending = dict(calls)
            while pending and time.monotonic() < deadline:
                cf.wait(list(pending.values()), timeout=min(0.25, self.grace),
                        return_when=cf.FIRST_COMPLETED)
                for r, ar in list(pending.items()):
                    if not ar.done():
                        continue
                    if ar.exception() is not None or ar.result()[0] in ("dead", "unknown", "error"):
                        raise _Abandon
                    if ar.result()[0] == "pending":
                        pending[r] = self.roster.call(self.engine_ids[r], eng.result, seq, self.poll)
                    else:
                        del pending[r]
            if pending:
                raise _Abandon
        except (KeyboardInterrupt, _Abandon):
            self._kill_workers()

    # ---- the protocol pn.train uses ----------------------------------------------------
    def _run(self, op: str, key, payload=None, per_rank: list | None = None) -> dict[int, object]:
        return self._command(op, key, per_rank, payload)


def gpus_apart(hosts: list[dict]) -> bool:
    """Whether every engine gets a GPU no other engine uses: engine k of a machine takes
    the (k mod visible)-th GPU it sees, and the GPUs' UUIDs tell whether two engines that
    each see one GPU (`--gpus-per-task=1`, CUDA_VISIBLE_DEVICES) see the same one."""
    taken: dict[str, set] = {}
    for rank, h in enumerate(hosts):
        if not h.get("gpus"):
            return False
        local = sum(x["machine"] == h["machine"] for x in hosts[:rank])
        uuids = h.get("gpu_uuids") or [f"{h['machine']}:{i}" for i in range(h["gpus"])]
        gpu = uuids[local % len(uuids)]
        if gpu in taken.setdefault(h["machine"], set()):
            return False
        taken[h["machine"]].add(gpu)
    return True
