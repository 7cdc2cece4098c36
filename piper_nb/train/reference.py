"""`pn.reference_train`: the plain single-process loop every plan is compared with."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import torch
from torch import nn

from piper_nb.capture.annotate import Spec
from piper_nb.capture.batch import Batch
from piper_nb.capture.loss import check_loss_mean, compute_loss, resolve_loss
from piper_nb.compiler.precision import cast_batch, check_precision
from piper_nb.errors import PlanError
from piper_nb.metrics import StepMetrics, batch_tokens
from piper_nb.optim import check_optimizer
from piper_nb.plan.precision import PRECISIONS
from piper_nb.runtime.bundle import param_aliases
from piper_nb.sim.trace import Event, MemorySample, Trace
from piper_nb.train.batches import batch_stream
from piper_nb.train.reference_rng import RegionSeeds
from piper_nb.train.result import Result, check_materialized, model_template

__all__ = ["reference_train"]


def reference_train(model: nn.Module | Spec, batch, steps: int, microbatches: int,
                    optimizer, loss_fn: Callable | None = None, drop_last: bool = False, *,
                    param_groups: list[dict] | None = None, lr_scheduler: Callable | None = None,
                    clip_grad_norm: float | None = None, precision: str = "fp32",
                    loss_mean: str = "microbatch", seed: int | None = None) -> Result:
    """Single-process training of a deep copy of `model`, microbatch by microbatch: the plain
    PyTorch loop (`optimizer`, `param_groups` and `lr_scheduler` as `pn.train` takes them,
    `torch.nn.utils.clip_grad_norm_` with `clip_grad_norm`); with `drop_last`, a batch of
    another size than the first is skipped, as `pn.train` does. `precision="bf16"` trains a
    bf16 copy with fp32 master weights, as a bf16 plan does (`compiler.precision`): the
    gradients go to the masters in fp32, clipping and the optimizer act on those.
    `loss_mean` as `pn.compile` takes it: "microbatch" minimises the mean of the
    microbatches' mean losses (a plan equals this with `plan.reference_microbatches`),
    "global" the loss over the whole batch, whatever `microbatches` is.

    `seed` draws dropout (any random op) as `pn.train(plan, ..., seed=seed)` does: each
    region's forward of each microbatch seeded alike (`train.reference_rng`), the regions
    named by the tags of `model` when it is the `pn.annotate` spec the plan was compiled
    from. A plan whose forwards see the whole microbatch (pipeline and tensor parallelism)
    then equals this run mask for mask; data-parallel replicas draw their own shards'.
    Without `seed`, torch's generator runs on as it is."""
    if isinstance(model, Spec):
        tags_of, model = model.tags_of, model.model
    else:
        tags_of = _one_region
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise PlanError(f"reference_train: seed must be an integer, got {seed!r}")
    spec = check_optimizer(optimizer, "reference_train", param_groups=param_groups,
                           lr_scheduler=lr_scheduler)
    check_precision(precision, None)
    check_loss_mean(loss_mean)
    check_materialized(model, "reference_train")
    spec.check_patterns((n for n, _ in model.named_parameters(remove_duplicate=False)),
                        "reference_train")
    model = copy.deepcopy(model).to(PRECISIONS[precision])   # in the modes the user set
    loss_fn = resolve_loss(model, loss_fn, "reference_train")
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() if precision != "fp32" else p
               for n, p in params.items() if p.requires_grad}
    groups = [[] for _ in range(len(spec.groups) + 1)]
    for n, m in masters.items():
        groups[spec.group_of(n)].append(m)
    opt, sched = spec.build(groups)
    seeds = None if seed is None else RegionSeeds(model, tags_of, seed)
    batches = batch_stream(batch, "reference_train step")   # each named once
    losses, times, metrics, events, memory = [], [], [], [], []
    first, skipped = None, []
    for s in range(1, steps + 1):
        named = next(batches)
        first = named.size if first is None else first
        if drop_last and named.size != first:
            skipped.append(s)
            continue
        events, t0 = [], time.perf_counter()
        named = cast_batch(named, precision)
        total, means = _reference_passes(model, loss_fn, named, microbatches, params, events,
                                         t0, loss_mean, seeds, s)
        start = time.perf_counter() - t0
        norm, lr = _update(opt, sched, masters, params, clip_grad_norm)
        end = time.perf_counter() - t0
        events.append(Event(0, "compute", "U", "U", start, end, -1, 0, "r0:U"))
        pbytes = sum(p.numel() * p.element_size() for p in params.values())
        obytes = sum(t.numel() * t.element_size() for st in opt.state.values()
                     for t in st.values() if isinstance(t, torch.Tensor))
        memory = [MemorySample(0, end, pbytes, 0, obytes)]
        losses.append(total)
        times.append(end)
        tokens = batch_tokens(named)
        metrics.append(StepMetrics(s, total, end, named.size / end, lr=lr,
                                   grad_norm=norm,
                                   tokens_per_s=None if tokens is None else tokens / end,
                                   metrics=means))
    if seeds is not None:
        seeds.remove()
    trace = Trace(tuple(events), tuple(memory), source="measured", meta={"reference": True})
    canonical = {n: p.detach().clone() for n, p in params.items()}
    return Result(losses, times, trace, canonical, model_template(model), param_aliases(model),
                  skipped=skipped, metrics=metrics,
                  optimizer_state=_named_state(opt, masters))


