"""What runs inside an ipyparallel engine for `pn.IPyParallelCluster`: a keeper of one worker.

Each engine spawns one runtime worker process (`runtime.process.serve`, the same command loop
`pn.LocalCluster` uses) and relays the driver's commands to it; the engine itself never
blocks for long, so it keeps answering, and it can kill and respawn its worker to abort a
job while the engine (and its id) stays. The driver calls these functions through
ipyparallel (`view.apply_async`); each returns promptly (`send` and `result` within about
`wait` seconds), so a request that goes unanswered means the engine is gone:

- `hello(controller_ip)`: where this engine lives (host, machine identity, a routable
  address, pid).
- `free_port(ip)`: a free TCP port on `ip`, for the process group's rendezvous.
- `spawn(kwargs, loopback)`: (re)start this engine's worker (`serve(**kwargs)`, gloo pinned
  to the loopback interface if asked); its "ready" answer is sequence 0.
- `send(seq, blob, wait)`: hand the worker one pickled `(op, key, payload)` command.
- `result(seq, wait)`: the answer to command `seq`, `("pending", None)` while it runs,
  `("dead", exit code)` if the worker died. Idempotent: asking twice gives the same answer,
  so a driver interrupted while waiting loses nothing.
- `status()`: None while the worker lives, else its exit code.
- `kill()` / `stop()`: end the worker by force / politely.

The worker dies with its engine (Linux `PR_SET_PDEATHSIG`), so killing an engine releases
its peers at once: their transfers with it fail instead of waiting for a timeout.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import os
import pickle
import queue
import signal
import socket
import sys
import time

from piper_nb.host import free_port

__all__ = ["hello", "free_port", "spawn", "send", "result", "kill", "stop", "status"]

_SLOT: dict = {}   # this engine's worker: proc, conn, results, sent (seqs awaiting answers), done


def hello(controller_ip: str | None, gpus: bool = False) -> dict:
    """Host name, an address the other engines can reach, pid and start time of this engine."""
    import psutil
    ip = "127.0.0.1"
    if controller_ip and not controller_ip.startswith("127.") and controller_ip != "localhost":
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((controller_ip, 9))   # no packet is sent: this picks the outgoing interface
            ip = s.getsockname()[0]
    count, uuids = 0, []
    if gpus:
        import torch
        count = torch.cuda.device_count()
        uuids = [str(getattr(torch.cuda.get_device_properties(i), "uuid", f"{os.getpid()}:{i}"))
                 for i in range(count)]
    host = socket.gethostname()
    return {"host": host, "machine": f"{host}/{psutil.boot_time():.0f}", "ip": ip, "pid": os.getpid(),
            "created": psutil.Process().create_time(), "gpus": count, "gpu_uuids": uuids,
            "python": sys.version.split()[0]}


def status() -> int | None:
    """None while the worker lives (or none was started); its exit code once it died."""
    return _SLOT["proc"].exitcode if _SLOT else None


def loopback_interface() -> str | None:
    """The name of the interface that carries 127.0.0.1 (`lo` on Linux, `lo0` on macOS)."""
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs):
            return name
    return None


def spawn(kwargs: dict, loopback: bool = False) -> int:
    """Start this engine's worker (killing the previous one) running `serve(**kwargs)`; with
    `loopback`, gloo's sockets stay on this machine's loopback interface."""
    import multiprocessing as mp
    kill()
    env = {}
    if loopback and (lo := loopback_interface()):
        env["GLOO_SOCKET_IFNAME"] = lo
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    results = ctx.Queue()
    proc = ctx.Process(target=_worker_main, args=(kwargs, env, child, results, os.getpid()),
                       name=f"piper_nb-worker-{kwargs.get('rank')}", daemon=True)
    proc.start()
    child.close()
    _SLOT.update(proc=proc, conn=parent, results=results, sent=collections.deque([0]), done={})
    return proc.pid


def send(seq: int, blob: bytes, wait: float) -> tuple[str, object]:
    """Hand command `seq` (a pickled `(op, key, payload)`) to the worker; then as `result`."""
    if not _SLOT:
        return "dead", None
    for old in [k for k in _SLOT["done"] if k < seq]:
        del _SLOT["done"][old]
    try:
        _SLOT["conn"].send_bytes(blob)
    except OSError:
        return "dead", _SLOT["proc"].exitcode
    _SLOT["sent"].append(seq)
    return result(seq, wait)


def result(seq: int, wait: float) -> tuple[str, object]:
    """`(kind, pickled payload)` of command `seq` once answered, else pending/dead/unknown."""
    if not _SLOT:
        return "dead", None
    done, sent = _SLOT["done"], _SLOT["sent"]
    if seq in done:
        return done[seq]
    if seq not in sent:
        return "unknown", None
    deadline = time.monotonic() + wait
    while True:
        proc = _SLOT["proc"]
        try:
            _, kind, blob = _SLOT["results"].get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return ("pending", None) if proc.is_alive() else ("dead", proc.exitcode)
        except (EOFError, OSError):   # the worker died while answering
            proc.join(timeout=1)
            return "dead", proc.exitcode
        answered = sent.popleft()
        done[answered] = (kind, blob)
        if answered == seq:
            return kind, blob


def kill() -> None:
    """End the worker now (a job in flight is abandoned); the engine stays."""
    if not _SLOT:
        return
    proc = _SLOT["proc"]
    if proc.is_alive():
        proc.kill()
    proc.join(timeout=10)
    _close()


def stop(wait: float = 5.0) -> None:
    """Ask the worker to leave, then kill it if it does not within `wait` seconds."""
    if not _SLOT:
        return
    with contextlib.suppress(OSError):
        _SLOT["conn"].send_bytes(pickle.dumps(("stop", None, None)))
    _SLOT["proc"].join(timeout=wait)
    kill()


def _close() -> None:
    _SLOT["conn"].close()
    _SLOT["results"].cancel_join_thread()
    _SLOT["results"].close()
    _SLOT.clear()


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its engine dies, even from SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the engine died before prctl took effect
        os._exit(1)


def _worker_main(kwargs: dict, env: dict, conn, results, parent: int) -> None:
    _die_with_parent(parent)
    os.environ.update(env)
    from piper_nb.runtime.process import serve
    accepted = inspect.signature(serve).parameters
    serve(conn=conn, results=results, **{k: v for k, v in kwargs.items() if k in accepted})
