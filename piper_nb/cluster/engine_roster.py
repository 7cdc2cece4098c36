"""Which ipyparallel engines a `pn.IPyParallelCluster` uses, and whether they are still there.

A `Roster` wraps the ipyparallel client: it sends engine-side calls (`cluster.engine`) as
futures, picks the `n` lowest engine ids that answer a `hello` (where each lives: host,
address, pid), starts replacements for lost engines when this kernel started the
engines, and tells which engines are gone: unanswered, reported dead by the controller, or
(for engines on this machine) a process that no longer exists. Nothing here waits without
a deadline.
"""

from __future__ import annotations

import concurrent.futures as cf
import socket
import time

from piper_nb.cluster import engine as eng
from piper_nb.errors import RuntimeFailure, WorkerLost

__all__ = ["Roster", "engine_error"]


def engine_error(err: BaseException | None) -> bool:
    """An ipyparallel error saying the engine died or left (raw, or wrapped as a RemoteError)."""
    from ipyparallel.error import EngineError, RemoteError
    return isinstance(err, EngineError) or (isinstance(err, RemoteError) and err.ename == "EngineError")


class Roster:
    """The engines behind one cluster. `ipp`: the ipyparallel.Cluster when this kernel owns it."""

    def __init__(self, client, ipp=None):
        self.client, self.ipp = client, ipp
        self.dead: set[int] = set()            # engine ids known lost
        self.hello: dict[int, dict] = {}       # engine id -> host, ip, pid, created, gpus

    def call(self, engine: int, fn, *args) -> cf.Future:
        """`fn(*args)` on `engine`, as a future; already failed if the engine is unregistered."""
        from ipyparallel.error import EngineError
        if engine not in self.client.ids:
            gone: cf.Future = cf.Future()
            gone.set_exception(EngineError(f"engine {engine} is no longer registered"))
            return gone
        return self.client[engine].apply_async(fn, *args)

    @staticmethod
    def gone(ar) -> bool:
        """The engine behind this request went away (unanswered, or the controller says so)."""
        return not ar.done() or engine_error(ar.exception())

    def where(self, engine: int) -> str:
        h = self.hello.get(engine, {})
        return f"engine {engine} on {h.get('host', '?')}, pid {h.get('pid', '?')}"

    def pick(self, n: int, gpus: bool, start_timeout: float, poll: float) -> list[int]:
        """`n` engine ids that answer, lowest first (replacing lost ones when we own them).
        Engines that never answer (dead, but not yet unregistered) are passed over."""
        controller = getattr(self.client, "_config", {}).get("interface", "").partition("://")[2]
        alive: list[int] = []
        for attempt in range(3):
            ids = [e for e in sorted(self.client.ids) if e not in self.dead]
            probes = {e: self.call(e, eng.hello, controller or None, gpus) for e in ids}
            fresh = any(e not in self.hello for e in ids)   # a first answer imports piper_nb
            deadline = time.monotonic() + (start_timeout if fresh else poll + 10)
            enough = None
            while time.monotonic() < deadline:
                pending = [ar for ar in probes.values() if not ar.done()]
                if not pending:
                    break
                if sum(ar.done() and ar.exception() is None for ar in probes.values()) >= n:
                    enough = enough or time.monotonic()   # give the rest one poll, then go on
                    if time.monotonic() - enough > poll:
                        break
                cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
            timed_out = time.monotonic() >= deadline
            alive = [e for e in ids if self._answered(e, probes[e], timed_out)]
            if len(alive) >= n:
                return alive[:n]
            if self.ipp is None or attempt == 2:
                break
            self._replace(n - len(alive), start_timeout)
        raise WorkerLost(f"only {len(alive)} of {n} engines answer (lost: {sorted(self.dead)}); start "
                         "more engines (`ipcluster engines -n ...`) or connect with a smaller n")

    def _replace(self, count: int, timeout: float) -> None:
        before = set(self.client.ids)
        self.ipp.start_engines_sync(count)
        deadline = time.monotonic() + timeout
        while len(set(self.client.ids) - before) < count and time.monotonic() < deadline:
            time.sleep(0.1)

    def _answered(self, engine: int, ar, timed_out: bool) -> bool:
        """Record a `hello` answer. Silent past the deadline: lost; raised: broken."""
        if not ar.done():
            if timed_out:
                self.dead.add(engine)
            return False
        err = ar.exception()
        if err is None:
            self.hello[engine] = ar.result()
            return True
        if engine_error(err):
            self.dead.add(engine)
            return False
        raise RuntimeFailure(f"engine {engine} cannot run piper_nb: {err}; every machine needs the "
                             "same piper_nb, torch and ipyparallel as this kernel",
                             original=str(err)) from err

    def local_dead(self, engines: list[int]) -> list[int]:
        """Positions in `engines` of engines on this machine whose process is gone."""
        import psutil
        out, me = [], socket.gethostname()
        for i, e in enumerate(engines):
            h = self.hello.get(e)
            if not h or h["host"] != me:
                continue
            try:
                p = psutil.Process(h["pid"])
                gone = p.create_time() != h["created"] or p.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                gone = True
            if gone:
                out.append(i)
        return out
