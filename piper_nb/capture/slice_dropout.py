"""A device's slice of the dropout mask one process draws (`slice_dropout`): what a region
cut along a dimension calls where the model applied dropout, so that each device keeps its
share of the mask of the whole tensor. Tensor parallelism puts it there
(`tp.dropout`); sequence parallelism cuts along the sequence; context parallelism's shares
are chunks of it (`share_dropout`, `cp.rewrite`).

On the CPU the slice equals one process's mask bit for bit (tested). On CUDA,
`torch.nn.functional.dropout` runs a fused kernel that draws otherwise, so there the masks
are statistically, not bitwise, those of one process.
"""

from __future__ import annotations

import torch

from piper_nb.capture.ring_attention import take_share

__all__ = ["slice_dropout", "share_dropout", "share_slice_dropout"]


def slice_dropout(x: torch.Tensor, p: float, train: bool, dim: int, degree: int,
               rank: torch.Tensor) -> torch.Tensor:
    """`F.dropout(whole, p, train)` cut to this device's share `x` along `dim` (`rank` of
    `degree`): the whole mask drawn, this share's slice applied."""
    n = x.shape[dim]
    first = 0 if rank.is_meta else int(rank) * n   # planning on meta: any share's shape
    # a copy: autograd keeps the share only
    return _whole_mask(x, p, train, {dim: degree}, lambda m: m.narrow(dim, first, n).clone())


def share_dropout(x: torch.Tensor, p: float, train: bool, dim: int, degree: int, rank,
                  balance: str) -> torch.Tensor:
    """`F.dropout(whole, p, train)` cut to this device's context share `x` (its chunks of
    the sequence along `dim`, `capture.ring_attention.take_share`): the whole sequence's
    mask drawn, this device's chunks of it applied."""
    return _whole_mask(x, p, train, {dim: degree},
                       lambda m: take_share(m, degree, rank, balance, dim))   # a copy


def share_slice_dropout(x: torch.Tensor, p: float, train: bool, dim: int, degree: int,
                        rank: torch.Tensor, cp_dim: int, cp_degree: int, cp_rank,
                        balance: str) -> torch.Tensor:
    """`slice_dropout` on a context share (context and tensor parallelism together): the
    whole mask drawn, this device's context chunks of it taken along `cp_dim`, then its
    tensor-parallel slice along `dim` (features, or the sequence under sequence
    parallelism: a slice of the share)."""
    n = x.shape[dim]
    first = 0 if rank.is_meta else int(rank) * n
    dim, cp_dim = dim % x.dim(), cp_dim % x.dim()
    scale = {dim: degree}
    scale[cp_dim] = scale.get(cp_dim, 1) * cp_degree
    return _whole_mask(x, p, train, scale, lambda m: take_share(
        m, cp_degree, cp_rank, balance, cp_dim).narrow(dim, first, n))   # a copy


def _whole_mask(x: torch.Tensor, p: float, train: bool, scale: dict[int, int],
                mine) -> torch.Tensor:
    """`x` times `mine(mask)`, the mask drawn as dropout draws it for `x` with
    `scale[d]` times its length along each dimension d."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    shape = list(x.shape)
    for d, k in scale.items():
        shape[d] *= k
    return x * mine(x.new_empty(shape).bernoulli_(1 - p).div_(1 - p))
