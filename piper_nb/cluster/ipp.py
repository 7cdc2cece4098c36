"""`pn.IPyParallelCluster`: run plans on ipyparallel engines, on this machine or across many.

`IPyParallelCluster(n)` starts a controller bound to 127.0.0.1 and `n` local engines;
`IPyParallelCluster.connect(...)` attaches to an `ipcluster` started elsewhere with any
launcher (Slurm, MPI, SSH). Each engine keeps one runtime worker (`cluster.engine`), the
same `runtime.process.serve` command loop `pn.LocalCluster` runs, and relays commands to it;
the process group meets at engine 0's address on a port engine 0 picks. The cluster speaks
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
import os
import pickle
import socket
import time
from typing import NoReturn

from piper_nb.cluster import engine as eng
from piper_nb.errors import PlanError, RuntimeFailure, WorkerLost
from piper_nb.runtime.bundle import make_bundle
from piper_nb.runtime.layout import assemble_state
from piper_nb.runtime.process import serve
from piper_nb.runtime.worker import FAIL_ENV

__all__ = ["IPyParallelCluster"]

_SERVE = set(inspect.signature(serve).parameters)


class _Interrupted(Exception):
    """Internal: Ctrl-C arrived while commands were being handed out."""


def _engine_error(err: BaseException | None) -> bool:
    """An ipyparallel error saying the engine died or left (raw, or wrapped as a RemoteError)."""
    from ipyparallel.error import EngineError, RemoteError
    return isinstance(err, EngineError) or (isinstance(err, RemoteError) and err.ename == "EngineError")


class IPyParallelCluster:
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
        self.client = _client
        if self.client is None:
            import ipyparallel as ipp
            opts = {"engine_launcher_class": "local", "log_level": logging.ERROR, "delay": 0,
                    **cluster_options}
            self._ipp = ipp.Cluster(n=n, controller_ip=ip, **opts)
            self._ipp.start_cluster_sync()
            self.client = self._ipp.connect_client_sync()
            self.client.wait_for_engines(n, timeout=start_timeout, interactive=False)
        self._dead: set[int] = set()           # engine ids known lost
        self._hello: dict[int, dict] = {}      # engine id -> where it lives
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
        import ipyparallel as ipp
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
        ids = self._engines()
        hosts = [self._hello[e] for e in ids]
        single = len({h["host"] for h in hosts}) == 1
        if not single and "host" not in _SERVE:
            raise RuntimeFailure("the engines span several machines, but this piper_nb's "
                                 "runtime.process.serve cannot rendezvous off this host (no host=)")
        host = "127.0.0.1" if single else hosts[0]["ip"]
        try:
            port = self._call(ids[0], eng.free_port, host).result(self.poll + 10)
        except Exception as err:
            self._dead.add(ids[0])
            raise WorkerLost(f"engine {ids[0]} (device 0) did not give a rendezvous port: {err}",
                             device=0) from err
        local = [sum(h["host"] == hosts[r]["host"] for h in hosts[:r]) for r in range(self.n)]
        env = {}
        if single and (lo := eng.loopback_interface()):
            env["GLOO_SOCKET_IFNAME"] = lo   # gloo's own sockets stay on loopback too
        backend = None
        if self.device == "cuda":
            per_host = {h["host"]: sum(x["host"] == h["host"] for x in hosts) for h in hosts}
            backend = "nccl" if all(h["gpus"] >= per_host[h["host"]] for h in hosts) else "gloo"
        self._seq, self._loaded, self.engine_ids = 0, [], ids
        pids = {}
        try:
            for r, e in enumerate(ids):
                kwargs = {"rank": r, "world": self.n, "port": port, "device_kind": self.device,
                          "timeout": self.timeout, "threads": self.threads, "host": host,
                          "local_rank": local[r], "backend": backend}
                pids[r] = self._call(e, eng.spawn, kwargs, env)
            pids = {r: ar.result(self.start_timeout) for r, ar in pids.items()}
            self._up = True
            ready = self._gather(0, {r: self._call(e, eng.result, 0, self.poll)
                                     for r, e in enumerate(ids)}, "start-up", self.start_timeout)
        except BaseException:
            self._kill_workers()
            raise
        self.info = [{"engine": e, "host": self._hello[e]["host"], "engine_pid": self._hello[e]["pid"],
                      **ready[r]} for r, e in enumerate(ids)]
        self.starts += 1
        return self

    def restart(self) -> IPyParallelCluster:
        """Kill the workers, replace lost engines (when this cluster started them), start anew."""
        self._kill_workers()
        return self.start()

    def close(self) -> None:
        """Stop the workers; stop the engines and controller too when this object started them."""
        if self._up:
            live = [e for e in self.engine_ids if e not in self._dead]
            ars = [self._call(e, eng.stop) for e in live]
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

    # ---- engines -----------------------------------------------------------------------
    def _call(self, engine: int, fn, *args) -> cf.Future:
        """`fn(*args)` on `engine`, as a future; already failed if the engine is unregistered."""
        from ipyparallel.error import EngineError
        if engine not in self.client.ids:
            gone: cf.Future = cf.Future()
            gone.set_exception(EngineError(f"engine {engine} is no longer registered"))
            return gone
        return self.client[engine].apply_async(fn, *args)

    @staticmethod
    def _gone(ar) -> bool:
        """The engine behind this request went away (unanswered, or the controller says so)."""
        return not ar.done() or _engine_error(ar.exception())

    def _engines(self) -> list[int]:
        """`n` engine ids that answer, lowest first (replacing lost ones when we own them).
        Engines that never answer (dead, but not yet unregistered) are passed over."""
        controller = getattr(self.client, "_config", {}).get("interface", "").partition("://")[2]
        gpus = self.device == "cuda"
        alive: list[int] = []
        for attempt in range(3):
            ids = [e for e in sorted(self.client.ids) if e not in self._dead]
            probes = {e: self._call(e, eng.hello, controller or None, gpus) for e in ids}
            fresh = any(e not in self._hello for e in ids)   # a first answer imports piper_nb
            deadline = time.monotonic() + (self.start_timeout if fresh else self.poll + 10)
            enough = None
            while time.monotonic() < deadline:
                pending = [ar for ar in probes.values() if not ar.done()]
                ok = [ar for ar in probes.values() if ar.done() and ar.exception() is None]
                if not pending:
                    break
                if len(ok) >= self.n:  # enough: give the rest one poll interval, then go on
                    enough = enough or time.monotonic()
                    if time.monotonic() - enough > self.poll:
                        break
                cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
            timed_out = time.monotonic() >= deadline
            alive = [e for e in ids if self._answered(e, probes[e], timed_out)]
            if len(alive) >= self.n:
                return alive[:self.n]
            if not self.owned or attempt == 2:
                break
            before = set(self.client.ids)
            self._ipp.start_engines_sync(self.n - len(alive))
            deadline = time.monotonic() + self.start_timeout
            while len(set(self.client.ids) - before) < self.n - len(alive):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        raise WorkerLost(f"only {len(alive)} of {self.n} engines answer (lost: {sorted(self._dead)}); "
                         "start more engines (`ipcluster engines -n ...`) or connect with a smaller n")

    def _answered(self, engine: int, ar, timed_out: bool) -> bool:
        """Record a `hello` answer. Silent past the deadline: lost; raised: broken."""
        if not ar.done():
            if timed_out:
                self._dead.add(engine)
            return False
        err = ar.exception()
        if err is None:
            self._hello[engine] = ar.result()
            return True
        if _engine_error(err):
            self._dead.add(engine)
            return False
        raise RuntimeFailure(f"engine {engine} cannot run piper_nb: {err}; every machine needs the "
                             "same piper_nb, torch and ipyparallel as this kernel",
                             original=str(err)) from err

    def _local_dead(self) -> list[int]:
        """Ranks whose engine runs on this machine and whose process is gone."""
        import psutil
        out = []
        me = socket.gethostname()
        for r, e in enumerate(self.engine_ids):
            h = self._hello.get(e)
            if not h or h["host"] != me:
                continue
            try:
                p = psutil.Process(h["pid"])
                gone = p.create_time() != h["created"] or p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                out.append(r)
        return out

    def _kill_workers(self) -> None:
        """Kill every worker (engines stay); wait a moment for the engines to confirm."""
        live = [e for e in self.engine_ids if e not in self._dead]
        ars = {e: self._call(e, eng.kill) for e in live}
        cf.wait(list(ars.values()), timeout=self.poll + 10)
        self._dead.update(e for e, ar in ars.items() if self._gone(ar))
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
                calls[r] = self._call(e, eng.send, seq, b, self.poll)
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
                    calls[r] = self._call(self.engine_ids[r], eng.result, seq, self.poll)
                    asked[r] = now
                elif kind == "error":
                    self._failure(r, payload, what)
                else:
                    got[r] = payload
            if now - checked > 0.5:
                checked = now
                dead = self._local_dead()
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
            if _engine_error(err):  # the controller saw the engine go
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
        e = self.engine_ids[rank]
        h = self._hello.get(e, {})
        return f"device {rank} (engine {e} on {h.get('host', '?')}, pid {h.get('pid', '?')})"

    def _lost(self, rank: int, why: str, what: str, engine_gone: bool = True) -> NoReturn:
        if engine_gone:
            self._dead.add(self.engine_ids[rank])
        self._kill_workers()
        raise WorkerLost(f"{self._where(rank)} was lost during {what}: {why}; the other workers were "
                         "stopped (the next call restarts them)", device=rank)

    def _failure(self, rank: int, info: dict, what: str) -> NoReturn:
        """A worker raised. A dead peer makes the others fail too: report a death instead."""
        time.sleep(0.3)
        probes = {r: self._call(e, eng.status) for r, e in enumerate(self.engine_ids)}
        cf.wait(list(probes.values()), timeout=self.poll + 3)
        gone = self._local_dead()
        silent = sorted(set(gone) | {r for r, ar in probes.items() if self._gone(ar)})
        for r in silent:
            self._dead.add(self.engine_ids[r])
        if silent:
            why = "its engine process is gone" if silent[0] in gone else "its engine stopped answering"
            self._lost(silent[0], why, what)
        exited = [(r, ar.result()) for r, ar in probes.items()
                  if ar.exception() is None and ar.result() is not None]
        if exited:
            r, code = exited[0]
            self._lost(r, f"its worker process died (exit code {code})", what, engine_gone=False)
        self._kill_workers()
        instr = info.get("instruction")
        where = f" at instruction {instr}" if instr else ""
        raise RuntimeFailure(f"{self._where(rank)} failed{where} during {what}: {info['error']}\n"
                             f"--- worker traceback ---\n{info['traceback']}"
                             "(the workers were stopped; the next call restarts them)",
                             device=rank, instruction=instr, original=info["error"])

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
                        raise _Interrupted
                    if ar.result()[0] == "pending":
                        pending[r] = self._call(self.engine_ids[r], eng.result, seq, self.poll)
                    else:
                        del pending[r]
            if pending:
                raise _Interrupted
        except (KeyboardInterrupt, _Interrupted):
            self._kill_workers()

    def _key(self, plan) -> int:
        """Start the workers if needed and ship `plan` unless they have it already."""
        if plan.world > self.n:
            raise PlanError(f"the plan needs {plan.world} devices but the cluster has {self.n} "
                            f"engines; use pn.IPyParallelCluster({plan.world})")
        self.start()
        for p, key in self._loaded:
            if p is plan:
                return key
        blob = make_bundle(plan)
        key = self._next_key
        self._next_key += 1
        self._command("load", key, None, blob)
        self._loaded.append((plan, key))
        return key

    # ---- the protocol pn.train uses ----------------------------------------------------
    def reset(self, plan, optimizer) -> None:
        """Ship `plan` if it is new to these workers; parameters back to the model's, fresh
        optimizer state."""
        self._command("reset", self._key(plan), None, optimizer)

    def step(self, plan, batch) -> list[dict]:
        """One training step of `plan` on `batch`; per rank: loss, end, events, memory."""
        key = self._key(plan)
        out = self._command("step", key, None, (tuple(batch), os.environ.get(FAIL_ENV)))
        return [out[r] for r in range(self.n)]

    def state(self, plan) -> dict:
        """Canonical parameter name -> full tensor, gathered from the workers."""
        out = self._command("state", self._key(plan), None)
        return assemble_state(plan, [out[r] for r in range(self.n)])

    def train_state(self, plan) -> list[dict]:
        """Per rank: parameters, optimizer state and step count (for `cluster.checkpoint`)."""
        out = self._command("train_state", self._key(plan), None)
        return [out[r] for r in range(self.n)]

    def load_train_state(self, plan, states: list[dict]) -> None:
        """Give every rank its part of a checkpoint (after `reset`)."""
        if len(states) != self.n:
            raise ValueError(f"load_train_state: {len(states)} states for {self.n} ranks")
        self._command("load_train_state", self._key(plan), list(states))
