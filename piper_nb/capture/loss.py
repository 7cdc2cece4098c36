"""Where the loss comes from: the user's `loss_fn(output, targets)`, the model's own
`loss_fn`, or the model's own loss from its labels (Hugging Face models); and what it returns.

`resolve_loss` picks one, in that order: a `loss_fn=` argument; a `loss_fn` attribute of
the model (piper_nb's example models have one); else, when `forward` takes `labels` (or
wraps a model that does, as peft's models do), `model_loss`, which calls
`model(inputs, labels=targets)` and reads the output's `loss` (a `ModelOutput`, a dict or
an object with `.loss`). `compute_loss` applies the choice to a named batch
(`capture.batch`): a pair calls `model(inputs)`, a dict `model(**batch)`, with `labels` held
back for a `loss_fn` (`loss_fn(model(**rest), labels)`). The captured graph and
`reference_train` both go through it.

What a loss returns, per `LOSS_MEANS`:
- `"microbatch"` (the default): the microbatch's mean loss; the step's loss is the mean of
  the microbatches' (what `torch.distributed.pipelining` computes). A loss_fn may also
  return `(loss, metrics)` or `{"loss": loss, **metrics}`, metrics a dict of scalar tensors.
- `"global"`: the loss over the whole batch, whatever the plan: the loss returns
  `(sum, count)` (or `(sum, count, metrics)`), and the step minimises the sum over every
  microbatch and replica divided by the count over all of them. A Hugging Face model's own
  loss becomes its token sum (`num_items_in_batch=1`) and the count its labels other than
  -100, the next-token labels `labels[..., 1:]` for causal LMs: the Trainer's
  `num_items_in_batch` with `average_tokens_across_devices`.
`LossParts` is what either form gives: the loss (or sum), the count and the metrics.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from piper_nb.capture.batch import PAIR
from piper_nb.errors import PlanError
from piper_nb.ir.loss_outputs import COUNT, METRIC

__all__ = ["model_loss", "resolve_loss", "compute_loss", "LossParts", "LOSS_MEANS",
           "check_loss_mean"]

LOSS_MEANS = ("microbatch", "global")


def check_loss_mean(loss_mean: str) -> str:
    if loss_mean not in LOSS_MEANS:
        raise PlanError(f"loss_mean={loss_mean!r}: choose 'microbatch' (the mean of the "
                        "microbatches' mean losses, the default) or 'global' (the loss over the "
                        "whole batch: sum / count over every microbatch and replica)")
    return loss_mean


@dataclass(frozen=True)
class LossParts:
    """A loss as the plan carries it: `loss` (a mean, or under "global" a sum), `count` (what
    the sum is divided by: "global" only) and named scalar `metrics`."""

    loss: torch.Tensor
    count: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def flat(self) -> tuple:
        """(loss, [count,] *metrics): the captured graph's outputs, in `names()` order."""
        return (self.loss, *(() if self.count is None else (self.count,)),
                *self.metrics.values())

    def names(self) -> tuple[str, ...]:
        """The names of `flat()[1:]` (`ir.loss_outputs`): COUNT, then one per metric."""
        return (*(() if self.count is None else (COUNT,)),
                *(f"{METRIC}{k}" for k in self.metrics))


def model_loss(output, targets):
    """The model's own loss: `forward(inputs, labels=targets).loss` (see `compute_loss`)."""
    raise TypeError("model_loss is applied by compute_loss(model, model_loss, inputs, targets)")


