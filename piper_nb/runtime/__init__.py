"""The runtime: executes per-device plans on torch.distributed workers.

`worker.Worker` runs one `DevicePlan` per step (F, B, BI, BW, U, SEND, RECV, collectives,
WAIT, FREE), `exchange` the ALL_TO_ALL token exchange of expert parallelism, `stores` keeps
parameters, shards and values, `comm` issues asynchronous communication, `timing` measures
events and memory into a `Trace`, `process.serve` is the worker process's command loop, and
`layout` holds the flat-buffer arithmetic the driver shares. This package is the only one
that imports torch.distributed.
"""

from piper_nb.runtime.bundle import Bundle, make_bundle, param_aliases
from piper_nb.runtime.layout import Layout, assemble_state, batch_part, bucket_layouts

__all__ = ["Bundle", "make_bundle", "param_aliases", "Layout", "assemble_state", "batch_part",
           "bucket_layouts"]
