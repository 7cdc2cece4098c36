"""`pn.train` runs a compiled plan on workers; `pn.reference_train` is the plain baseline.

Both split every batch into the same microbatches and scale each microbatch's loss by
1/microbatches (the plan's `loss_scale` also divides by the data-parallel width), so a
correct plan reproduces the reference's losses and parameters to fp32 rounding: the check
nanoGPT-style codebases use for every parallel strategy. Both return a `Result`.
"""

from __future__ import annotations

import copy
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from piper_nb.capture.batch import batch_size, named_batch, ordered, slice_batch
from piper_nb.capture.loss import compute_loss, resolve_loss
from piper_nb.errors import PlanError
from piper_nb.optim import check_optimizer
from piper_nb.runtime.bundle import param_aliases
from piper_nb.sim.trace import Event, MemorySample, Trace

__all__ = ["Result", "train", "reference_train"]


@dataclass
class Result:
    """Losses and step times per step, the measured trace of the last step, the model.

    `trace.meta` holds the step number, the world and, for an expert plan, `"tokens"`: the
    routing that step made (`"value@mb"` -> rows per group member), which
    `MemorySettings(tokens=...)` takes to size the simulated token buffers the same way. On
    GPUs, `"cuda_max_allocated"`: device -> `torch.cuda.max_memory_allocated` over the step
    (compare with a simulation under `MemorySettings.for_cuda()`)."""

    losses: list[float]
    step_times: list[float]                 # seconds, step start to the last device's end
    trace: Trace | None
    # canonical parameter name -> tensor, and buffer name -> tensor for trained buffers
    params: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    template: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    aliases: dict[str, str] = field(repr=False, default_factory=dict)
    leftover: list[str] = field(default_factory=list)  # buffers a plan never freed
    skipped: list[int] = field(default_factory=list)   # steps whose batch drop_last skipped

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full trained model, keyed like `model.state_dict()` (tied names included),
        buffers as trained (BatchNorm's running statistics)."""
        out = {}
        for name, value in self.template.items():
            key = self.aliases.get(name, name)
            out[name] = self.params[key].clone() if key in self.params else value.clone()
        return out


def _batches(batch_or_loader, steps: int) -> Iterable:
    """One batch ((inputs, targets) or a dict of tensors) repeated, or the loader itself."""
    one = (isinstance(batch_or_loader, Mapping) and all(
        isinstance(t, torch.Tensor) for t in batch_or_loader.values())) or (
        isinstance(batch_or_loader, (tuple, list)) and len(batch_or_loader) == 2 and all(
            isinstance(t, torch.Tensor) for t in batch_or_loader))
    return [batch_or_loader] * steps if one else batch_or_loader


class _Sizes:
    """The plan for each batch size a loader yields: the compiled one, and for another size
    (a last, smaller batch) the same program compiled once for it (`compiler.rebatch`), or,
    with `drop_last`, none: the batch is skipped. Either way the user is told, once."""

    def __init__(self, plan, drop_last: bool):
        self.plans = {plan.batch_size: plan}
        self.base, self.drop_last, self.told = plan, drop_last, set()

    def plan_for(self, named: dict, step: int):
        size = batch_size(named)
        if size not in self.plans and not self.drop_last:
            from piper_nb.compiler.compile import rebatch
            try:
                self.plans[size] = rebatch(self.base, named)
            except PlanError as err:
                raise PlanError(f"step {step}: a batch of {size} samples (the plan was compiled "
                                f"for {self.base.batch_size}) cannot be trained: {err.reason}; "
                                "pass drop_last=True to skip such batches") from None
        if size not in self.told and size != self.base.batch_size:
            self.told.add(size)
            warnings.warn(f"pn.train step {step}: a batch of {size} samples (the plan is for "
                          f"{self.base.batch_size}) " + (
                              "is skipped (drop_last=True)" if self.drop_last else
                              "trains on the same program compiled once for this size"),
                          stacklevel=3)
        return self.plans.get(size)


def _other_size_step(cluster, base, plan, batch, trace: bool) -> list[dict]:
    """One step on `plan` (compiled for another batch size) continuing `base`'s state: its
    workers take the parameters, optimizer state and step count, run, and hand them back."""
    cluster.load_train_state(plan, cluster.train_state(base))
    outs = cluster.step(plan, batch, trace=trace)
    cluster.load_train_state(base, cluster.train_state(plan))
    return outs


def _check_materialized(model: nn.Module, where: str) -> None:
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise PlanError(f"{where}: the model is on the meta device (parameter {meta} has no "
                        "data): plan and simulate it as it is, but to train, build it on a real "
                        "device (or load weights into it: model.to_empty(device='cpu') then "
                        "load_state_dict) and compile again")


def train(plan, batch_or_loader, steps: int, optimizer, cluster=None, *,
          progress: Callable[[int, int, float], None] | None = None,
          checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
          resume: bool = False, seed: int | None = None, drop_last: bool = False) -> Result:
    """Train `plan` for `steps` steps on local workers (or on `cluster`, left running).

    Each step draws one batch. A batch of another size than the plan's (a loader's last,
    smaller one) trains on the same program compiled once for that size, from the same
    parameters and optimizer state; with `drop_last=True` it is skipped instead (no step is
    taken; `Result.skipped` lists such steps). A warning says which, once per size.

    `seed` seeds the random operations (dropout) of every forward, per region, step,
    microbatch and replica, so the same plan trains the same way twice. By default it is
    drawn from torch's random generator, as a DataLoader draws its base seed: after
    `torch.manual_seed(s)` the run repeats exactly.

    `progress(step, steps, loss)` is called after every step (raise from it to stop the run).
    With `checkpoint_dir`, the full training state is written there atomically every
    `checkpoint_every` steps (default 1) and after the last step; `resume=True` continues from
    the newest checkpoint there (a loader is advanced past the batches already used), so the
    result equals an uninterrupted run's. See `piper_nb.cluster.checkpoint`.
    """
    from piper_nb.cluster.checkpoint import Checkpointer
    from piper_nb.cluster.local import LocalCluster
    if plan.capture is None:
        raise PlanError("this plan has no captured model; compile it with pn.compile to train it")
    _check_materialized(plan.capture.model, "pn.train")
    check_optimizer(optimizer, "pn.train")
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise PlanError(f"pn.train: seed must be an integer, got {seed!r}")
    ckpt = Checkpointer.for_train(plan, optimizer, checkpoint_dir, checkpoint_every, resume)
    own = cluster is None
    cluster = LocalCluster(plan.world) if own else cluster
    losses, times, trace, leftover, skipped = [], [], None, set(), []
    sizes, shipped = _Sizes(plan, drop_last), set()   # other-size plans the cluster has
    try:
        cluster.reset(plan, optimizer, seed)
        start = 0
        if ckpt is not None:
            start, losses, times = ckpt.restore(cluster)
        it = iter(_batches(batch_or_loader, steps))
        for s in range(1, start + 1):  # the data position: skip the batches already trained on
            if next(it, None) is None:
                raise PlanError(f"the loader ran out after {s - 1} batches while skipping the "
                                f"{start} a checkpoint already trained on")
        for s in range(start + 1, steps + 1):
            try:
                named = named_batch(next(it), f"step {s}")
            except StopIteration:
                raise PlanError(f"the loader ran out after {s - 1} of {steps} steps") from None
            this = sizes.plan_for(named, s)
            if this is None:
                skipped.append(s)
                continue
            batch = ordered(named, plan.batch_names, f"step {s}")
            if this is plan:
                outs = cluster.step(plan, batch, trace=s == steps)  # memory: on the kept step
            else:
                if this.batch_size not in shipped:   # the workers load its state over this
                    cluster.reset(this, optimizer, seed)
                    shipped.add(this.batch_size)
                outs = _other_size_step(cluster, plan, this, batch, s == steps)
            losses.append(sum(o["loss"] for o in outs))
            times.append(max(o["end"] for o in outs))
            for o in outs:
                leftover.update(o["leftover"])
            trace = _step_trace(outs, s, plan.world)
            if ckpt is not None:
                ckpt.after_step(cluster, s, steps, losses, times)
            if progress is not None:
                progress(s, steps, losses[-1])
        params = cluster.state(plan)
    finally:
        if own:
            cluster.close()
    model = plan.capture.model
    return Result(losses, times, trace, params, _template(model), param_aliases(model),
                  sorted(leftover), skipped)


def _step_trace(outs: list[dict], step: int, world: int) -> Trace:
    """The measured trace of one step from the workers' reports."""
    meta = {"step": step, "world": world}
    tokens = {k: v for o in outs for k, v in o.get("tokens", {}).items()}
    if tokens:  # the routing this step made (expert parallelism): what sized its buffers
        meta["tokens"] = tokens
    cuda = {r: o["cuda_max_allocated"] for r, o in enumerate(outs) if "cuda_max_allocated" in o}
    if cuda:  # GPU: torch.cuda.max_memory_allocated per device, beside the model's
        meta["cuda_max_allocated"] = cuda
    return Trace(tuple(e for o in outs for e in o["events"]),
                 tuple(m for o in outs for m in o["memory"]), source="measured", meta=meta)


def _template(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_train(model: nn.Module, batch, steps: int, microbatches: int, optimizer,
                    loss_fn: Callable | None = None, drop_last: bool = False) -> Result:
    """Single-process training of a deep copy of `model`, microbatch by microbatch; with
    `drop_last`, a batch of another size than the first is skipped, as `pn.train` does."""
    check_optimizer(optimizer, "reference_train")
    _check_materialized(model, "reference_train")
    model = copy.deepcopy(model).train()
    loss_fn = resolve_loss(model, loss_fn, "reference_train")
    params = dict(model.named_parameters())
    state: dict[str, dict] = {n: {} for n in params}
    it = iter(_batches(batch, steps))
    losses, times, events, memory = [], [], [], []
    scale = 1.0 / microbatches
    first, skipped = None, []
    for s in range(1, steps + 1):
        named = named_batch(next(it), f"reference_train step {s}")
        first = batch_size(named) if first is None else first
        if drop_last and batch_size(named) != first:
            skipped.append(s)
            continue
        if batch_size(named) % microbatches:
            raise PlanError(f"{microbatches} microbatches do not divide the batch of "
                            f"{batch_size(named)}")
        chunk = batch_size(named) // microbatches
        events, t0, total = [], time.perf_counter(), 0.0
        for p in params.values():
            p.grad = None
        for mb in range(microbatches):
            sl = slice(mb * chunk, (mb + 1) * chunk)
            start = time.perf_counter() - t0
            loss = compute_loss(model, loss_fn, slice_batch(named, sl))
            mid = time.perf_counter() - t0
            torch.autograd.backward(loss, torch.full_like(loss, scale))
            total += float(loss.detach().double() * scale)
            events += [Event(0, "compute", f"F.MB{mb}", "F", start, mid, mb, 0, f"0F{mb}"),
                       Event(0, "compute", f"B.MB{mb}", "B", mid, time.perf_counter() - t0, mb,
                             0, f"0B{mb}")]
        start = time.perf_counter() - t0
        for n, p in params.items():
            if p.grad is not None:
                optimizer.step(p.data, p.grad, state[n], len(losses) + 1)   # steps taken
        end = time.perf_counter() - t0
        events.append(Event(0, "compute", "U", "U", start, end, -1, 0, "0U"))
        pbytes = sum(p.numel() * p.element_size() for p in params.values())
        obytes = sum(optimizer.state_bytes(st) for st in state.values())
        memory = [MemorySample(0, end, pbytes, 0, obytes)]
        losses.append(total)
        times.append(end)
    trace = Trace(tuple(events), tuple(memory), source="measured", meta={"reference": True})
    canonical = {n: p.detach().clone() for n, p in params.items()}
    return Result(losses, times, trace, canonical, _template(model), param_aliases(model),
                  skipped=skipped)
