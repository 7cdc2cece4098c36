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
from piper_nb.compiler.precision import cast_batch, check_precision
from piper_nb.errors import PlanError
from piper_nb.metrics import StepMetrics, TensorBoardLog, batch_tokens
from piper_nb.optim import OptimizerSpec, check_optimizer
from piper_nb.plan.precision import PRECISIONS
from piper_nb.runtime.bundle import param_aliases
from piper_nb.sim.trace import Event, MemorySample, Trace

__all__ = ["Result", "train", "reference_train"]


@dataclass
class Result:
    """Losses and step times per step, the metrics of every step (`StepMetrics`: gradient
    norm, learning rate, throughput), the measured trace of the last step, the model.

    `trace.meta` holds the step number, the world and, for an expert plan, `"tokens"`: the
    routing that step made (`"value@mb"` -> rows per group member), which
    `MemorySettings(tokens=...)` takes to size the simulated token buffers the same way. On
    GPUs, `"cuda_max_allocated"`: device -> `torch.cuda.max_memory_allocated` over the step
    (compare with a simulation under `MemorySettings.for_cuda(nccl=False)`: NCCL's own
    buffers are outside PyTorch's allocator, and so outside that figure)."""

    losses: list[float]
    step_times: list[float]                 # seconds, step start to the last device's end
    trace: Trace | None
    # canonical parameter name -> tensor, and buffer name -> tensor for trained buffers
    params: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    template: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    aliases: dict[str, str] = field(repr=False, default_factory=dict)
    leftover: list[str] = field(default_factory=list)  # buffers a plan never freed
    skipped: list[int] = field(default_factory=list)   # steps whose batch drop_last skipped
    metrics: list[StepMetrics] = field(default_factory=list)   # one per step trained

    @property
    def grad_norms(self) -> list[float | None]:
        """The global gradient norm of every step (None where the plan does not clip)."""
        return [m.grad_norm for m in self.metrics]

    @property
    def lrs(self) -> list[float | None]:
        """The learning rate every step used (the default parameter group's)."""
        return [m.lr for m in self.metrics]

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
                self.plans[size] = rebatch(self.base, named)   # clipping included
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
          param_groups: list[dict] | None = None, lr_scheduler: Callable | None = None,
          clip_grad_norm: float | None = None, log_dir: str | os.PathLike | None = None,
          progress: Callable[[int, int, StepMetrics], None] | None = None,
          checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
          resume: bool = False, seed: int | None = None, drop_last: bool = False) -> Result:
    """Train `plan` for `steps` steps on local workers (or on `cluster`, left running).

    `optimizer` builds a `torch.optim` optimizer from parameters (`torch.optim.AdamW`,
    `functools.partial(torch.optim.AdamW, lr=3e-4, weight_decay=0.1)`, `pn.optim.AdamW(...)`);
    every device builds it over what it updates (full parameters, or its ZeRO shards).
    `param_groups` overrides settings by parameter-name pattern, first match wins:
    `[{"params": ["*norm*", "*.bias"], "weight_decay": 0.0}]` (a pattern matches a parameter's
    name or a module path above it). `lr_scheduler(optimizer)` builds a
    `torch.optim.lr_scheduler` scheduler, stepped once per step on every device.
    `clip_grad_norm=1.0` clips the global gradient norm (across stages, replicas and shards,
    each parameter once) as `torch.nn.utils.clip_grad_norm_` does: the plan gains a small
    all-reduce before its updates (`compiler.clip`); `math.inf` reports the norm only.

    Each step draws one batch. A batch of another size than the plan's (a loader's last,
    smaller one) trains on the same program compiled once for that size, from the same
    parameters and optimizer state; with `drop_last=True` it is skipped instead (no step is
    taken; `Result.skipped` lists such steps). A warning says which, once per size.

    `seed` seeds the random operations (dropout) of every forward, per region, step,
    microbatch and replica, so the same plan trains the same way twice. By default it is
    drawn from torch's random generator, as a DataLoader draws its base seed: after
    `torch.manual_seed(s)` the run repeats exactly.

    `progress(step, steps, metrics)` is called after every step with its `StepMetrics` (raise
    from it to stop the run); `log_dir` writes the same as TensorBoard event files.
    With `checkpoint_dir`, the full training state (optimizer and scheduler included) is
    written there atomically every `checkpoint_every` steps (default 1) and after the last
    step; `resume=True` continues from the newest checkpoint there (a loader is advanced past
    the batches already used), so the result equals an uninterrupted run's. See
    `piper_nb.cluster.checkpoint`.
    """
    from piper_nb.cluster.checkpoint import Checkpointer
    from piper_nb.cluster.local import LocalCluster
    plan, spec, seed = _prepare(plan, optimizer, param_groups, lr_scheduler, clip_grad_norm,
                                seed)
    ckpt = Checkpointer.for_train(plan, spec, checkpoint_dir, checkpoint_every, resume)
    run = _Run(plan, steps, spec, seed, drop_last, progress, log_dir)
    own = cluster is None
    cluster = LocalCluster(plan.world) if own else cluster
    try:
        cluster.reset(plan, spec, seed)
        start = 0
        if ckpt is not None:
            start, run.losses, run.times = ckpt.restore(cluster)
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
            if run.step(cluster, s, named) and ckpt is not None:
                ckpt.after_step(cluster, s, steps, run.losses, run.times)
        params = cluster.state(plan)
    finally:
        run.close()
        if own:
            cluster.close()
    model = plan.capture.model
    return Result(run.losses, run.times, run.trace, params, _template(model),
                  param_aliases(model), sorted(run.leftover), run.skipped, run.metrics)