def _takes_labels(model: nn.Module) -> bool:
    """`forward` takes `labels`, or takes `**kwargs` and wraps a model that does (peft's
    `PeftModel` without a task type)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    if "labels" in params:
        return True
    base = getattr(model, "get_base_model", None)
    wraps = callable(base) and base() is not model
    return wraps and any(p.kind == p.VAR_KEYWORD for p in params.values()) and \
        _takes_labels(base())


def resolve_loss(model: nn.Module, loss_fn: Callable | None, where: str) -> Callable:
    """The loss to use (see the module docstring); PlanError naming `where` when none."""
    if loss_fn is not None:
        return loss_fn
    own = getattr(model, "loss_fn", None)
    if callable(own):
        return own
    if _takes_labels(model):
        return model_loss
    raise PlanError(f"{type(model).__name__} has no loss: pass loss_fn=(output, targets) -> "
                    f"loss to {where} (from a dict batch, the targets are its 'labels' entry, "
                    "and the other entries are forward's arguments), or give forward a labels "
                    "argument that makes it return its loss")


def compute_loss(model: nn.Module, loss_fn: Callable, batch: dict[str, torch.Tensor],
                 loss_mean: str = "microbatch") -> LossParts:
    """The loss of `model` on the named `batch` (see the module docstring)."""
    if loss_fn is model_loss:
        return _own(model, batch, loss_mean)
    if tuple(batch) == PAIR:
        out = loss_fn(model(batch["inputs"]), batch["targets"])
    else:
        if "labels" not in batch:
            raise PlanError(f"a dict batch with a loss_fn needs a 'labels' entry (the targets); "
                            f"the batch has {', '.join(batch)}")
        rest = {k: v for k, v in batch.items() if k != "labels"}
        out = loss_fn(model(**rest), batch["labels"])
    return _parts(out, loss_mean, getattr(loss_fn, "__qualname__", "loss_fn"))


def _parts(out, loss_mean: str, name: str) -> LossParts:
    """What `loss_fn` returned, in the form `loss_mean` asks for (module docstring)."""
    if loss_mean == "global":
        if not (isinstance(out, tuple) and len(out) in (2, 3)
                and all(_tensor(t) for t in out[:2])):
            raise PlanError(f"loss_mean='global': {name} must return (sum, count), or (sum, "
                            "count, metrics): the loss summed over the microbatch and what that "
                            "sum is divided by over the whole batch (e.g. the labels other than "
                            f"-100), got {_kind(out)}")
        metrics = out[2] if len(out) == 3 else {}
        return LossParts(out[0], out[1], _metrics(metrics, name))
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise PlanError(f"{name} returned a dict without 'loss' (keys {', '.join(out)}); "
                            "return {'loss': loss, **metrics} or (loss, metrics)")
        return LossParts(out["loss"], None, _metrics({k: v for k, v in out.items()
                                                      if k != "loss"}, name))
    if isinstance(out, tuple):
        if len(out) == 2 and isinstance(out[1], Mapping) and _tensor(out[0]):
            return LossParts(out[0], None, _metrics(out[1], name))
        raise PlanError(f"{name} returned a tuple of {len(out)}: return the loss, (loss, "
                        "metrics) with metrics a dict of scalar tensors, or {'loss': loss, "
                        "**metrics}; (sum, count) is the form of loss_mean='global'")
    if not _tensor(out):
        raise PlanError(f"{name} returned {_kind(out)}, not a loss tensor")
    return LossParts(out)


def _tensor(t) -> bool:
    return isinstance(t, (torch.Tensor, torch.fx.Proxy))


def _kind(out) -> str:
    if isinstance(out, tuple):
        return f"a tuple of {len(out)}"
    if _tensor(out):
        return "one tensor (a mean?)"
    return type(out).__name__


def _metrics(metrics, name: str) -> dict:
    if not isinstance(metrics, Mapping):
        raise PlanError(f"{name}: metrics must be a dict of name -> scalar tensor, got "
                        f"{type(metrics).__name__}")
    bad = [k for k, v in metrics.items() if not isinstance(k, str) or not _tensor(v)]
    if bad:
        raise PlanError(f"{name}: metric {bad[0]!r} must be a scalar tensor under a string name "
                        "(use torch.as_tensor, or .detach() of a tensor)")
    return dict(metrics)


def _own(model: nn.Module, batch: dict, loss_mean: str) -> LossParts:
    """The model's own loss from its labels; under "global", its sum and the label count."""
    pair = tuple(batch) == PAIR
    labels = batch["targets"] if pair else batch.get("labels")
    extra = {"num_items_in_batch": 1} if loss_mean == "global" else {}
    if loss_mean == "global":
        _check_loss_kwargs(model)
    out = (model(batch["inputs"], labels=labels, **extra) if pair else
           model(**batch, **extra))
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise PlanError(f"{type(model).__name__} returned no loss for the batch's labels; "
                        "pass loss_fn=(output, targets) -> loss")
    if loss_mean != "global":
        return LossParts(loss)
    if labels is None:
        raise PlanError("loss_mean='global' counts the batch's labels: the batch has no "
                        "'labels'")
    counted = batch.get("shift_labels")
    if counted is None:
        counted = labels[..., 1:] if _shifts_labels(model) else labels
    return LossParts(loss, (counted != -100).sum())


def _check_loss_kwargs(model: nn.Module) -> None:
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        params = ()
    if not any(p.kind == p.VAR_KEYWORD or p.name == "num_items_in_batch" for p in params):
        raise PlanError(f"loss_mean='global': {type(model).__name__}.forward takes no "
                        "num_items_in_batch (no **kwargs), so its loss cannot be summed over "
                        "the whole batch; pass loss_fn=(output, labels) -> (sum, count)")


def _shifts_labels(model: nn.Module) -> bool:
    """The model's loss predicts labels[..., 1:] (causal LMs), as the Trainer decides it."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(inner, "config", None)
    return (LOSS_MAPPING.get(getattr(inner, "loss_type", None)) is ForCausalLMLoss
            and not getattr(config, "is_encoder_decoder", False))
