"""Errors a user can cause, each naming what is wrong and how to fix it.

`PlanError` is raised before anything runs (bad annotations, directives, schedules);
`RuntimeFailure` when a worker fails while running a plan; `WorkerLost` when a worker
disappears. Messages name the directive index, tag, device or file involved.
`InternalError` is piper_nb's own bug, never the user's (a registered directive that no
compiler pass applies, say): it says so, and what to report.
"""

from __future__ import annotations

__all__ = ["PlanError", "RuntimeFailure", "WorkerLost", "InternalError"]


class PlanError(ValueError):
    """A strategy that cannot be compiled or would not run correctly.

    `directive` is the index of the offending directive in the program (None when the
    problem is not tied to one), so tools can point at the row to fix.
    """

    def __init__(self, message: str, *, directive: int | None = None, op: str | None = None):
        self.directive = directive
        self.op = op
        self.reason = message
        prefix = ""
        if directive is not None:
            prefix = f"directive #{directive}" + (f" ({op})" if op else "") + ": "
        super().__init__(prefix + message)

    def at(self, directive: int, op: str | None = None) -> PlanError:
        """The same error attributed to directive `directive` (keeps an existing index)."""
        if self.directive is not None:
            return self
        err = type(self)(self.reason, directive=directive, op=op)
        err.__cause__ = self.__cause__
        return err


class RuntimeFailure(RuntimeError):
    """A worker raised while executing its plan (`step`: the training step, when known)."""

    def __init__(self, message: str, *, device: int | None = None, instruction: str | None = None,
                 original: str | None = None, step: int | None = None):
        self.device = device
        self.instruction = instruction
        self.original = original
        self.step = step
        self.message = message
        super().__init__(message if step is None else f"step {step}: {message}")

    def at_step(self, step: int) -> RuntimeFailure:
        """The same failure, naming the training step it happened in (kept if named)."""
        if self.step is not None:
            return self
        err = type(self)(self.message, device=self.device, instruction=self.instruction,
                         original=self.original, step=step)
        err.__cause__ = self.__cause__
        return err


class WorkerLost(RuntimeFailure):
    """A worker process or engine died or stopped answering."""


class InternalError(RuntimeError):
    """A bug in piper_nb, not in the user's program: please report it with the message."""

    def __init__(self, message: str):
        super().__init__(f"internal error in piper_nb (please report it): {message}")
