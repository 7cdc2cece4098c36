"""Where the loss comes from: the user's `loss_fn(output, targets)`, the model's own
`loss_fn`, or the model's own loss from its labels (Hugging Face models).

`resolve_loss` picks one, in that order: a `loss_fn=` argument; a `loss_fn` attribute of
the model (piper_nb's example models have one); else, when `forward` takes `labels`,
`model_loss`, which calls `model(inputs, labels=targets)` and reads the output's `loss`
(a `ModelOutput`, a dict or an object with `.loss`). `compute_loss` applies the choice to a
named batch (`capture.batch`): a pair calls `model(inputs)`, a dict `model(**batch)`, with
`labels` held back for a `loss_fn` (`loss_fn(model(**rest), labels)`). The captured graph
and `reference_train` both go through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from piper_nb.capture.batch import PAIR
from piper_nb.errors import PlanError

__all__ = ["model_loss", "resolve_loss", "compute_loss"]


def model_loss(output, targets):
    """The model's own loss: `forward(inputs, labels=targets).loss` (see `compute_loss`)."""
    raise TypeError("model_loss is applied by compute_loss(model, model_loss, inputs, targets)")


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


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
                    f"loss to {where}, or give forward a labels argument that makes it "
                    "return its loss")


def compute_loss(model: nn.Module, loss_fn: Callable, batch: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
    """The loss of `model` on the named `batch` (see the module docstring)."""
    if tuple(batch) == PAIR:
        inputs, targets = batch["inputs"], batch["targets"]
        if loss_fn is model_loss:
            return _own(model, model(inputs, labels=targets))
        return loss_fn(model(inputs), targets)
    if loss_fn is model_loss:
        return _own(model, model(**batch))
    if "labels" not in batch:
        raise PlanError(f"a dict batch with a loss_fn needs a 'labels' entry (the targets); "
                        f"the batch has {', '.join(batch)}")
    rest = {k: v for k, v in batch.items() if k != "labels"}
    return loss_fn(model(**rest), batch["labels"])


def _own(model: nn.Module, out) -> torch.Tensor:
    loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None:
        raise PlanError(f"{type(model).__name__} returned no loss for the batch's labels; "
                        "pass loss_fn=(output, targets) -> loss")
    return loss