def _update(opt, sched, masters: dict, params: dict, clip_grad_norm: float | None
            ) -> tuple[float | None, float]:
    """The step's update: the gradients to the masters (in fp32 under bf16), clipped, the
    optimizer's step, the weights from the masters, the scheduler's step; the gradient
    norm (with clipping) and the learning rate the step used."""
    for n, m in masters.items():
        if m is not params[n]:   # bf16: the masters take the gradients in fp32
            m.grad = None if params[n].grad is None else params[n].grad.float()
    norm = None
    if clip_grad_norm is not None:
        norm = float(torch.nn.utils.clip_grad_norm_(
            [m for m in masters.values() if m.grad is not None], clip_grad_norm))
    lr = float(opt.param_groups[-1]["lr"])
    opt.step()
    with torch.no_grad():
        for n, m in masters.items():
            if m is not params[n]:
                params[n].copy_(m)
    if sched is not None:
        sched.step()
    return norm, lr


def _one_region(path: str) -> dict:
    """The tags of every module of an unannotated model: it is one region, `PP=0`."""
    return {"PP": 0}


def _named_state(opt, masters: dict) -> dict:
    """`opt.state_dict()` keyed by parameter names, as `Result.optimizer_state_dict` is."""
    by_tensor = {id(m): n for n, m in masters.items()}
    return {"state": {by_tensor[id(t)]: {k: v.detach().clone() if isinstance(
        v, torch.Tensor) else v for k, v in st.items()} for t, st in opt.state.items()},
        "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                          "params": [by_tensor[id(t)] for t in g["params"]]}
                         for g in opt.param_groups]}


def _reference_passes(model, loss_fn, named: Batch, microbatches: int, params: dict,
                      events: list, t0: float, loss_mean: str, seeds: RegionSeeds | None,
                      step: int) -> tuple[float, dict]:
    """Forward and backward of every microbatch, gradients accumulated (each microbatch's
    loss scaled by 1/microbatches; under the global loss each sum by 1, the gradients then
    divided by the batch's count, as a plan's U does); the step's loss and metrics."""
    if named.size % microbatches:
        raise PlanError(f"{microbatches} microbatches do not divide the batch of "
                        f"{named.size}")
    chunk, total, count = named.size // microbatches, 0.0, 0.0
    scale = 1.0 if loss_mean == "global" else 1.0 / microbatches
    metrics: dict[str, list[float]] = {}
    for p in params.values():
        p.grad = None
    for mb in range(microbatches):
        sl = slice(mb * chunk, (mb + 1) * chunk)
        start = time.perf_counter() - t0
        if seeds is not None:
            seeds.microbatch(step, mb)
        parts = compute_loss(model, loss_fn, named.slice(sl), loss_mean)
        loss = parts.loss
        mid = time.perf_counter() - t0
        torch.autograd.backward(loss, torch.full_like(loss, scale))
        total += float(loss.detach().double() * scale)
        if parts.count is not None:
            count += float(parts.count.detach().double())
        for k, v in parts.metrics.items():
            metrics.setdefault(k, []).append(float(v.detach().double()))
        events += [Event(0, "compute", f"F.MB{mb}", "F", start, mid, mb, 0, f"r0:F{mb}"),
                   Event(0, "compute", f"B.MB{mb}", "B", mid, time.perf_counter() - t0, mb,
                         0, f"r0:B{mb}")]
    if loss_mean == "global":
        factor = torch.tensor(1.0, dtype=torch.float64) / count
        for p in params.values():
            if p.grad is not None:
                p.grad.mul_(factor.to(p.grad.dtype))
        total = total / count if count else float("nan")
    return total, {k: sum(v) / len(v) for k, v in metrics.items()}