def _prepare(plan, optimizer, param_groups, lr_scheduler, clip_grad_norm, seed):
    """Everything `train` checks before a worker starts: (plan with clipping, the
    optimizer's spec, the seed)."""
    from piper_nb.compiler.clip import with_grad_clipping
    if plan.capture is None:
        raise PlanError("this plan has no captured model; compile it with pn.compile to train it")
    _check_materialized(plan.capture.model, "pn.train")
    spec = check_optimizer(optimizer, "pn.train", param_groups=param_groups,
                           lr_scheduler=lr_scheduler)
    _check_shards(plan, spec)
    plan = with_grad_clipping(plan, clip_grad_norm if clip_grad_norm is not None
                              else plan.clip_grad_norm)
    if seed is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
    elif isinstance(seed, bool) or not isinstance(seed, int):
        raise PlanError(f"pn.train: seed must be an integer, got {seed!r}")
    return plan, spec, seed


def _check_shards(plan, spec: OptimizerSpec) -> None:
    """An optimizer that is not element-wise cannot update flat ZeRO shards: say so now."""
    sharded = [b for b in plan.buckets if b.zero >= 1]
    why = spec.requires_whole() if sharded else None
    if why:
        b = sharded[0]
        raise PlanError(f"pn.train: torch.optim.{spec.cls_name} {why}, so it cannot update the "
                        f"flat ZeRO-{b.zero} shards of bucket {b.index} ({len(b.params)} "
                        f"parameters over devices {list(b.group)}); use replicate(..., zero=0) "
                        "for those regions, or an element-wise optimizer (SGD, Adam, AdamW, ...)")


