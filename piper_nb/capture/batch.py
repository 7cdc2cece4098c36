"""Batches as users have them: `(inputs, targets)`, or a dict of named tensors.

A batch is either a pair `(inputs, targets)`, the model called as `model(inputs)` and the
loss as `loss_fn(output, targets)`; or a dict such as Hugging Face data collators yield
(`input_ids`, `attention_mask`, `position_ids`, `labels`), the model called as
`model(**batch)`. Every tensor is split on dim 0 into microbatches (and replicas).
Internally a batch is named: `named_batch` gives `{"inputs": x, "targets": y}` for a pair
and the dict itself otherwise; each name is a value of the captured graph that the first
regions read, and `Plan.batch_names` keeps their order, the order in which a step's
tensors travel to the workers.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from piper_nb.errors import PlanError

__all__ = ["PAIR", "named_batch", "batch_size", "samples", "sample_difference",
           "check_samples", "slice_batch", "ordered"]

PAIR = ("inputs", "targets")
_RESERVED = frozenset({"loss"})


def named_batch(batch, where: str = "batch") -> dict[str, torch.Tensor]:
    """The batch as name -> tensor (see the module docstring); PlanError when it is neither
    form or its tensors disagree on the batch size."""
    if isinstance(batch, Mapping):
        named = dict(batch)
        bad = [k for k in named if not isinstance(k, str) or not k.isidentifier()
               or k in _RESERVED]
        if bad:
            raise PlanError(f"{where}: batch keys must be Python identifiers other than "
                            f"'loss', got {bad[0]!r}")
    elif isinstance(batch, (tuple, list)) and len(batch) == 2:
        named = dict(zip(PAIR, batch, strict=True))
    else:
        raise PlanError(f"{where}: a batch is (inputs, targets) or a dict of tensors, got "
                        f"{type(batch).__name__}")
    if not named:
        raise PlanError(f"{where}: the batch is empty")
    for k, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise PlanError(f"{where}: batch[{k!r}] must be a tensor with the batch on dim 0, "
                            f"got {type(t).__name__}")
    sizes = {k: t.shape[0] for k, t in named.items()}
    if len(set(sizes.values())) > 1:
        pairs = ", ".join(f"{k}: {n}" for k, n in sizes.items())
        raise PlanError(f"{where}: the batch's tensors disagree on the batch size ({pairs})")
    return named


def batch_size(named: Mapping[str, torch.Tensor]) -> int:
    return next(iter(named.values())).shape[0]


def samples(named: Mapping[str, torch.Tensor]) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    """What one sample of each tensor is: (name, shape without the batch dim, dtype). A plan
    is compiled for these (receive buffers, the recorded shapes), as for its batch size."""
    return tuple((k, tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))
                 for k, t in named.items())


def sample_difference(expected: tuple, named: Mapping[str, torch.Tensor]) -> tuple | None:
    """The first tensor, of those both have, whose samples differ from `expected` (a plan's
    `samples`): (name, (shape, dtype) given, (shape, dtype) expected); None when none does."""
    want = {k: (shape, dtype) for k, shape, dtype in expected}
    return next(((k, (shape, dtype), want[k]) for k, shape, dtype in samples(named)
                 if k in want and want[k] != (shape, dtype)), None)


def check_samples(expected: tuple, named: Mapping[str, torch.Tensor], where: str,
                  fix: str) -> None:
    """PlanError when the batch's samples differ from `expected` (a plan's `samples`): a
    sequence length or dtype the plan was not compiled for. `fix` says what to do."""
    diff = sample_difference(expected, named)
    if diff is None:
        return
    k, (shape, dtype), (w_shape, w_dtype) = diff
    got, exp = (f"shape {list(shape)}", f"{list(w_shape)}") if shape != w_shape else (
        f"dtype {dtype}", w_dtype)
    raise PlanError(f"{where}: batch[{k!r}] has per-sample {got} but the plan was "
                    f"compiled for {exp}; {fix}")


def slice_batch(named: Mapping[str, torch.Tensor], part: slice) -> dict[str, torch.Tensor]:
    return {k: t[part] for k, t in named.items()}


def ordered(named: Mapping[str, torch.Tensor], names: tuple[str, ...], where: str
            ) -> tuple[torch.Tensor, ...]:
    """The tensors of `named` in the plan's order `names` (PlanError when keys differ)."""
    if tuple(sorted(named)) != tuple(sorted(names)):
        raise PlanError(f"{where}: the batch has {sorted(named)} but the plan was compiled for "
                        f"{sorted(names)}")
    return tuple(named[n] for n in names)
