"""`pn.compile`: annotated model + directive program + batch -> checked Plan.

The steps: name the batch, expand schedule builders into directives, capture the model
into regions, then the three declared phases of `compiler.passes` with the shapes between
the first two: capture passes (tensor parallelism's parts), shapes (`compiler.shapes`),
DAG passes (the directives in Piper's fixed order, whatever their order in the program),
plan passes (lowering to one instruction list per device, widening, the global loss,
clipping, the static checks). Every step is a pure function; errors name the directive
index. What a directive kind means is read only by the passes and helpers of its module.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from piper_nb.capture.annotate import Spec, annotate
from piper_nb.capture.batch import Batch
from piper_nb.capture.loss import check_loss_mean
from piper_nb.capture.untouched import untouched
from piper_nb.compiler.passes import CAPTURE, DAG, PLAN, check_consumed, run_phase
from piper_nb.compiler.plan_passes import PlanContext
from piper_nb.compiler.precision import cast_batch, cast_spec, check_precision
from piper_nb.compiler.shapes import propagate
from piper_nb.compiler.token_rows import token_rows
from piper_nb.cp import context_degree, share_batch
from piper_nb.directives.base import CaptureContext, Context
from piper_nb.directives.compile_regions import compiled_regions
from piper_nb.directives.replicate import check_widths, replica_width
from piper_nb.directives.shard import routes_tokens
from piper_nb.directives.spec import Directive, Program
from piper_nb.directives.split import microbatches
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.plan.plan import Plan
from piper_nb.schedules import expand
from piper_nb.tp import tp_groups

__all__ = ["compile", "expand", "build_global_dag", "rebatch"]


def build_global_dag(capture, directives: list[tuple[int, Directive]], values: dict,
                     frozen: frozenset[str] = frozenset()) -> TrainingDAG:
    """The placed, ordered DAG: the DAG phase of `compiler.passes` run over the program's
    directives (each directive checked to be consumed by a DAG pass)."""
    directives, consumed = tuple(directives), set()
    dag = run_phase(DAG, None, directives, Context(capture, values, frozen), consumed)
    check_consumed(directives, consumed, (DAG,))
    return dag


def compile(spec: Spec | torch.nn.Module, program: Program | Iterable, batch, *,
            loss_fn: Callable | None = None, world: int | None = None, check: bool = True,
            capture: str = "auto", clip_grad_norm: float | None = None, precision: str = "fp32",
            reduce_dtype: str | None = None, loss_mean: str = "microbatch") -> Plan:
    """Compile `program` for `spec` on `batch` into a checked Plan (raises PlanError).
    `spec` is `pn.annotate(model, {...})`, or a model alone: one region (`pn.annotate`).

    `capture` picks the front end that cuts the model into regions: "fx" (symbolic
    tracing), "export" (`torch.export`, non-strict, on `batch`: any model whose forward
    runs, Hugging Face models among them) or "auto" (fx, else export).
    `clip_grad_norm` adds global gradient-norm clipping to the plan (`compiler.clip`: an
    all-reduce before the updates), so simulations see it; `pn.train` can also add it.
    `precision="bf16"` compiles for bf16 weights, activations and gradients with fp32 master
    weights and optimizer state; gradients are reduced in `reduce_dtype` ("fp32" by
    default, or "bf16"). See `compiler.precision`.
    `loss_mean` is what the step minimises: "microbatch" (the default), the mean of the
    microbatches' mean losses (of each replica's share under data parallelism: see
    `Plan.reference_microbatches`), as `torch.distributed.pipelining` computes it; or
    "global", the loss over the whole batch, equal for every plan: a Hugging Face model's
    token mean over all its labels, or a `loss_fn` returning (sum, count). See
    `capture.loss` and `compiler.global_loss`."""
    mixed = check_precision(precision, reduce_dtype)
    check_loss_mean(loss_mean)
    with _gc_paused():
        return _compile(spec, program, batch, loss_fn, world, check, capture, mixed, loss_mean,
                        clip_grad_norm)


@contextlib.contextmanager
def _gc_paused():
    """Large plans allocate millions of small immutable values and none form cycles: the
    garbage collector's passes over them are pure cost while compiling."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _compile(spec, program, batch, loss_fn, world, check, method, mixed, loss_mean,
             clip) -> Plan:
    if isinstance(spec, torch.nn.Module):   # no tags: the whole model is one region
        spec = annotate(spec)
    if not isinstance(spec, Spec):
        raise PlanError("compile takes a model, or the Spec returned by "
                        f"pn.annotate(model, {{...}}); got a {type(spec).__name__}")
    user = Batch.of(batch, "pn.compile")   # the front door: named here, once
    named = cast_batch(user, mixed[0])
    spec = cast_spec(spec, mixed[0])
    directives = expand(program)
    capture = spec.capture(loss_fn, named, method, loss_mean)
    return _plan(capture, directives, named, _Options(world, check, mixed, clip,
                                                      user.samples, spec))


