"""Launchers that start runtime workers: `LocalCluster` (local processes, the default)."""

from piper_nb.cluster.local import LocalCluster

__all__ = ["LocalCluster"]
