"""Shape propagation: run the regions once on one microbatch slice to learn what flows.

For every value that crosses regions: shape, dtype, whether it carries a gradient. For
every region: the bytes autograd saves for its backward (parameters excluded), and which
of its inputs and outputs it saves (buffers counted as values). The runtime counts saved
bytes the same way (`SavedBytes.split`), so predicted and measured memory agree.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from piper_nb.capture.meta_routing import on_meta
from piper_nb.capture.split import LOSS
from piper_nb.directives.compile_regions import parse_setting
from piper_nb.errors import PlanError
from piper_nb.ir.loss_outputs import is_loss_output, loss_output_label
from piper_nb.plan.sizes import SavedBytes, ValueInfo, storage_key

__all__ = ["propagate", "region_args", "deliver"]


def param_ptrs(capture) -> set[int]:
    ptrs = {storage_key(p) for p in capture.model.parameters()}
    ptrs |= {storage_key(b) for b in capture.model.buffers()}
    # a tensor-parallel shard of stacked blocks is a copy, not a view of the model's tensor
    ptrs |= {storage_key(p) for p in capture.tp_local.values()}
    return ptrs


def region_args(info, vals: dict, batch: frozenset[str]) -> list[torch.Tensor]:
    """A region's inputs as its forward takes them: a float value that is not in the batch
    (names `batch`) becomes a fresh autograd leaf, as the worker detaches what it receives."""
    args = []
    for v in info.inputs:
        t = vals[v]
        if v not in batch and t.is_floating_point():
            t = t.detach().requires_grad_(True)
        args.append(t)
    return args


def _compiled(mod, setting: str):
    """`mod` compiled to measure what it saves as the workers' compile will: inductor's
    graphs (its decompositions, its min-cut partition) run eagerly, without generating
    kernels (`aot_eager_decomp_partition`: the same saved tensors, in a second)."""
    kwargs = parse_setting(setting)
    if kwargs["backend"] == "inductor":
        kwargs = {**kwargs, "backend": "aot_eager_decomp_partition", "mode": None}
    return torch.compile(mod, **kwargs)


def deliver(capture, info, vals: dict) -> None:
    """Context parallelism's point-to-point ring delivers values no region makes
    (`CPLayout.rotations`): on one process each input of region `info` that is one is its
    source's (same shape and dtype), which a region before it made or read."""
    rotations = capture.cp.rotations if capture.cp is not None else {}
    for v in info.inputs:
        if v in rotations and v not in vals:
            vals[v] = vals[rotations[v]]


def _described(batch: dict[str, torch.Tensor]) -> str:
    return ", ".join(f"{k} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                     for k, t in batch.items())


def propagate(capture, batch: dict[str, torch.Tensor], compiled: Mapping[int, str] = {}):  # noqa: B006
    """-> (values: name -> ValueInfo, saved: region -> bytes, loss value, changed: region ->
    the buffers its forward changes, such as BatchNorm's running statistics, kept: region ->
    (inputs, outputs) whose buffers autograd saves, which `saved` leaves out: the stash
    holds them, counted once with the value's buffer; aliases: region -> the (output, input)
    pairs that are one buffer), running the regions on the named
    `batch`. Run inside `capture.untouched` so that the user's model
    keeps its buffers. On the meta device a router's tokens are assumed balanced over its
    experts (`capture.meta_routing`). `compiled` (region -> `Pass.compiled`'s setting) runs
    those regions through `torch.compile` as the workers will, so what they save is what
    AOTAutograd's partition saves; on the meta device they run eagerly (no kernels to
    make), and the model counts what eager autograd saves."""
    meta = any(t.is_meta for t in batch.values())
    return on_meta(meta, _propagate, capture, batch, {} if meta else compiled)


def _propagate(capture, batch: dict[str, torch.Tensor], compiled: Mapping[int, str]):
    vals: dict[str, torch.Tensor] = dict(batch)
    names = frozenset(batch)
    saved: dict[int, int] = {}
    kept: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    aliases: dict[int, tuple[tuple[str, str], ...]] = {}
    changed: dict[int, tuple[str, ...]] = {}
    exclude = param_ptrs(capture)
    loss = None
    for info, mod in zip(capture.regions, capture.modules, strict=True):
        deliver(capture, info, vals)
        args = region_args(info, vals, names)
        before = {n: b.detach().clone() for n, b in mod.named_buffers()}
        batch_args = {storage_key(a) for v, a in zip(info.inputs, args, strict=True)
                      if v in names}
        run = _compiled(mod, compiled[info.index]) if info.index in compiled else mod
        with SavedBytes(exclude | batch_args) as counter:
            try:
                outs = run(*args)
            except PlanError:
                raise
            except Exception as err:   # PyTorch's own words, with where and on what
                raise PlanError(f"region {info.name} fails on the example batch "
                                f"({_described(batch)}): {type(err).__name__}: {err}") from err
        own, ins, outs_kept = counter.split(
            [None if v in names else a for v, a in zip(info.inputs, args, strict=True)], outs)
        saved[info.index] = own
        if ins or outs_kept:
            kept[info.index] = (tuple(info.inputs[i] for i in ins),
                                tuple(info.outputs[i] for i in outs_kept))
        same = _aliases(info, args, outs, names)
        if same:
            aliases[info.index] = same
        moved = [n.removeprefix("model.") for n, b in mod.named_buffers()   # (meta: unknown)
                 if n in before and not b.is_meta and not torch.equal(b, before[n])]
        if moved:
            changed[info.index] = tuple(moved)
        for name, out in zip(info.outputs, outs, strict=True):
            if not isinstance(out, torch.Tensor) and is_loss_output(name):
                what = loss_output_label(name)
                raise PlanError(f"{what} that the loss returns is a {type(out).__name__}, not a "
                                f"tensor (computed in region {info.name}); return it as a tensor: "
                                "a count from tensor operations, e.g. (labels != -100).sum(), "
                                "or torch.as_tensor(n)")
            if not isinstance(out, torch.Tensor):
                raise PlanError(f"value {name!r} leaves region {info.name} but is a "
                                f"{type(out).__name__}, not a tensor; move the cut so only "
                                "tensors cross regions")
            if is_loss_output(name) and out.numel() != 1:
                what = loss_output_label(name)
                raise PlanError(f"{what} is a tensor of shape {list(out.shape)}, computed in "
                                f"region {info.name}; a loss (and each count or metric) must "
                                "be a scalar: reduce it, e.g. .mean() or reduction='mean'")
            if name == LOSS:
                loss = out
            vals[name] = out
    values = {}
    for name, t in vals.items():
        values[name] = ValueInfo(name, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                 bool(t.requires_grad and t.is_floating_point()))
    return values, saved, loss, changed, kept, aliases


def _aliases(info, args, outs, names) -> tuple[tuple[str, str], ...]:
    """(output, input) pairs of a region whose output is its input's buffer (an alias, a
    view of all of it): one buffer however many values name it, as the worker counts."""
    def buffer(t):
        return (storage_key(t), t.storage_offset(), t.numel() * t.element_size())

    mine = {}
    for v, a in zip(info.inputs, args, strict=True):
        if v not in names and isinstance(a, torch.Tensor):
            mine.setdefault(buffer(a), v)
    return tuple((o, mine[buffer(t)]) for o, t in zip(info.outputs, outs, strict=True)
                 if isinstance(t, torch.Tensor) and buffer(t) in mine)
