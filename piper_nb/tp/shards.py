"""A sharded parameter's pieces: device `rank`'s shard of the whole (`local_shard`) and the
whole from every device's shard (`join_shards`), for weights cut along one dimension into
`degree` shares, each of `blocks` stacked blocks (a fused q, k, v projection) cut alike.
The capture cuts device 0's, each worker its own, and the trained weights are joined back.
"""

from __future__ import annotations

import torch

__all__ = ["local_shard", "join_shards"]


def local_shard(t: torch.Tensor, dim: int, degree: int, blocks: int, rank: int) -> torch.Tensor:
    """Device `rank`'s shard of `t` cut `degree` ways along `dim` (each of `blocks` stacked
    blocks cut alike): a view when there is one block."""
    if blocks == 1:
        n = t.shape[dim] // degree
        return t.narrow(dim, rank * n, n)
    return torch.cat([b.narrow(dim, rank * (b.shape[dim] // degree), b.shape[dim] // degree)
                      for b in t.chunk(blocks, dim)], dim)


def join_shards(shards: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """The whole tensor from every device's shard, in device order (`local_shard`'s inverse)."""
    if blocks == 1:
        return torch.cat(shards, dim)
    cut = [s.chunk(blocks, dim) for s in shards]
    return torch.cat([torch.cat([c[b] for c in cut], dim) for b in range(blocks)], dim)
