"""One candidate of a search: `Candidate` (its knobs, figures, reason, and what builds it)
and `Status` (where its figures come from, or that it was refused). The table over them
is `planner.result`, the picture `planner.frontier`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from piper_nb.planner.knobs import Knobs

__all__ = ["Status", "Candidate", "GIB"]

GIB = 2**30


class Status(StrEnum):
    """Where a candidate's figures come from, or that it was refused."""

    SIMULATED = "simulated"
    ESTIMATED = "estimated"
    REFUSED = "refused"


@dataclass(frozen=True)
class Candidate:
    """One candidate: its knobs, status and figures (`step` in seconds, `tokens_per_s` per
    device, `bubble` the idle share of the step, `peak` in bytes on the device that holds
    most), the reason it was refused, and the `annotation` (a `pn.annotate` mapping) and
    `program` (a `pn.Program`) that build it; a simulated one keeps its `plan` and `trace`
    (so it is not compiled again to be drawn or launched)."""

    knobs: Knobs
    status: Status
    step: float | None = None            # seconds (or the cost model's unit)
    tokens_per_s: float | None = None    # per device
    bubble: float | None = None          # idle share of the step, averaged over devices
    peak: float | None = None            # bytes, the device that holds most
    reason: str = ""
    annotation: dict = field(default_factory=dict, compare=False, repr=False)
    program: object = field(default=None, compare=False, repr=False)   # pn.Program
    plan: object = field(default=None, compare=False, repr=False)      # pn.Plan, simulated
    trace: object = field(default=None, compare=False, repr=False)     # its Trace

    def row(self, batch: int) -> dict:
        k = self.knobs
        return {"PP": k.pp, "TP": k.tp, "CP": k.cp, "DP": k.dp, "EP": k.ep, "ZeRO": k.zero,
                "schedule": str(k.schedule), "micro": k.microbatches,
                "mb size": batch // (k.dp * k.microbatches),
                "recompute": (k.recompute if k.every == 1 else
                              f"{k.recompute} (1 in {k.every})"),
                "SP": "yes" if k.sp else "", "Float8": "yes" if k.float8 else "",
                "step s": self.step,
                "tok/s/dev": self.tokens_per_s, "bubble": self.bubble,
                "peak GiB": None if self.peak is None else self.peak / GIB,
                "status": str(self.status), "reason": self.reason}
