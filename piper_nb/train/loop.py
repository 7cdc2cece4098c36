"""`pn.train`: a compiled plan trained on workers, step by step, with what each step
reports (losses, metrics, the trace), checkpoints and the optimizer state at the end."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from piper_nb.capture.batch import Batch
from piper_nb.capture.float8 import check_training as check_float8
from piper_nb.cluster.checkpoint import Checkpointer
from piper_nb.cluster.local import LocalCluster
from piper_nb.compiler.clip import with_grad_clipping
from piper_nb.cp.labels import check_shares
from piper_nb.errors import PlanError, RuntimeFailure
from piper_nb.metrics import StepMetrics, TensorBoardLog, batch_tokens
from piper_nb.optim import OptimizerSpec, check_optimizer
from piper_nb.runtime.bundle import param_aliases
from piper_nb.runtime.layout import assemble_optim_state
from piper_nb.sim.trace import Trace
from piper_nb.train.batches import BatchPlans, batch_stream, other_plan_step
from piper_nb.train.result import Result, check_materialized, model_template

__all__ = ["train", "step_loss", "step_metrics"]


def train(plan, batch_or_loader, steps: int, optimizer, cluster=None, *,
          param_groups: list[dict] | None = None, lr_scheduler: Callable | None = None,
          clip_grad_norm: float | None = None, log_dir: str | os.PathLike | None = None,
          progress: Callable[[int, int, StepMetrics], None] | None = None,
          checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
          resume: bool | str = False, seed: int | None = None, drop_last: bool = False,
          max_restarts: int = 0, checkpoint_format: str = "dcp") -> Result:
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
    smaller one), or with other per-sample shapes (a collator padding each batch to its
    longest sequence), trains on the same program compiled once for it, from the same
    parameters and optimizer state; with `drop_last=True` a batch of another size is skipped
    instead (no step is taken; `Result.skipped` lists such steps). A warning says which,
    once per kind of batch. Padding to a multiple (`pad_to_multiple_of`) bounds how many
    programs a run compiles.

    `seed` seeds the random operations (dropout) of every forward, per region, step,
    microbatch and replica, so the same plan trains the same way twice. By default it is
    drawn from torch's random generator, as a DataLoader draws its base seed: after
    `torch.manual_seed(s)` the run repeats exactly.

    `progress(step, steps, metrics)` is called after every step with its `StepMetrics` (raise
    from it to stop the run); `log_dir` writes the same as TensorBoard event files.
    With `checkpoint_dir`, the full training state (optimizer and scheduler included) is
    written there atomically every `checkpoint_every` steps (default 1) and after the last
    step; `resume=True` continues from the newest checkpoint there (a loader is advanced past
    the batches already used), so the result equals an uninterrupted run's; `steps` counts
    from the run's start. A resume after the model, plan, optimizer or scheduler changed is
    refused, naming the change; `resume="weights_only"` loads only the weights (the optimizer
    and scheduler start fresh, the step and data position go on): `cluster.checkpoint`.
    Checkpoints are PyTorch's distributed checkpoints (`checkpoint_format="dcp"`, a
    directory per step that `torch.distributed.checkpoint.load` reads into a plain model and
    optimizer, torchtitan, or another plan, which resumes from it: `cluster.dcp`), or
    piper_nb's own single file (`"piper_nb"`, which this plan alone resumes from).

    `max_restarts=N` (with `checkpoint_dir`) survives a lost worker: when a worker dies,
    stops answering or raises, the cluster's workers are started again, the newest
    checkpoint is loaded and the run goes on, at most N times; then the first failure is
    raised. The result equals an uninterrupted run's (the steps after the newest
    checkpoint are trained again). A loader must be iterable again from its start (a
    DataLoader, a list), as a resume needs.
    """
    plan, spec, seed = _prepare(plan, optimizer, param_groups, lr_scheduler, clip_grad_norm,
                                seed)
    check_float8(plan.capture.modules, plan.tp_groups, getattr(cluster, "device", None))
    ckpt = Checkpointer.for_train(plan, spec, checkpoint_dir, checkpoint_every, resume,
                                  checkpoint_format)
    _check_restarts(max_restarts, ckpt)
    run = _Run(plan, steps, spec, seed, drop_last, progress, log_dir)
    own = cluster is None
    cluster = LocalCluster(plan.world) if own else cluster
    try:
        params, optim_state = _attempts(run, cluster, ckpt, batch_or_loader, max_restarts)
    finally:
        run.close()
        if own:
            cluster.close()
    model = plan.capture.model
    return Result(run.losses, run.times, run.trace, params, model_template(model),
                  param_aliases(model), sorted(run.leftover), run.skipped, run.metrics,
                  optim_state, run.compile_s)


