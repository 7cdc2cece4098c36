"""`shard`: expert parallelism (Piper's shard). Placeholder until all-to-all lands."""

from __future__ import annotations

from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG

__all__ = ["shard_placement", "apply_shard", "insert_all_to_all"]


def shard_placement(dag: TrainingDAG, directive):
    raise PlanError("shard is not supported yet")


def apply_shard(dag: TrainingDAG, directive) -> TrainingDAG:
    return dag


def insert_all_to_all(dag: TrainingDAG, experts: frozenset[int]) -> TrainingDAG:
    return dag
