"""A step's labels under context parallelism and the microbatch mean: each device's loss is
the mean over the labels its share holds, and the plan averages the members' means, which
is the slice's mean only when every member counts as many labels. PyTorch's losses skip
the label -100 (`ignore_index`), and a causal LM's shifted labels end in it, so the shares
of one slice can count differently. `check_shares` finds that in a step's batch before the
step is sent, and says to use the global mean (`loss_mean="global"`, exact whatever the
counts) instead of training a loss that is not the one asked for.
"""

from __future__ import annotations

import torch

from piper_nb.capture.ring_attention import take_share
from piper_nb.errors import PlanError

__all__ = ["IGNORED", "check_shares"]

IGNORED = -100   # PyTorch's default ignore_index (cross_entropy, nll_loss)


def check_shares(plan, batch, step: int) -> None:
    """PlanError when, under the microbatch mean, a batch input cut along the sequence
    holds ignored labels unevenly over the context group's shares of one slice the loss
    is averaged over (`Plan.reference_microbatches` slices, in batch order)."""
    if plan.loss_mean == "global":
        return
    loss = next((r for r in plan.regions if r.has_loss and r.context), None)
    if loss is None:
        return
    degree, balance, _ = loss.context
    cut = sorted({v for r in plan.regions if r.context for v in r.context[2]})
    slices = plan.reference_microbatches
    for name in cut:
        t = batch.get(name)
        if t is None or t.is_floating_point() or t.dim() < 2:
            continue
        ignored = t == IGNORED
        if not ignored.any():
            continue
        for k, part in enumerate(torch.tensor_split(ignored, slices)):
            counts = [int(take_share(part, degree, r, balance).sum()) for r in range(degree)]
            if len(set(counts)) > 1:
                raise PlanError(
                    f"step {step}: context_parallel: batch input {name!r} holds ignored labels "
                    f"({IGNORED}) unevenly over the context group's shares of slice {k} "
                    f"({counts} of {part[:, :t.shape[1] // degree].numel()} tokens a share): "
                    "under loss_mean='microbatch' each device's loss is the mean over its own "
                    "labels and the plan averages those means, which is not the slice's mean; "
                    "compile with loss_mean='global' (the sum over every device's labels over "
                    "their count, as torchtitan trains)", op="context_parallel")