def _attempts(run, cluster, ckpt, batch_or_loader, max_restarts: int) -> tuple[dict, dict]:
    """`_attempt`, again from the newest checkpoint after a worker raised, died or stopped
    answering, at most `max_restarts` times; then the first failure, with a note."""
    failures: list[RuntimeFailure] = []
    while True:
        try:
            return _attempt(run, cluster, ckpt, batch_or_loader)
        except RuntimeFailure as err:
            failures.append(err)
            if len(failures) <= max_restarts:
                _restarting(ckpt, run, err, len(failures), max_restarts)
                continue
            if max_restarts:
                failures[0].add_note(f"pn.train restarted {max_restarts} times, and each "
                                     f"attempt failed; the last: {str(err).splitlines()[0]}")
            raise failures[0] from failures[0].__cause__


def _attempt(run, cluster, ckpt, batch_or_loader) -> tuple[dict, dict]:
    """Train from the start, or from the newest checkpoint when resuming, to the last
    step: the final parameters and optimizer state."""
    plan, spec, steps = run.plan, run.spec, run.steps
    cluster.reset(plan, spec, run.seed)
    start = 0
    if ckpt is not None:
        start, run.losses, run.times, run.metrics = ckpt.restore(cluster, steps)
    run.skipped = [s for s in run.skipped if s <= start]   # a restart trains on from `start`
    batches = batch_stream(batch_or_loader, "step", skip=start)   # each named once
    for s in range(start + 1, steps + 1):
        try:
            batch = next(batches)
        except StopIteration:
            raise PlanError(f"the loader ran out after {s - 1} of {steps} steps") from None
        try:
            stepped = run.step(cluster, s, batch)
        except RuntimeFailure as err:   # a worker failed or was lost: say in which step
            raise err.at_step(s) from err
        if stepped and ckpt is not None:
            ckpt.after_step(cluster, s, steps, run.losses, run.times, run.metrics)
    params = cluster.state(plan)
    fetch = getattr(cluster, "train_state", None)   # a cluster of one's own may lack it
    optim_state = {} if fetch is None else _optimizer_state(plan, spec,
                                                             fetch(plan)[:plan.world])
    return params, optim_state


def _check_restarts(max_restarts, ckpt) -> None:
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise PlanError(f"pn.train: max_restarts must be a non-negative int, got "
                        f"{max_restarts!r}")
    if max_restarts and ckpt is None:
        raise PlanError("pn.train: max_restarts reloads the newest checkpoint after a lost "
                        "worker; give checkpoint_dir= (and checkpoint_every=, how many steps "
                        "a restart may train again)")


def _restarting(ckpt, run, err: RuntimeFailure, n: int, most: int) -> None:
    """Resume from the newest checkpoint on fresh workers (a cluster that lost or stopped a
    worker stops its whole group; its next command starts a new one)."""
    import warnings
    first = str(err).splitlines()[0]
    warnings.warn(f"pn.train: restart {n} of {most} after: {first}; reloading the newest "
                  f"checkpoint in {ckpt.dir}", stacklevel=4)
    ckpt.resume = True
    run.restarted()


