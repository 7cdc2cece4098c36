"""`pn.compile`: annotated model + directive program + batch -> checked Plan.

The steps: expand schedule builders into directives, capture the model into regions,
propagate shapes, run the declared pass pipeline (`compiler.passes`: the directives in
Piper's fixed order, whatever their order in the program), lower the DAG to one
instruction list per device (`compiler.lower`) and check the plan (`compiler.checks`).
Every step is a pure function; errors name the directive index.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable

import torch

from piper_nb.capture.annotate import Spec, annotate
from piper_nb.capture.batch import batch_size, named_batch, samples, slice_batch
from piper_nb.capture.loss import check_loss_mean
from piper_nb.capture.tensor_parallel import TPRequest, shard_capture
from piper_nb.capture.tp_match import check_patterns
from piper_nb.capture.tp_plan import model_tp_plan
from piper_nb.capture.untouched import untouched
from piper_nb.compiler.buffers import check_buffer_order, check_buffers
from piper_nb.compiler.checks import check_plan
from piper_nb.compiler.clip import with_grad_clipping
from piper_nb.compiler.global_loss import with_global_loss
from piper_nb.compiler.lower import lower
from piper_nb.compiler.passes import run_pipeline
from piper_nb.compiler.precision import cast_batch, cast_spec, check_precision
from piper_nb.compiler.shapes import propagate
from piper_nb.compiler.stage_order import check_stage_order
from piper_nb.compiler.token_rows import token_rows
from piper_nb.compiler.tp_widen import widen
from piper_nb.directives.base import Context
from piper_nb.directives.recompute import check_recompute
from piper_nb.directives.spec import Directive, Program, Replicate, Schedule, Shard, Split, TensorParallel
from piper_nb.directives.tensor_parallel import tp_groups
from piper_nb.errors import PlanError
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.kinds import Op
from piper_nb.plan.plan import Plan
from piper_nb.schedules import build

__all__ = ["compile", "expand", "build_global_dag", "rebatch"]


def expand(program: Program | Iterable) -> list[tuple[int, Directive]]:
    """(index in the user's program, directive) with schedule builders expanded in place."""
    if not isinstance(program, Program):
        program = Program(program)
    out: list[tuple[int, Directive]] = []
    for i, d in enumerate(program):
        if isinstance(d, Schedule):
            try:
                out += [(i, x) for x in build(d.name, **dict(d.args))]
            except PlanError as err:
                raise err.at(i, "schedule") from None
        else:
            out.append((i, d))
    return out


def build_global_dag(capture, directives: list[tuple[int, Directive]], values: dict,
                     frozen: frozenset[str] = frozenset()) -> TrainingDAG:
    """The placed, ordered DAG: the declared pass pipeline (`compiler.passes`) run over the
    program's directives."""
    return run_pipeline(tuple(directives), Context(capture, values, frozen))


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
        plan = _compile(spec, program, batch, loss_fn, world, check, capture, mixed, loss_mean)
        return with_grad_clipping(plan, clip_grad_norm)


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


def _compile(spec, program, batch, loss_fn, world, check, method, mixed, loss_mean) -> Plan:
    if isinstance(spec, torch.nn.Module):   # no tags: the whole model is one region
        spec = annotate(spec)
    if not isinstance(spec, Spec):
        raise PlanError("compile takes a model, or the Spec returned by "
                        f"pn.annotate(model, {{...}}); got a {type(spec).__name__}")
    user = named_batch(batch, "pn.compile")
    named = cast_batch(user, mixed[0])
    spec = cast_spec(spec, mixed[0])
    directives = expand(program)
    capture = spec.capture(loss_fn, named, method, loss_mean)
    return _plan(capture, directives, named, world, check, mixed, samples(user), spec)


def rebatch(plan: Plan, batch) -> Plan:
    """`plan`'s program compiled for another batch: of another size (a loader's last, smaller
    batch) or other samples (a sequence length the collator padded to); the same
    directives and world, so the same devices, buckets and parameter layouts. An export
    capture, specialised to its example's sample shapes, is made again for new ones (fx
    graphs hold for any). PlanError when the microbatches or replicas do not divide it."""
    if plan.capture is None:
        raise PlanError("this plan carries no captured model; compile it with pn.compile")
    user = named_batch(batch, "rebatch")
    named = cast_batch(user, plan.precision)
    if tuple(named) != plan.batch_names:
        raise PlanError(f"the batch has {list(named)} but the plan was compiled for "
                        f"{list(plan.batch_names)}")
    capture = plan.capture
    if capture.method == "export" and samples(user) != plan.samples:
        if plan.spec is None:
            raise PlanError("this plan was exported for other sample shapes and carries no "
                            "Spec to export again; compile it for this batch with pn.compile")
        capture = plan.spec.capture(capture.loss_fn, named, "export", capture.loss_mean)
    with _gc_paused():
        new = _plan(capture, plan.program, named, plan.world, True,
                    (plan.precision, plan.reduce_dtype), samples(user), plan.spec)
        return with_grad_clipping(new, plan.clip_grad_norm)


def _plan(capture, directives, named: dict, world: int | None, check: bool,
          mixed: tuple[str, str | None] = ("fp32", None), sampled: tuple = (),
          spec: Spec | None = None) -> Plan:
    """Lower and check the directives for the captured model on the named batch."""
    if check:
        check_stage_order(capture)
    bsz = batch_size(named)
    micro = _microbatches(directives, bsz)
    capture = _sharded(capture, directives, named)
    groups = tp_groups(directives)
    frozen = frozenset(n for n, p in capture.named_parameters() if not p.requires_grad)
    # shapes are per replica's share of a microbatch; the replicate directives give the
    # width, unless their regions are placed on smaller groups (a stage's two copies)
    width = max((len(d.devices) for _, d in directives if isinstance(d, Replicate)), default=1)
    width = width if (bsz // micro) % width == 0 else 1
    shapes = _shapes(capture, directives, named, bsz // micro // width)
    dag = build_global_dag(capture, directives, shapes["values"], frozen)
    actual = _check_widths(dag, directives, bsz, micro)
    if actual != width:
        shapes = _shapes(capture, directives, named, bsz // micro // actual)
        dag = build_global_dag(capture, directives, shapes["values"], frozen)
    check_buffers(dag, shapes["changed"])
    check_recompute(dag, shapes["changed"])
    n_world = _world(dag, directives, world, groups)
    devices, buckets = widen(lower(dag, dag.get_meta("buckets", ()), n_world), groups,
                             dag.get_meta("buckets", ()), n_world)
    loss_region = next(r.index for r in capture.regions if r.has_loss)
    loss_width = next(len(n.devices) for n in dag.nodes if n.region == loss_region and n.op == Op.F)
    plan = Plan(
        world=n_world, devices=devices, microbatches=micro, batch_size=bsz,
        loss_scale=1.0 / (micro * loss_width), regions=capture.regions, buckets=buckets,
        values=shapes["values"], saved=shapes["saved"], rows=shapes["rows"],
        saved_rows=shapes["saved_rows"],
        params={k: (tuple(p.shape), str(p.dtype).removeprefix("torch."))
                for k, p in capture.named_parameters()},
        frozen=tuple(sorted(frozen)), batch_names=capture.batch, samples=sampled, spec=spec,
        precision=mixed[0], reduce_dtype=mixed[1],
        pieces={p: tuple(v[:3]) for p, v in getattr(capture, "pieces", {}).items()},
        tp_groups=tuple(groups[k] for k in sorted(groups)),
        tp_params=dict(capture.tp.params) if capture.tp is not None else {},
        dag=dag, program=directives, capture=capture)
    if capture.loss_mean == "global":
        plan = with_global_loss(plan)
    check_buffer_order(plan, shapes["changed"])
    if check:
        check_plan(plan)
    return plan


def _microbatches(directives, bsz: int) -> int:
    splits = [(i, d) for i, d in directives if isinstance(d, Split)]
    micro = 1
    for _, d in splits:
        micro *= d.num
    if bsz % micro:
        raise PlanError(f"{micro} microbatches do not divide the batch of {bsz}; use a divisor "
                        f"of {bsz}", directive=splits[-1][0], op="split")
    return micro


def _shapes(capture, directives, named: dict, part: int) -> dict:
    """Run the regions once on `part` samples: value shapes, saved bytes, the buffers each
    forward changes and (for expert plans) the routed rows as symbols."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: worker threads only get in each other's way
    try:
        with untouched(capture.model):   # the user's buffers and random state stay as they are
            values, saved, _, changed = propagate(capture, slice_batch(named, slice(part)))
            rows, saved_rows = {}, {}
            if any(isinstance(d, Shard) for _, d in directives):  # routed rows: symbolic
                rows, saved_rows = token_rows(capture, slice_batch(named, slice(part)), saved,
                                              values)
    finally:
        torch.set_num_threads(threads)
    params = list(capture.model.parameters())
    if not any(p.requires_grad for p in params):
        raise PlanError(f"nothing to train: all {len(params)} parameters are frozen "
                        "(requires_grad=False); unfreeze some before compiling")
    return {"values": values, "saved": saved, "changed": changed, "rows": rows,
            "saved_rows": saved_rows}


def _check_widths(dag: TrainingDAG, directives, bsz: int, micro: int) -> int:
    """The replica width (devices per pass), checked to divide a microbatch."""
    widths = {len(n.devices) for n in dag.nodes if n.op == Op.F}
    for w in sorted(widths, reverse=True):
        if (bsz // micro) % w:
            idx = next((i for i, d in directives if isinstance(d, Replicate)
                        and len(d.devices) % w == 0), None)
            raise PlanError(f"{w} replicas do not divide the microbatch of {bsz // micro} "
                            f"samples (batch {bsz} / {micro} microbatches); use a batch divisible "
                            f"by {micro * w}", directive=idx,
                            op="replicate" if idx is not None else None)
    return max(widths, default=1)


def _sharded(capture, directives, named: dict):
    """The capture with the tensor-parallel directives' regions cut into parts and sharded
    (`capture.tensor_parallel`); a capture already sharded (a rebatch) stays as it is."""
    tps = [(i, d) for i, d in directives if isinstance(d, TensorParallel)]
    if not tps or capture.tp is not None:
        return capture
    requests = []
    for i, d in tps:
        if d.sequence_parallel:
            raise PlanError("tensor_parallel: sequence_parallel=True is not supported yet (norms "
                            "and residuals stay whole on every device); drop it", directive=i,
                            op=d.op)
        plan = d.plan or model_tp_plan(capture.model)
        if not plan:
            raise PlanError(f"tensor_parallel: {type(capture.model).__name__} has no "
                            "tensor-parallel plan of its own; give one, as plan={'layers.*."
                            "mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}",
                            directive=i, op=d.op)
        if d.plan:   # the user's: every pattern must match (a model's own may list more)
            check_patterns(capture.model, plan, i)
        requests.append(TPRequest(d.filter, d.degree, plan, i))
    with untouched(capture.model):
        return shard_capture(capture, requests, named)


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
