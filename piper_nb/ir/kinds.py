"""One list of kinds: what a DAG node or a plan instruction can be, and the groups of them
every floor asks about. `Op` is a string enum, so `Op.F == "F"` and an instruction's
`kind` (a plain string in its JSON form) is compared against these sets directly.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

__all__ = ["Op", "PASSES", "BACKWARDS", "COMPUTE", "P2P", "COLLECTIVES", "COMM", "REDUCTIONS",
           "BUCKET_COLLECTIVES", "PASS_ORDER", "PASS_NAMES", "LETTER", "PASS_OF_LETTER", "SHORT",
           "Memory"]


class Op(StrEnum):
    F = "F"                          # forward of a region
    B = "B"                          # full backward
    BI = "BI"                        # backward for the inputs' gradients
    BW = "BW"                        # backward for the weights' gradients
    U = "U"                          # optimizer update
    SEND = "SEND"
    RECV = "RECV"
    ALL_REDUCE = "ALL_REDUCE"
    ALL_GATHER = "ALL_GATHER"
    REDUCE_SCATTER = "REDUCE_SCATTER"
    ALL_TO_ALL = "ALL_TO_ALL"
    WAIT = "WAIT"                    # plan only: complete an issued transfer
    FREE = "FREE"                    # plan only: release buffers

    def __str__(self) -> str:
        return self.value


PASSES = frozenset({Op.F, Op.B, Op.BI, Op.BW})          # a region's passes
BACKWARDS = frozenset({Op.B, Op.BI, Op.BW})
COMPUTE = PASSES | {Op.U}                                # what runs on the compute stream
P2P = frozenset({Op.SEND, Op.RECV})
COLLECTIVES = frozenset({Op.ALL_REDUCE, Op.ALL_GATHER, Op.REDUCE_SCATTER, Op.ALL_TO_ALL})
COMM = P2P | COLLECTIVES                                 # issued, then completed by a WAIT
REDUCTIONS = frozenset({Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_TO_ALL})   # move gradients
BUCKET_COLLECTIVES = (Op.ALL_REDUCE, Op.REDUCE_SCATTER, Op.ALL_GATHER)   # over parameter buckets
PASS_ORDER = (Op.F, Op.B, Op.BI, Op.BW)                  # a microbatch's passes in order
PASS_NAMES = ("F", "B", "BI", "BW", "U")                 # the values of a filter's PASS
LETTER = {Op.F: "F", Op.B: "B", Op.BI: "I", Op.BW: "W"}  # PyTorch's action letters
PASS_OF_LETTER = {v: k.value for k, v in LETTER.items()}
SHORT = {Op.ALL_REDUCE: "AR", Op.ALL_GATHER: "AG", Op.REDUCE_SCATTER: "RS", Op.ALL_TO_ALL: "A2A"}


class Memory(IntEnum):
    """The kinds of bytes a device holds (`trace.MemorySample`'s fields, in order)."""

    PARAMS = 0
    GRADS = 1
    OPTIM = 2
    ACTIVATIONS = 3
    BUFFERS = 4
