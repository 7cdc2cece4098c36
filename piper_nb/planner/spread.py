"""A search's work spread over this machine's cores, in forked worker processes.

Under the analytic cost model, probing a TP class (one compile of the model on the meta
device) and estimating thousands of candidates are pure computation, independent of one
another. On Linux, `fork` hands each worker the model, the probes and the candidates
without pickling them; each worker gives back small values (a `Probe`, a chunk's rows).

Profiled costs time real kernels on this CPU, which workers beside them would slow, so
they stay in the caller's process (`workers` gives 1), as does everything where fork is
unavailable or unsafe: no `fork` start method (Windows; macOS, where it is not the
default), or CUDA initialised in the caller. Workers ignore Ctrl-C: the caller takes it,
and the tasks left then return at once, so the pool ends as a finished one does.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator

__all__ = ["workers", "spread"]

_TASK: tuple | None = None   # (fn, shared): what a forked worker runs; set before the fork
_STOP = None                 # an Event the workers inherit: set, the tasks left return None


def workers(requested: int | None, cost: str) -> int:
    """How many processes a search may use: `requested` (None: one per core this process
    may run on), 1 for profiled costs or where fork is not safe."""
    if cost != "analytic" or not sys.platform.startswith("linux"):
        return 1
    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    import torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return 1
    return requested if requested is not None else len(os.sched_getaffinity(0))


@contextlib.contextmanager
def spread(fn: Callable, shared, items: Iterable, jobs: int) -> Iterator[Iterator]:
    """An iterator of `fn(shared, item)` for each of `items`, in their order, computed by
    `jobs` forked workers (which inherit `shared`); the workers end when the block does,
    finished or not. An exception in a worker is raised here."""
    global _TASK, _STOP
    fork = multiprocessing.get_context("fork")
    _TASK, _STOP = (fn, shared), fork.Event()
    with warnings.catch_warnings():   # Python 3.12+ warns of fork in a threaded process:
        warnings.simplefilter("ignore", DeprecationWarning)   # the workers start no thread
        pool = fork.Pool(jobs, initializer=_start_worker)
    try:
        yield _results(pool.imap(_run, items))
    finally:
        # what is left returns at once, and the pool ends as a finished one does: never
        # `terminate`, which stops reading results first, so a worker writing a large one
        # holds the result queue's lock forever and the termination waits for it
        _STOP.set()
        pool.close()
        pool.join()
        _TASK = _STOP = None


class _Interrupted(Exception):
    """A worker's task interrupted: sent back as an exception, so that the worker lives on
    (one that dies of a KeyboardInterrupt may hold the pool's queue lock, and the pool's
    termination then waits for it forever)."""


def _results(it: Iterator) -> Iterator:
    """The workers' results; an interrupted task is the caller's KeyboardInterrupt."""
    try:
        yield from it
    except _Interrupted:
        raise KeyboardInterrupt from None


def _start_worker() -> None:
    """Ctrl-C is the caller's; one intra-op thread (GNU OpenMP's pool, started by the
    caller's CPU kernels, hangs the first parallel region after a fork)."""
    import torch
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)


def _run(item):
    fn, shared = _TASK
    if _STOP.is_set():   # the caller is done with the results
        return None
    try:
        return fn(shared, item)
    except KeyboardInterrupt:
        raise _Interrupted() from None
