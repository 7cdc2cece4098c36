"""BatchNorm across data-parallel replicas: statistics over the whole microbatch.

One process normalizes each microbatch with its own mean and variance. Data-parallel
replicas each hold a share of it; normalizing the share alone (what DDP does without
SyncBatchNorm) computes another model. So, in a replicated region, the worker swaps each
BatchNorm for `SyncedBatchNorm`, which sums the statistics over the region's replica
group (two blocking all-reduces: the mean, then the squared deviations, as the one-process
kernel computes them) and whose backward sums the gradients of those statistics the same
way (autograd through `_AllReduce`). The running statistics then move exactly as one
process's, on every replica. PyTorch's `nn.SyncBatchNorm` does this on GPUs only; this
works on CPU (gloo) too. The exchanges run inside F and B, on a group of the replicas' own
(`Comm.bn_groups`, never shared with the plan's collectives, so they cannot meet one of
those out of order under NCCL), in the same order on every replica (replicas run the same
program); plans do not show them and the simulator does not cost them. Nothing here stops
the host: the cumulative average's factor stays a tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["SyncedBatchNorm", "sync_batchnorms"]


class _AllReduce(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients over it too."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncedBatchNorm(nn.Module):
    """`bn` (its parameters and buffers, the same tensors) normalizing over the process
    group `group()` returns (looked up at the first forward)."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, group):
        super().__init__()
        self.bn, self._group = bn, group

    @property
    def group(self):
        return self._group()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if not (bn.training or bn.running_mean is None):
            return bn(x)
        dims = [0, *range(2, x.dim())]
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        local = torch.cat([x.sum(dims), x.new_tensor([x.numel() / x.shape[1]])])
        total = _AllReduce.apply(local, self.group)
        n = total[-1].detach()
        mean = total[:-1] / n
        dev = x - mean.view(shape)
        var = _AllReduce.apply((dev * dev).sum(dims), self.group) / n
        y = dev * torch.rsqrt(var.view(shape) + bn.eps)
        if bn.affine:
            y = y * bn.weight.view(shape) + bn.bias.view(shape)
        if bn.track_running_stats and bn.training:
            with torch.no_grad():
                bn.num_batches_tracked.add_(1)
                if bn.momentum is None:   # a cumulative average: 1/count, kept on the device
                    f = 1.0 / bn.num_batches_tracked.double()   # (float() would stop the host)
                    bn.running_mean.mul_(1 - f).add_(mean.detach() * f)
                    bn.running_var.mul_(1 - f).add_(var.detach() * n / (n - 1) * f)
                else:
                    f = bn.momentum
                    bn.running_mean.mul_(1 - f).add_(mean.detach(), alpha=f)
                    bn.running_var.mul_(1 - f).add_(var.detach() * n / (n - 1), alpha=f)
        return y


def sync_batchnorms(module: nn.Module, group) -> int:
    """Swap every BatchNorm inside `module` for a SyncedBatchNorm over the process group
    `group()` returns; how many."""
    swapped = 0
    for name, child in list(module.named_modules()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            parent_name, _, leaf = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, leaf, SyncedBatchNorm(child, group))
            swapped += 1
    return swapped
