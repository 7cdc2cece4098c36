"""Where the loss comes from: the user's `loss_fn(output, targets)`, the model's own
`loss_fn`, or the model's own loss from its labels (Hugging Face models).

`resolve_loss` picks one, in that order: a `loss_fn=` argument; a `loss_fn` attribute of
the model (piper_nb's example models have one); else, when `forward` takes `labels`,
`model_loss`, which calls `model(inputs, labels=targets)` and reads the output's `loss`
(a `ModelOutput`, a dict or an object with `.loss`). `compute_loss` applies the choice;
the captured graph and `reference_train` both go through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

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


def compute_loss(model: nn.Module, loss_fn: Callable, inputs: torch.Tensor,
                 targets: torch.Tensor) -> torch.Tensor:
    if loss_fn is model_loss:
        out = model(inputs, labels=targets)
        loss = out["loss"] if isinstance(out, dict) else getattr(out, "loss", None)
        if loss is None:
            raise PlanError(f"{type(model).__name__}(inputs, labels=targets) returned no loss; "
                            "pass loss_fn=(output, targets) -> loss")
        return loss
    return loss_fn(model(inputs), targets)
