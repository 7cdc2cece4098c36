"""The ops a region cut along the sequence calls (sequence parallelism, `tp.sequence`;
later context parallelism): a device's slice of the sequence, a slice laid at its offset in
zeros of the whole, a stand-in of the whole's shape for sizes read of a slice, and a module
called with its parameters passed in. They are leaves of the captured code
(`capture.region_code`), so a part's graph keeps them as calls when it is rebuilt on a
worker.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["SEQ_DIM", "member_slice", "narrow_sequence", "pad_sequence", "whole_like",
           "with_params"]

SEQ_DIM = 1          # [batch, sequence, ...]: the dimension the slices cut


def narrow_sequence(x: torch.Tensor, degree: int, rank: torch.Tensor) -> torch.Tensor:
    """This device's slice of `x`'s sequence (`rank` of `degree`), a copy: a view would keep
    the whole alive, and the memory model counts the slice alone."""
    n = x.shape[SEQ_DIM] // degree
    return x.narrow(SEQ_DIM, _first(rank, n), n).clone()


def member_slice(x: torch.Tensor, j: int, n: int) -> torch.Tensor:
    """Member j's slice of `x`'s sequence, of n members (a view)."""
    size = x.shape[SEQ_DIM] // n
    return x.narrow(SEQ_DIM, j * size, size)


def pad_sequence(x: torch.Tensor, degree: int, rank: torch.Tensor) -> torch.Tensor:
    """`x`, this device's slice of the sequence, at its offset in zeros of the whole: summed
    over the group, every device's slice in place (an all-gather as an all-reduce)."""
    n = x.shape[SEQ_DIM]
    shape = list(x.shape)
    shape[SEQ_DIM] = n * degree
    first = _first(rank, n)
    return torch.cat([x.new_zeros(_with(shape, first)), x,
                      x.new_zeros(_with(shape, n * degree - first - n))], SEQ_DIM)


def _first(rank: torch.Tensor, n: int) -> int:
    """Where this device's slice of `n` starts; planning on meta or fake tensors (the
    routed rows' symbolic pass, `compiler.token_rows`), which has no rank: any slice's."""
    if rank.is_meta or isinstance(rank, FakeTensor):
        return 0
    return int(rank) * n


def _with(shape: list, size: int) -> list:
    out = list(shape)
    out[SEQ_DIM] = size
    return out


def whole_like(x: torch.Tensor, degree: int) -> torch.Tensor:
    """A meta tensor of the whole sequence's shape, for the sizes read of slice `x`."""
    return torch.empty(_with(list(x.shape), x.shape[SEQ_DIM] * degree), device="meta")


def with_params(mod: torch.nn.Module, names: tuple, args: tuple, kwargs: dict,
                *params: torch.Tensor):
    """`mod(*args, **kwargs)` with its parameters `names` read from `params` (a module
    called on slices, whose parameters' gradients the group sums)."""
    return torch.func.functional_call(mod, dict(zip(names, params, strict=True)), args, kwargs)
