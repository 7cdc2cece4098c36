"""One list of kinds: what a DAG node or a plan instruction can be (`Op`), why a collective
moves what it moves (`Purpose`), what an edge says (`EdgeKind`), the bytes a device holds
(`Memory`, defined with the trace atoms), and the groups of them every floor asks about.

The enums are string enums (`Op.F == "F"`), so their JSON form is their value and a value
read back compares equal; code names the members, never the strings
(`tests/test_kinds.py` reads the source to keep it so).
"""

from __future__ import annotations

from enum import StrEnum

from piper_nb.trace import Memory

__all__ = ["Op", "Purpose", "Held", "EdgeKind", "Unit", "Memory", "PASSES", "BACKWARDS", "COMPUTE",
           "P2P", "COLLECTIVES", "COMM", "REDUCTIONS", "BUCKET_COLLECTIVES", "PASS_ORDER",
           "PASS_NAMES", "LETTER", "PASS_OF_LETTER", "SHORT"]


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


class Purpose(StrEnum):
    """Why a collective moves what it moves (`Instr.purpose`, a DAG node's `purpose` attr)."""

    NONE = ""                        # point-to-point, compute, waits: no purpose
    GRAD = "grad"                    # a bucket's gradients: all-reduce or reduce-scatter
    PARAM = "param"                  # a bucket's parameters: the all-gather of ZeRO shards
    DISPATCH = "dispatch"            # an all-to-all carrying tokens to the experts
    COMBINE = "combine"              # an all-to-all bringing the experts' outputs back
    NORM = "norm"                    # the all-reduce of the squared gradient norm (clipping)
    COUNT = "count"                  # the all-reduce of the global-batch loss's count
    TP = "tp"                        # tensor parallelism: a sharded part's partial sums, or
                                     # the gradient shares of its inputs (`tensor_parallel`)
    CP = "cp"                        # context parallelism: every member's keys and values
                                     # gathered, their gradients' shares reduce-scattered

    def __str__(self) -> str:
        return self.value


class Held(StrEnum):
    """What a FREE releases: a value's activation or gradient buffer, or a gathered bucket."""

    ACT = "act"                      # `act:x@1`: activation x of microbatch 1
    GRAD = "grad"                    # `grad:x@1`: the gradient of x, microbatch 1
    PARAM = "param"                  # `param:0`: bucket 0's gathered parameters (ZeRO-3)

    def __str__(self) -> str:
        return self.value


class Unit(StrEnum):
    """A forward's part in recomputing a tensor-parallel layer as one unit (`Pass.unit`,
    `compiler.layer_recompute`): its parts keep nothing but the layer's input."""

    NONE = ""                        # an ordinary forward (or one recomputed alone)
    FIRST = "first"                  # a part's forward: no autograd, nothing kept
    AGAIN = "again"                  # the part's forward again, before the layer's backward

    def __str__(self) -> str:
        return self.value


class EdgeKind(StrEnum):
    """What a DAG edge says: a value flows (`data`), or only an order (`temporal`)."""

    DATA = "data"
    TEMPORAL = "temporal"

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