class _Run:
    """The driver's side of a run: one step at a time on the right plan, and what it reports
    (losses, times, metrics, the last trace, progress and TensorBoard)."""

    def __init__(self, plan, steps, spec, seed, drop_last, progress, log_dir):
        self.plan, self.steps, self.spec, self.seed = plan, steps, spec, seed
        self.progress = progress
        self.sizes, self.shipped = _Sizes(plan, drop_last), set()  # other-size plans shipped
        self.losses, self.times, self.metrics = [], [], []
        self.trace, self.leftover, self.skipped = None, set(), []
        self.log = TensorBoardLog(log_dir) if log_dir is not None else None

    def step(self, cluster, s: int, named: dict) -> bool:
        """Train step `s` on `named` (False: skipped by drop_last)."""
        plan, this = self.plan, self.sizes.plan_for(named, s)
        if this is None:
            self.skipped.append(s)
            return False
        batch = ordered(named, plan.batch_names, f"step {s}")
        last = s == self.steps
        if this is plan:
            outs = cluster.step(plan, batch, trace=last)  # memory: on the kept step
        else:
            if this.batch_size not in self.shipped:   # the workers load its state over this
                cluster.reset(this, self.spec, self.seed)
                self.shipped.add(this.batch_size)
            outs = _other_size_step(cluster, plan, this, batch, last)
        self.losses.append(sum(o["loss"] for o in outs))
        self.times.append(max(o["end"] for o in outs))
        for o in outs:
            self.leftover.update(o["leftover"])
        self.trace = _step_trace(outs, s, plan.world)
        t, tokens = self.times[-1], batch_tokens(named)
        m = StepMetrics(s, self.losses[-1], t, batch_size(named) / t, lr=outs[0].get("lr"),
                        grad_norm=outs[0].get("grad_norm"),
                        tokens_per_s=None if tokens is None else tokens / t)
        self.metrics.append(m)
        if self.log is not None:
            self.log.write(m)
        if self.progress is not None:
            self.progress(s, self.steps, m)
        return True

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


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
                    loss_fn: Callable | None = None, drop_last: bool = False, *,
                    param_groups: list[dict] | None = None, lr_scheduler: Callable | None = None,
                    clip_grad_norm: float | None = None, precision: str = "fp32") -> Result:
    """Single-process training of a deep copy of `model`, microbatch by microbatch: the plain
    PyTorch loop (`optimizer`, `param_groups` and `lr_scheduler` as `pn.train` takes them,
    `torch.nn.utils.clip_grad_norm_` with `clip_grad_norm`); with `drop_last`, a batch of
    another size than the first is skipped, as `pn.train` does. `precision="bf16"` trains a
    bf16 copy with fp32 master weights, as a bf16 plan does (`compiler.precision`): the
    gradients go to the masters in fp32, clipping and the optimizer act on those."""
    spec = check_optimizer(optimizer, "reference_train", param_groups=param_groups,
                           lr_scheduler=lr_scheduler)
    check_precision(precision, None)
    _check_materialized(model, "reference_train")
    model = copy.deepcopy(model).to(PRECISIONS[precision])   # in the modes the user set
    loss_fn = resolve_loss(model, loss_fn, "reference_train")
    params = dict(model.named_parameters())
    masters = {n: p.detach().float().clone() if precision != "fp32" else p
               for n, p in params.items() if p.requires_grad}
    groups = [[] for _ in range(len(spec.groups) + 1)]
    for n, m in masters.items():
        groups[spec.group_of(n)].append(m)
    opt, sched = spec.build(groups)
    it = iter(_batches(batch, steps))
    losses, times, metrics, events, memory = [], [], [], [], []
    first, skipped = None, []
    for s in range(1, steps + 1):
        named = named_batch(next(it), f"reference_train step {s}")
        first = batch_size(named) if first is None else first
        if drop_last and batch_size(named) != first:
            skipped.append(s)
            continue
        events, t0 = [], time.perf_counter()
        named = cast_batch(named, precision)
        total = _reference_passes(model, loss_fn, named, microbatches, params, events, t0)
        start = time.perf_counter() - t0
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
        end = time.perf_counter() - t0
        events.append(Event(0, "compute", "U", "U", start, end, -1, 0, "r0:U"))
        pbytes = sum(p.numel() * p.element_size() for p in params.values())
        obytes = sum(t.numel() * t.element_size() for st in opt.state.values()
                     for t in st.values() if isinstance(t, torch.Tensor))
        memory = [MemorySample(0, end, pbytes, 0, obytes)]
        losses.append(total)
        times.append(end)
        tokens = batch_tokens(named)
        metrics.append(StepMetrics(s, total, end, batch_size(named) / end, lr=lr,
                                   grad_norm=norm,
                                   tokens_per_s=None if tokens is None else tokens / end))
    trace = Trace(tuple(events), tuple(memory), source="measured", meta={"reference": True})
    canonical = {n: p.detach().clone() for n, p in params.items()}
    return Result(losses, times, trace, canonical, _template(model), param_aliases(model),
                  skipped=skipped, metrics=metrics)


def _reference_passes(model, loss_fn, named: dict, microbatches: int, params: dict,
                      events: list, t0: float) -> float:
    """Forward and backward of every microbatch, gradients accumulated (each microbatch's
    loss scaled by 1/microbatches); the step's loss."""
    if batch_size(named) % microbatches:
        raise PlanError(f"{microbatches} microbatches do not divide the batch of "
                        f"{batch_size(named)}")
    chunk, scale, total = batch_size(named) // microbatches, 1.0 / microbatches, 0.0
    for p in params.values():
        p.grad = None
    for mb in range(microbatches):
        sl = slice(mb * chunk, (mb + 1) * chunk)
        start = time.perf_counter() - t0
        loss = compute_loss(model, loss_fn, slice_batch(named, sl))
        mid = time.perf_counter() - t0
        torch.autograd.backward(loss, torch.full_like(loss, scale))
        total += float(loss.detach().double() * scale)
        events += [Event(0, "compute", f"F.MB{mb}", "F", start, mid, mb, 0, f"r0:F{mb}"),
                   Event(0, "compute", f"B.MB{mb}", "B", mid, time.perf_counter() - t0, mb,
                         0, f"r0:B{mb}")]
    return total
