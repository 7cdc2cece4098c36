"""Launchers that start runtime workers: `LocalCluster` (local processes, the default) and
`IPyParallelCluster` (ipyparallel engines, here or across machines); `JobRank`, this
process as one rank of a torchrun or srun job (`python -m piper_nb launch`); `checkpoint` writes
and reads training checkpoints; `ProgressBar` is a live `progress=` hook for `pn.train`."""

from piper_nb.cluster import checkpoint
from piper_nb.cluster.ipp import IPyParallelCluster
from piper_nb.cluster.job import JobRank
from piper_nb.cluster.local import LocalCluster
from piper_nb.cluster.progress import ProgressBar

__all__ = ["LocalCluster", "IPyParallelCluster", "JobRank", "ProgressBar", "checkpoint"]