def rebatch(plan: Plan, batch) -> Plan:
    """`plan`'s program compiled for another batch: of another size (a loader's last, smaller
    batch) or other samples (a sequence length the collator padded to); the same
    directives and world, so the same devices, buckets and parameter layouts. An export
    capture, specialised to its example's sample shapes, is made again for new ones (fx
    graphs hold for any). PlanError when the microbatches or replicas do not divide it.
    `batch` is a `Batch` (`pn.train` draws them) or as `pn.compile` takes it; a dict's
    entries may come in any order."""
    if plan.capture is None:
        raise PlanError("this plan carries no captured model; compile it with pn.compile")
    user = Batch.of(batch, "rebatch").in_order(plan.batch_names, "rebatch")
    named = cast_batch(user, plan.precision)
    capture = plan.capture
    if capture.method == "export" and user.samples != plan.samples:
        if plan.spec is None:
            raise PlanError("this plan was exported for other sample shapes and carries no "
                            "Spec to export again; compile it for this batch with pn.compile")
        capture = plan.spec.capture(capture.loss_fn, named, "export", capture.loss_mean)
    with _gc_paused():
        return _plan(capture, plan.program, named, _Options(
            plan.world, True, (plan.precision, plan.reduce_dtype), plan.clip_grad_norm,
            user.samples, plan.spec))


@dataclass(frozen=True)
class _Options:
    """What `pn.compile` was asked for besides the model, program and batch."""

    world: int | None
    check: bool
    precision: tuple[str, str | None]
    clip_grad_norm: float | None
    samples: tuple
    spec: Spec | None


def _plan(capture, directives, named: Batch, opts: _Options) -> Plan:
    """The three phases for the captured model on the named batch: capture passes, shapes,
    DAG passes, plan passes; then every directive checked to be consumed by some pass."""
    directives, consumed = tuple(directives), set()
    capture = run_phase(CAPTURE, capture, directives, CaptureContext(named, opts.check),
                        consumed)
    bsz = named.size
    micro = microbatches(directives, bsz)
    dag, shapes = _placed(capture, directives, named, bsz, micro, consumed)
    ctx = PlanContext(capture, dag, shapes, bsz, micro,
                      _world(dag, directives, opts.world, tp_groups(directives)), directives,
                      opts.check, opts.precision, opts.clip_grad_norm, opts.samples, opts.spec)
    plan = run_phase(PLAN, None, directives, ctx, consumed)
    check_consumed(directives, consumed)
    return plan


def _placed(capture, directives, named: Batch, bsz: int, micro: int,
            consumed: set[int]) -> tuple[TrainingDAG, dict]:
    """The DAG phase on shapes per replica's share of a microbatch: the replicate
    directives give the width, and when the placed DAG's differs (their regions are placed
    on smaller groups, a stage's two copies) the shapes and the DAG are made again for it."""
    frozen = frozenset(n for n, p in capture.named_parameters() if not p.requires_grad)
    per = context_degree(directives)   # devices sharing one sample's sequence
    width = replica_width(directives, bsz // micro, per)
    shapes = _shapes(capture, directives, named, bsz // micro // width)
    dag = run_phase(DAG, None, directives, _context(capture, shapes, frozen), consumed)
    actual = check_widths(dag, directives, bsz, micro, per)
    if actual != width:
        shapes = _shapes(capture, directives, named, bsz // micro // actual)
        dag = run_phase(DAG, None, directives, _context(capture, shapes, frozen), consumed)
    return dag, shapes


def _context(capture, shapes: dict, frozen: frozenset[str]) -> Context:
    return Context(capture, shapes["values"], frozen, shapes["changed"], shapes["kept"])


def _shapes(capture, directives, named: Batch, part: int) -> dict:
    """Run the regions once on `part` samples: value shapes, saved bytes, the buffers each
    forward changes and (for expert plans) the routed rows as symbols."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: worker threads only get in each other's way
    try:
        with untouched(capture.model):   # the user's buffers and random state stay as they are
            mine = named.slice(slice(part))
            if capture.cp is not None:   # a device's share of the sequence
                mine = Batch(share_batch(mine, capture.cp))
            values, saved, _, changed, kept, aliases = propagate(
                capture, mine, compiled_regions(capture.regions, directives))
            rows, saved_rows = {}, {}
            if routes_tokens(directives):  # routed rows: symbolic
                rows, saved_rows = token_rows(capture, mine, saved, values)
    finally:
        torch.set_num_threads(threads)
    params = list(capture.model.parameters())
    if not any(p.requires_grad for p in params):
        raise PlanError(f"nothing to train: all {len(params)} parameters are frozen "
                        "(requires_grad=False); unfreeze some before compiling")
    return {"values": values, "saved": saved, "kept": kept, "aliases": aliases,
            "changed": changed, "rows": rows, "saved_rows": saved_rows}


def _flat(devices) -> list[int]:
    return [d for x in devices for d in (x if isinstance(x, tuple) else (x,))]


def _world(dag: TrainingDAG, directives, world: int | None, groups: dict | None = None) -> int:
    used = sorted(set(dag.devices()) | {m for g in (groups or {}).values() for m in g})
    n_world = world if world is not None else (max(used) + 1 if used else 1)
    outside = [d for d in used if d >= n_world]
    if outside:
        idx, culprit = next((i, d) for i, d in directives
                            if set(_flat(getattr(d, "devices", ()))) & set(outside))
        raise PlanError(f"device {outside[0]} is outside the world of {n_world} devices "
                        f"(ids 0..{n_world - 1}); use smaller ids or a larger world",
                        directive=idx, op=culprit.op)
    held = set(used)
    idle = [d for d in range(n_world) if d not in held]
    if idle:
        raise PlanError(f"devices {idle} get no work in a world of {n_world}; place something on "
                        "them or renumber the devices from 0")
    return n_world
