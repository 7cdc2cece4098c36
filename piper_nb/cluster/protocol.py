"""The commands every cluster answers, the protocol `pn.train` and the Designer use.

A cluster (`LocalCluster`, `IPyParallelCluster`) only knows how to start its workers
(`start`) and run one command on every rank (`_run`); shipping each plan once (`_key`) and
the commands themselves, `reset`, `step`, `state` and the checkpoint pair, are the same
for all.
"""

from __future__ import annotations

import os

from piper_nb.capture.batch import Batch
from piper_nb.errors import PlanError
from piper_nb.runtime.bundle import make_bundle
from piper_nb.runtime.layout import assemble_state
from piper_nb.runtime.worker import FAIL_ENV

__all__ = ["ClusterCommands"]


class ClusterCommands:
    n: int

    _loaded: list[tuple[object, int]]   # (plan, key) the running workers have
    _next_key: int

    def start(self):
        raise NotImplementedError

    def _key(self, plan) -> int:
        """Start the workers if needed and ship `plan` unless they have it already."""
        if plan.world > self.n:
            raise PlanError(f"the plan needs {plan.world} devices but the cluster has {self.n}; "
                            f"use pn.{type(self).__name__}({plan.world})")
        self.start()
        for p, key in self._loaded:
            if p is plan:
                return key
        blob = make_bundle(plan)
        key = self._next_key
        self._next_key += 1
        self._run("load", key, blob)
        self._loaded.append((plan, key))
        return key

    def _run(self, op: str, key, payload=None, per_rank: list | None = None) -> dict[int, object]:
        """Send `op` to every rank (`per_rank[r]`, or `payload` to all); answers by rank."""
        raise NotImplementedError

    def reset(self, plan, optimizer, seed: int = 0) -> None:
        """Ship `plan` if the workers do not have it yet; parameters and buffers back to the
        model's, fresh optimizer state; `seed` seeds every forward's random operations."""
        self._run("reset", self._key(plan), (optimizer, seed))

    def step(self, plan, batch, trace: bool = True, record_streams: bool = False) -> list[dict]:
        """One training step of `plan` on `batch` (a `Batch`, as `pn.train` draws them, or
        its tensors in the order of `plan.batch_names`), shipped to the workers as that
        `Batch`; per rank: loss, end, events and (when `trace`) memory samples and, for an
        expert plan, the routing it made; with `record_streams`, what each of its streams
        executed (`"streams"`)."""
        batch = Batch.ordered(plan.batch_names, batch, "cluster.step")
        batch.check_samples(plan.samples, "cluster.step", "compile a plan for this batch "
                            "(pn.compile, or piper_nb.compiler.compile.rebatch(plan, batch)); "
                            "pn.train does so itself")
        out = self._run("step", self._key(plan), (batch, os.environ.get(FAIL_ENV), trace,
                                                  record_streams))
        return [out[r] for r in range(self.n)]

    def state(self, plan) -> dict:
        """Canonical parameter name -> full tensor, gathered from the workers."""
        out = self._run("state", self._key(plan))
        return assemble_state(plan, [out[r] for r in range(self.n)])

    def train_state(self, plan) -> list[dict]:
        """Per rank: parameters, optimizer state and step count (for `cluster.checkpoint`)."""
        out = self._run("train_state", self._key(plan))
        return [out[r] for r in range(self.n)]

    def load_train_state(self, plan, states: list[dict]) -> None:
        """Give every rank its part of a checkpoint (after `reset`)."""
        if len(states) != self.n:
            raise ValueError(f"load_train_state: {len(states)} states for {self.n} ranks")
        self._run("load_train_state", self._key(plan), per_rank=list(states))
