"""The names of what the loss region returns besides values for other regions: the loss, the
count a global-batch loss divides by, and the metrics a loss function reports.

A region's `outputs` list these beside the values it sends on; none is sent, stashed past
its forward's backward or freed by the plan: the worker keeps each forward's loss ends to
report (and, for the count, to all-reduce), the memory model counts only the loss's
gradient seed. Every name here has a colon or is `loss`, so no captured value can take it.
"""

from __future__ import annotations

__all__ = ["LOSS", "COUNT", "METRIC", "is_loss_output", "metric_name", "loss_output_label"]

LOSS = "loss"              # the loss (or, under loss_mean="global", the loss sum)
COUNT = "loss:count"       # loss_mean="global": what the sum over the whole batch divides by
METRIC = "metric:"         # prefix of a metric the loss function returned


def is_loss_output(name: str) -> bool:
    return name == LOSS or name == COUNT or name.startswith(METRIC)


def metric_name(name: str) -> str | None:
    """The user's name of a metric output (None for anything else)."""
    return name[len(METRIC):] if name.startswith(METRIC) else None


def loss_output_label(name: str) -> str:
    """How an error names a loss output: the metric's own name, "the count" or "the loss"."""
    return metric_name(name) or ("the count" if name == COUNT else "the loss")
