"""The host a process runs on: its cores, pinning, and free ports. A leaf: the runtime
pins its workers with it, the cost models count the cores a plan's devices share, the
launchers pick rendezvous ports; none of them needs the others for that.
"""

from __future__ import annotations

import os
import socket

__all__ = ["free_port", "usable_cores", "core_plan", "pin_threads"]


def free_port(ip: str = "127.0.0.1") -> int:
    """A TCP port free on `ip` right now, for a process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def usable_cores() -> list[int]:
    """The cores this process may run on (all of them where the OS does not say)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_plan(n: int, pin: bool | None = None, device: str = "cpu",
              busy: dict[int, int] | None = None) -> list[tuple[int, ...] | None]:
    """Per rank, the cores its process is pinned to (None: not pinned). `pin=None` pins
    CPU workers when each can have a core of its own; `pin=True` also shares them out
    round-robin when there are more workers than cores; `pin=False`, or a CUDA cluster,
    leaves placement to the OS. Cores are taken least `busy` first (how many workers of
    other clusters already hold each), then in order."""
    cores = usable_cores()
    if pin is False or (pin is None and (device != "cpu" or n > len(cores))):
        return [None] * n
    if not hasattr(os, "sched_setaffinity"):
        if pin:
            raise ValueError("pin=True: this OS cannot pin processes to cores "
                             "(os.sched_setaffinity is Linux only); use pin=None or False")
        return [None] * n
    busy = busy or {}
    cores = sorted(cores, key=lambda c: busy.get(c, 0))   # stable: in order among equals
    return [(cores[r % len(cores)],) for r in range(n)]


def pin_threads(cores) -> None:
    """Pin every thread of this process to `cores` (threads made later inherit it)."""
    if not cores:
        return
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.sched_setaffinity(int(tid), set(cores))
        except (ProcessLookupError, OSError):  # a thread that just ended
            pass
