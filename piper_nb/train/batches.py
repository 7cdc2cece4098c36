"""The batches a run draws, and the plan for each: one batch repeated or a loader's, each
named once as it comes in (`batch_stream`), and the program compiled once per batch size
and per-sample shapes (`BatchPlans`)."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator, Mapping

import torch

from piper_nb.capture.batch import Batch
from piper_nb.compiler.compile import rebatch
from piper_nb.errors import PlanError

__all__ = ["batch_stream", "BatchPlans", "other_plan_step"]


def batch_stream(batch_or_loader, where: str, skip: int = 0) -> Iterator[Batch]:
    """The `Batch` of each step, named once (the front door of `pn.train` and
    `pn.reference_train`): one batch ((inputs, targets) or a dict of tensors) named now and
    repeated, or a loader's batches, each named as it is drawn, after the `skip` a
    checkpoint already trained on. A step's naming errors say `f"{where} {step}"`."""
    if _one_batch(batch_or_loader):
        return itertools.repeat(Batch.of(batch_or_loader, f"{where} {skip + 1}"))
    it = iter(batch_or_loader)
    for s in range(1, skip + 1):
        if next(it, None) is None:
            raise PlanError(f"the loader ran out after {s - 1} batches while skipping the "
                            f"{skip} a checkpoint already trained on")
    return (Batch.of(raw, f"{where} {s}") for s, raw in enumerate(it, skip + 1))


def _one_batch(batch_or_loader) -> bool:
    """One batch rather than a loader: a dict of tensors, or a pair of tensors (a list of
    two batches is a loader)."""
    return (isinstance(batch_or_loader, Mapping) and all(
        isinstance(t, torch.Tensor) for t in batch_or_loader.values())) or (
        isinstance(batch_or_loader, (tuple, list)) and len(batch_or_loader) == 2 and all(
            isinstance(t, torch.Tensor) for t in batch_or_loader))


class BatchPlans:
    """The plan for each batch a loader yields, by batch size and samples (sequence length,
    dtypes): the compiled one, and for another batch (a last, smaller one; a sequence length
    the collator padded to) the same program compiled once for it (`compiler.rebatch`), or,
    for another size under `drop_last`, none: the batch is skipped. Either way the user is
    told, once per kind of batch."""

    def __init__(self, plan, drop_last: bool):
        self.base, self.drop_last, self.told = plan, drop_last, set()
        self.plans = {self.key(plan.batch_size, plan.samples): plan}

    @staticmethod
    def key(size: int, sampled: tuple) -> tuple:
        return size, tuple(sorted(sampled))

    def plan_for(self, batch: Batch, step: int):
        size, base = batch.size, self.base
        if set(batch) != set(base.batch_names):
            return base   # other keys: `Batch.in_order` says which
        key = self.key(size, batch.samples if base.samples else ())
        if key in self.plans:
            return self.plans[key]
        what = self._what(batch, size)
        if size != base.batch_size and self.drop_last:
            self._tell(step, size, f"{what} is skipped (drop_last=True)")
            return None
        try:
            self.plans[key] = rebatch(base, batch)   # clipping included
        except PlanError as err:
            raise PlanError(f"step {step}: {what} cannot be trained: {err.reason}" + (
                "; pass drop_last=True to skip such batches" if size != base.batch_size
                else "")) from None
        self._tell(step, key, f"{what} trains on the same program compiled once for this " + (
            "size" if size != base.batch_size else "shape"))
        return self.plans[key]

    def _what(self, batch: Batch, size: int) -> str:
        base = self.base
        if size != base.batch_size:
            return f"a batch of {size} samples (the plan is for {base.batch_size})"
        k, (shape, dtype), (w_shape, w_dtype) = batch.sample_difference(base.samples)
        return (f"a batch whose {k!r} is {[size, *shape]} {dtype} (the plan is for "
                f"{[size, *w_shape]} {w_dtype})")

    def _tell(self, step: int, key, what: str) -> None:
        if key not in self.told:
            self.told.add(key)
            warnings.warn(f"pn.train step {step}: {what}", stacklevel=5)


def other_plan_step(cluster, base, plan, batch, trace: bool) -> list[dict]:
    """One step on `plan` (compiled for another batch size) continuing `base`'s state: its
    workers take the parameters, optimizer state and step count, run, and hand them back."""
    cluster.load_train_state(plan, cluster.train_state(base))
    outs = cluster.step(plan, batch, trace=trace)
    cluster.load_train_state(base, cluster.train_state(plan))
    return outs


