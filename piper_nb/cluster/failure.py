"""The `RuntimeFailure` a cluster raises when one of its workers raised: one message for
every cluster (`LocalCluster`, `IPyParallelCluster`), naming the device, the instruction,
the command and the worker's traceback."""

from __future__ import annotations

from piper_nb.errors import RuntimeFailure

__all__ = ["worker_failure"]


def worker_failure(where: str, rank: int, info: dict, what: str, stopped: str) -> RuntimeFailure:
    """The error for a worker's report `info` (`error`, `traceback`, `instruction`) during
    `what`: `where` names the device, `stopped` says what the cluster stopped."""
    instr = info.get("instruction")
    at = f" at instruction {instr}" if instr else ""
    return RuntimeFailure(f"{where} failed{at} during {what}: {info['error']}\n"
                          f"--- worker traceback ---\n{info['traceback']}({stopped})",
                          device=rank, instruction=instr, original=info["error"])
