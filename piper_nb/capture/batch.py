"""Batches as users have them: `(inputs, targets)`, or a dict of named tensors.

A batch is either a pair `(inputs, targets)`, the model called as `model(inputs)` and the
loss as `loss_fn(output, targets)`; or a dict such as Hugging Face data collators yield
(`input_ids`, `attention_mask`, `position_ids`, `labels`), the model called as
`model(**batch)`. Every tensor is split on dim 0 into microbatches (and replicas).

Internally a batch is a `Batch`: an immutable mapping name -> tensor, `{"inputs": x,
"targets": y}` for a pair and the dict's entries otherwise, checked once. It is made once,
at the front door (`Batch.of` in `pn.compile`, the batches `pn.train` and
`pn.reference_train` draw, `pn.Designer`, `cluster.step`), and travels as that value down
to the workers; `Batch.of` returns a `Batch` as it is. Each name is a value of the captured
graph that the first regions read, and `Plan.batch_names` keeps their order, the order in
which a step's batch travels to the workers (`Batch.in_order`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from piper_nb.errors import PlanError

__all__ = ["PAIR", "Batch"]

PAIR = ("inputs", "targets")
_RESERVED = frozenset({"loss"})


class Batch(Mapping[str, torch.Tensor]):
    """A named batch (see the module docstring): made by `Batch.of` (or `Batch.ordered`
    from a plan's tensors in order), never changed; it pickles as its plain dict."""

    __slots__ = ("_tensors",)

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        """Trusted: `tensors` already checked (use `Batch.of` for anything a user gave)."""
        object.__setattr__(self, "_tensors", dict(tensors))

    def __setattr__(self, name, value):
        raise AttributeError("a Batch is immutable")

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __reduce__(self):
        return Batch, (self._tensors,)

    def __repr__(self) -> str:
        return "Batch(" + ", ".join(f"{k}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                                    for k, t in self.items()) + ")"

    @classmethod
    def of(cls, batch, where: str = "batch") -> Batch:
        """`batch` named (see the module docstring), a `Batch` as it is; PlanError when it
        is neither form or its tensors disagree on the batch size."""
        if isinstance(batch, Batch):
            return batch
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
        return cls(_checked(named, where))

    @classmethod
    def ordered(cls, names: tuple[str, ...], tensors, where: str) -> Batch:
        """A plan's batch: `tensors` in the order `names` (`Plan.batch_names`), or a `Batch`
        (or dict) put in that order (PlanError when its names differ)."""
        if isinstance(tensors, Mapping):
            return cls.of(tensors, where).in_order(names, where)
        if not isinstance(tensors, Sequence) or len(tensors) != len(names):
            raise PlanError(f"{where}: the plan takes its batch as {len(names)} tensors in the "
                            f"order {list(names)}, got {type(tensors).__name__}")
        return cls(_checked(dict(zip(names, tensors, strict=True)), where))

    @property
    def size(self) -> int:
        """The batch size: every tensor's dim 0."""
        return next(iter(self._tensors.values())).shape[0]

    @property
    def is_pair(self) -> bool:
        """An `(inputs, targets)` batch: the model is called on `inputs` alone."""
        return tuple(self._tensors) == PAIR

    @property
    def samples(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """What one sample of each tensor is: (name, shape without the batch dim, dtype). A
        plan is compiled for these (receive buffers, the recorded shapes), as for its size."""
        return tuple((k, tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))
                     for k, t in self._tensors.items())

    def slice(self, part: slice) -> Batch:
        """The samples `part` of every tensor."""
        return Batch({k: t[part] for k, t in self._tensors.items()})

    def cast(self, dtype: torch.dtype) -> Batch:
        """The floating tensors in `dtype` (token ids stay integers)."""
        return Batch({k: t.to(dtype) if t.is_floating_point() else t
                      for k, t in self._tensors.items()})

    def in_order(self, names: tuple[str, ...], where: str) -> Batch:
        """The same tensors in the plan's order `names` (PlanError when the names differ)."""
        if tuple(self._tensors) == tuple(names):
            return self
        if sorted(self._tensors) != sorted(names):
            raise PlanError(f"{where}: the batch has {sorted(self._tensors)} but the plan was "
                            f"compiled for {sorted(names)}")
        return Batch({n: self._tensors[n] for n in names})

    def model_args(self) -> tuple[tuple, dict]:
        """How the model is called on this batch: `(inputs,)` for a pair, else the dict's
        entries less its `labels` as keywords."""
        if self.is_pair:
            return (self._tensors["inputs"],), {}
        return (), {k: v for k, v in self._tensors.items() if k != "labels"}

    def sample_difference(self, expected: tuple) -> tuple | None:
        """The first tensor, of those both have, whose samples differ from `expected` (a
        plan's `samples`): (name, (shape, dtype) given, (shape, dtype) expected); None when
        none does."""
        want = {k: (shape, dtype) for k, shape, dtype in expected}
        return next(((k, (shape, dtype), want[k]) for k, shape, dtype in self.samples
                     if k in want and want[k] != (shape, dtype)), None)

    def check_samples(self, expected: tuple, where: str, fix: str) -> None:
        """PlanError when the samples differ from `expected` (a plan's `samples`): a sequence
        length or dtype the plan was not compiled for. `fix` says what to do."""
        diff = self.sample_difference(expected)
        if diff is None:
            return
        k, (shape, dtype), (w_shape, w_dtype) = diff
        got, exp = (f"shape {list(shape)}", f"{list(w_shape)}") if shape != w_shape else (
            f"dtype {dtype}", w_dtype)
        raise PlanError(f"{where}: batch[{k!r}] has per-sample {got} but the plan was "
                        f"compiled for {exp}; {fix}")


def _checked(named: dict, where: str) -> dict:
    """`named` when it holds tensors with the batch on dim 0, all of one batch size."""
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