def _optimizer_state(plan, spec: OptimizerSpec, states: list[dict]) -> dict:
    """`Result.optimizer_state`: the workers' optimizer state made whole, and the groups."""
    state = assemble_optim_state(plan, states, spec.group_of)
    groups = next((st["update"]["groups"] for st in states if "update" in st), [])
    names = [n for n in plan.params if n not in plan.frozen]
    return {"state": state, "param_groups": [
        {**g, "params": [n for n in names if spec.group_of(n) == i]}
        for i, g in enumerate(groups)]}


def _prepare(plan, optimizer, param_groups, lr_scheduler, clip_grad_norm, seed):
    """Everything `train` checks before a worker starts: (plan with clipping, the
    optimizer's spec, the seed)."""
    if plan.capture is None:
        raise PlanError("this plan has no captured model; compile it with pn.compile to train it")
    check_materialized(plan.capture.model, "pn.train")
    spec = check_optimizer(optimizer, "pn.train", param_groups=param_groups,
                           lr_scheduler=lr_scheduler)
    _check_shards(plan, spec)
    spec.check_patterns((n for n, _ in plan.capture.model.named_parameters(
        remove_duplicate=False)), "pn.train")
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
        self.sizes, self.shipped = BatchPlans(plan, drop_last), set()  # other-size plans shipped
        self.losses, self.times, self.metrics, self.compile_s = [], [], [], []
        self.trace, self.leftover, self.skipped = None, set(), []
        self.log = TensorBoardLog(log_dir) if log_dir is not None else None

    def step(self, cluster, s: int, batch: Batch) -> bool:
        """Train step `s` on `batch` (False: skipped by drop_last)."""
        plan, this = self.plan, self.sizes.plan_for(batch, s)
        if this is None:
            self.skipped.append(s)
            return False
        check_shares(this, batch, s)   # context parallelism's microbatch mean: exact?
        sent = batch.in_order(plan.batch_names, f"step {s}")   # as the workers take it
        last = s == self.steps
        if this is plan:
            outs = cluster.step(plan, sent, trace=last)  # memory: on the kept step
        else:
            if id(this) not in self.shipped:   # the workers load its state over this
                cluster.reset(this, self.spec, self.seed)
                self.shipped.add(id(this))
            outs = other_plan_step(cluster, plan, this, sent, last)
        self.losses.append(step_loss(plan, outs))
        self.times.append(max(o["end"] for o in outs))
        self.compile_s.append(max(o.get("compile_s", 0.0) for o in outs))
        for o in outs:
            self.leftover.update(o["leftover"])
        self.trace = _step_trace(outs, s, plan.world)
        t, tokens = self.times[-1], batch_tokens(batch)
        m = StepMetrics(s, self.losses[-1], t, batch.size / t, lr=outs[0].get("lr"),
                        grad_norm=outs[0].get("grad_norm"),
                        tokens_per_s=None if tokens is None else tokens / t,
                        metrics=step_metrics(outs))
        self.metrics.append(m)
        if self.log is not None:
            self.log.write(m)
        if self.progress is not None:
            self.progress(s, self.steps, m)
        return True

    def restarted(self) -> None:
        """The workers are new: every other-size plan is shipped again."""
        self.shipped = set()

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


def step_loss(plan, outs: list[dict]) -> float:
    """The step's loss from the workers' reports: the sum of their shares (each already
    scaled by the plan's loss scale), divided by the batch's count under the global loss."""
    total = sum(o["loss"] for o in outs)
    if plan.loss_mean != "global":
        return total
    return total / outs[0]["count"] if outs[0]["count"] else float("nan")


def step_metrics(outs: list[dict]) -> dict[str, float]:
    """Each metric the loss returned, averaged over every microbatch and replica."""
    sums: dict[str, list[float]] = {}
    for o in outs:
        for k, (total, n) in o.get("metrics", {}).items():
            acc = sums.setdefault(k, [0.0, 0])
            acc[0] += total
            acc[1] += n
    return {k: total / n for k, (total, n) in sums.items() if n}


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


