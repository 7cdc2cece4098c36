"""The differential fuzzer's cases: a random model crossed with a random strategy, drawn
from one integer seed, trained and compared with `pn.reference_train`.

A case is a `StageGraph` (skip edges from any earlier stage, values read by several
stages, weights tied between any two stages, frozen stages, BatchNorm and constant
buffers, a mix of activations, sometimes a module called from two stages, sometimes
dropout), some stages recomputed (`pn.recompute`: all microbatches or one), under one
schedule builder (GPipe, 1F1B, interleaved 1F1B with 2 and 3 chunks,
ZB1P, DualPipeV, full DualPipe, a random valid hand-written grid, or none), with data
parallel replicas and ZeRO 0-3 on every stage (PP x DP, at most 4 devices), sometimes
tensor parallelism of degree 2 over MLPs added to some stages (PP x DP x TP), sometimes
with a classifier head cut by class and its vocabulary-parallel cross-entropy, SGD with
momentum, AdamW or another element-wise torch.optim optimizer, sometimes with a no-decay
group for biases, a warmup schedule and global gradient clipping, sometimes in bf16 (with
SGD and no BatchNorm, compared at bf16 tolerance), for 2-3 steps. Fidelity draws: stages
applying a custom autograd Function (`StraightClamp`, a straight-through clamp whose
backward is not its forward's gradient), stages and the dropout module in eval mode
(compared with the reference then), batches of sequences whose length changes from step to
step (each new length compiled once), and the global-batch loss (`loss_mean="global"`)
over targets partly masked out (NaN: the padded labels of a regression), whose
microbatches count different numbers of valid elements. Some stages' linears multiply in
Float8 (`pn.float8`, width 16), compared with one process running the same Float8
linears. Some cases cut every sequence over context groups of two (`pn.context_parallel`,
zigzag or contiguous, attention on some stages: ring attention). The
check: the losses and every entry of the trained `state_dict()` equal the single-process
reference's (rtol 1e-5, atol 4e-5, PyTorch's pipelining tests' tolerance), with clipping
the gradient norms too, and the plan leaves no buffer behind. With dropout, the
same seed trains the same twice; without data parallelism the plan equals the reference
given the same seed (`reference_train(seed=)` draws each region's masks as a plan does;
under TP each device draws its slice of the unsharded masks, the MLP's hidden dropout on
a device's share); with it, under TP, it trains as the plan without TP does (replicas draw
their own shards' masks, which one process does not). BatchNorm gets 4
samples per replica and microbatch and trains with SGD only: it
makes some gradient elements vanish (its output is invariant to a shift of its input, so
a bias before it, or a weight column, gets next to nothing), AdamW divides each element by
its own scale, and fp32 summation order alone then decides those elements' steps (as it
would between two single-process runs summing in different orders). Replicas of a
BatchNorm stage normalize over the whole microbatch (`runtime.syncbn`), so BatchNorm
statistics are compared under data parallelism too.

Replay one case: `python tests/fuzz/run.py --seed N` (or `make fuzz SEED=N`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import warnings
from dataclasses import dataclass, field

import torch

import piper_nb as pn
from piper_nb.directives.spec import Place, Replicate
from piper_nb.models import GraphSpec, StageGraph

RTOL, ATOL = 1e-5, 4e-5
BF16 = (1.6e-2, 1e-3)   # torch.testing's bf16 rtol; see tests/runtime/test_precision.py
SCHEDULES = ("none", "gpipe", "1f1b", "interleaved2", "interleaved3", "zb1p", "dualpipev",
             "dualpipe", "grid")


@dataclass
class Case:
    seed: int
    schedule: str
    ranks: int                 # pipeline ranks
    stages: int
    dp: int                    # data-parallel replicas of every pipeline rank
    zero: int
    reshard: bool
    bucket_size: float | None
    microbatches: int
    per_part: int              # samples per replica and microbatch
    optimizer: str
    steps: int
    spec: GraphSpec
    grid: str = ""
    recompute: tuple[tuple[int, int], ...] = ()   # (stage, microbatch or -1: all)
    groups: bool = False          # no weight decay for biases (a parameter group)
    warmup: bool = False          # a LambdaLR warmup schedule
    clip: float | None = None     # clip_grad_norm (math.inf: the norm only)
    bf16: bool = False            # precision="bf16", compared at bf16 tolerance
    lengths: tuple[int, ...] = ()  # per step: a batch of sequences of that length (() : none)
    global_loss: bool = False     # loss_mean="global" over targets partly masked out (NaN)
    tp: int = 1                   # tensor-parallel degree over the stages' MLPs (spec.mlps)
    sp: bool = False              # ... with sequence parallelism (sequences of `lengths`)
    grad_sync: str | None = None  # ZeRO-3: gradients reduced per "microbatch" or per "step"
    selective: tuple[int, ...] = ()   # stages with attention recomputed selectively
    float8: tuple[int, ...] = ()      # stages whose linears multiply in Float8 (pn.float8)
    cp: int = 1                   # context-parallel degree: every device's sequence shared
    balance: str = "zigzag"       # ... with this load balance
    rotate: str = "all_gather"    # ... keys and values gathered, or passed round ("p2p")
    compiled: tuple[int, ...] = ()    # stages through torch.compile (aot_eager)
    notes: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.ranks * self.dp * self.tp * self.cp

    @property
    def units(self) -> bool:
        """A tensor-parallel stage recomputed in full: its parts run again as one unit."""
        return self.tp > 1 and any(s in self.spec.mlps for s, _ in self.recompute)

    @property
    def regathers(self) -> bool:
        """A sequence-parallel MLP not recomputed in full for every microbatch: its first
        linear keeps its slice of the gathered input, gathered again before its backward."""
        whole = {s for s, mb in self.recompute if mb < 0}
        return self.sp and any(s not in whole for s in self.spec.mlps)

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.dp * self.per_part

    def line(self) -> str:
        s = self.spec
        model = (f"{s.stages} stages dim {s.dim}, skips {list(s.skips)}, ties {list(s.ties)}, "
                 f"frozen {list(s.frozen)}, norms {list(s.norms)}, scales {list(s.scales)}, "
                 f"shared {s.shared}, dropout {s.dropout}, act modules {s.act_modules}, "
                 f"functions {list(s.functions)}, eval {list(s.eval_stages)}"
                 f"{' (dropout too)' if s.eval_dropout else ''}")
        rc = f", recompute {list(self.recompute)}" if self.recompute else ""
        rc += ", bias group" if self.groups else ""
        rc += ", warmup" if self.warmup else ""
        rc += f", clip {self.clip}" if self.clip is not None else ""
        rc += ", bf16" if self.bf16 else ""
        rc += f", lengths {list(self.lengths)}" if self.lengths else ""
        rc += ", global loss over masked targets" if self.global_loss else ""
        rc += (f", TP {self.tp}{' + SP' if self.sp else ''} over the MLPs of stages "
               f"{list(s.mlps)}, attention in {list(s.attns)}" if self.tp > 1 else "")
        rc += f", gradients reduced per {self.grad_sync}" if self.grad_sync else ""
        rc += (f", selective recompute of stages {list(self.selective)} (attention in "
               f"{list(s.attns)})" if self.selective else "")
        rc += f", Float8 in stages {list(self.float8)}" if self.float8 else ""
        rc += (f", CP {self.cp} ({self.balance}, {self.rotate}), attention in "
               f"{list(s.attns)}" if self.cp > 1 else "")
        rc += f", stages {list(self.compiled)} compiled" if self.compiled else ""
        rc += (f", a head of {s.classes} classes (label smoothing {s.smoothing})"
               if s.classes else "")
        return (f"seed {self.seed}: {self.schedule} x{self.ranks} ranks, DP {self.dp}, "
                f"ZeRO {self.zero}{'' if self.reshard else ' (no reshard)'}, bucket "
                f"{self.bucket_size}, {self.microbatches} microbatches of {self.dp * self.per_part}"
                f", {self.optimizer}, {self.steps} steps{rc}; {model}")

    def replay(self) -> str:
        return f".venv/bin/python tests/fuzz/run.py --seed {self.seed}"


def draw(seed: int) -> Case:
    rng = random.Random(seed)
    schedule = rng.choice(SCHEDULES)
    ranks, stages, micro = _shape(rng, schedule)
    dp = rng.choice([d for d in (1, 2, 4) if ranks * d <= 4 and (d > 1 or ranks > 1)])
    zero = rng.choice([0, 1, 2, 3])
    if dp == 1 and schedule != "dualpipe":   # nothing replicated: ZeRO has nothing to shard
        zero = 0
    norms = schedule != "dualpipe"        # BatchNorm on both copies of a stage is refused
    dropout = rng.random() < 0.12
    spec = GraphSpec.draw(rng, stages, norms=norms, dropout=dropout)
    case = Case(seed=seed, schedule=schedule, ranks=ranks, stages=stages, dp=dp, zero=zero,
                reshard=rng.random() < 0.7, bucket_size=rng.choice([None, None, 0.0003]),
                microbatches=micro, per_part=4 if spec.norms else rng.choice([1, 2]),
                optimizer="sgd" if spec.norms else rng.choice(["sgd", "adamw"]),
                steps=rng.choice([2, 3]), spec=spec)
    if zero == 3 and dp > 1:   # its own stream of draws: the other draws stay as they were
        odd = random.Random(f"{seed}:grad_sync").random() < 0.6
        case.grad_sync = ("step" if case.reshard else "microbatch") if odd else None
    if schedule == "grid":
        case.grid = _random_grid(rng, stages, ranks, micro, in_order=bool(spec.norms))
    free = [s for s in range(stages) if s not in spec.norms]   # BatchNorm: refused
    if free and rng.random() < 0.4:
        picked = rng.sample(free, rng.randint(1, len(free)))
        case.recompute = tuple(sorted((s, rng.choice([-1, -1, rng.randrange(micro)]))
                                      for s in picked))
    # drawn last, so the fields above stay what they were for every seed
    if not spec.norms and rng.random() < 0.5:
        case.optimizer = rng.choice(sorted(TORCH_OPTIMIZERS))
    case.groups, case.warmup = rng.random() < 0.3, rng.random() < 0.3
    case.clip = rng.choice([None, None, 0.05, math.inf])
    # bf16 with SGD and without BatchNorm: Adam-like optimizers amplify rounding noise to
    # whole steps, and BatchNorm's statistics (over replicas' shares of a microbatch) round
    # differently in bf16 than over the whole one (mixed-precision recipes keep norms fp32)
    case.bf16 = (case.optimizer == "sgd" and not spec.norms and not spec.dropout
                 and rng.random() < 0.4)
    _draw_fidelity(rng, case)
    _draw_tp(rng, case)
    _draw_selective(case)
    _draw_float8(case)
    _draw_cp(case)
    _draw_compiled(case)
    return case


def _draw_compiled(case: Case) -> None:
    """Some stages through torch.compile (`pn.compile_regions`, AOTAutograd with eager
    kernels: the graphs traced and partitioned as inductor's are, quick to compile), not
    the Float8 ones. Its own stream of draws: every other field keeps its draw."""
    rng = random.Random(f"{case.seed}:compiled")
    if rng.random() >= 0.12:
        return
    stages = [s for s in range(case.stages) if s not in case.float8]
    if stages:
        case.compiled = tuple(sorted(rng.sample(stages, rng.randint(1, len(stages)))))


def _draw_cp(case: Case) -> None:
    """Context parallelism of degree 2 (each pipeline rank and replica widened into a
    group sharing the sequence: two replicas at most, or one on two ranks, 4 devices in
    all), zigzag or contiguous, all-gathered or on the point-to-point ring, over sequences
    of a length both cut, attention on some
    stages, BatchNorm taken out (its statistics are over every token), dropout drawn as
    one process's mask (`cp.dropout`); with TP on one pipeline rank (TP 2, one replica:
    the context over the TP groups' first devices), not with Float8 (scales from each
    share's amax) or selective recompute, nor DualPipe's stage copies. Its own stream of
    draws: the fields it does not name keep their draw."""
    rng = random.Random(f"{case.seed}:cp")
    spec = case.spec
    if ((case.tp > 1 and case.ranks > 1) or case.float8
            or case.selective or case.ranks > 2 or case.schedule == "dualpipe"
            or rng.random() >= (0.7 if case.tp > 1 else 0.35)):
        return
    if case.tp > 1:   # CP 2 x TP 2: four devices (two samples at least, for torch.export)
        case.tp, case.dp, case.zero, case.grad_sync = 2, 1, 0, None
        case.per_part = max(case.per_part, 2)
    if case.ranks * case.dp > 2:
        case.dp = 2 // case.ranks
        if case.dp == 1:
            case.zero, case.grad_sync = 0, None
    case.cp, case.balance = 2, rng.choice(["zigzag", "contiguous"])
    # the rotation from a stream of its own: the cases drawn before it keep every draw
    case.rotate = random.Random(f"{case.seed}:cp-rotate").choice(["all_gather", "p2p"])
    case.lengths = (4 * rng.choice([1, 2]),) * case.steps
    stages = spec.stages
    case.spec = dataclasses.replace(spec, norms=(), attns=tuple(sorted(
        rng.sample(range(stages), rng.randint(1, stages)))))


def _draw_float8(case: Case) -> None:
    """Float8 linears in some stages (`pn.float8`), not under TP (refused there: per-shard
    scales) nor with BatchNorm under data parallelism (the one process it equals then runs
    whole microbatches, where each replica scales its share by its own amax); the model's
    width becomes 16, what Float8 matmuls take. A module two stages call (`shared`) is
    Float8 in both or neither, as one process runs it. Its own stream of draws: every other
    field keeps its draw."""
    rng = random.Random(f"{case.seed}:float8")
    if case.tp > 1 or (case.spec.norms and case.dp > 1) or rng.random() >= 0.25:
        return
    stages = set(rng.sample(range(case.stages), rng.randint(1, case.stages)))
    if case.spec.shared and stages & set(case.spec.shared):
        stages |= set(case.spec.shared)
    case.float8 = tuple(sorted(stages))
    case.spec = dataclasses.replace(case.spec, dim=16)


def reference_model(case: Case, model: StageGraph):
    """The one process a case equals: `model`, with the Float8 stages' linears Float8 (the
    head's too where the last stage is, the shared module's where its stages are)."""
    if not case.float8:
        return model
    from piper_nb.capture.float8 import Float8Linear
    owner = model.annotation()
    return Float8Linear.swap(model, [path for path, tags in owner.items()
                                     if tags["PP"] in case.float8])


def _draw_selective(case: Case) -> None:
    """Selective recompute of some stages with attention (their attention cores run again
    in the backward); over sequences without TP, attention added to some stages for it (a
    batch of two samples at least: one is captured by torch.export, which specialises it).
    Its own stream of draws: every other field keeps its draw."""
    rng = random.Random(f"{case.seed}:selective")
    stages, attns = case.spec.stages, case.spec.attns
    if not attns and case.lengths and case.tp == 1 and case.batch_size >= 2:
        if rng.random() < 0.5:
            attns = tuple(sorted(rng.sample(range(stages), rng.randint(1, stages))))
            case.spec = dataclasses.replace(case.spec, attns=attns)
            case.selective = tuple(sorted(rng.sample(attns, rng.randint(1, len(attns)))))
    elif attns and rng.random() < 0.5:
        case.selective = tuple(sorted(rng.sample(attns, rng.randint(1, len(attns)))))


def _draw_tp(rng: random.Random, case: Case) -> None:
    """Tensor parallelism of degree 2 over MLPs added to some stages (each pipeline rank
    and replica widened into a group of two devices, at most 4 devices in all), or of
    degree 4 on one rank; half the time with sequence parallelism (over sequences), and
    with sequences, self-attention on some stages; not with BatchNorm, whose replicas'
    statistics sync over data-parallel groups only (drawn last: earlier fields keep their
    draw)."""
    if case.spec.norms or case.ranks * case.dp > 2 or rng.random() >= 0.7:
        return
    stages = case.spec.stages
    mlps = tuple(sorted(rng.sample(range(stages), rng.randint(1, stages))))
    case.spec = dataclasses.replace(case.spec, mlps=mlps)
    case.tp = 2
    # a classifier head cut by class, whose cross-entropy is then vocabulary-parallel (the
    # logits never gathered); not with the global loss, whose form is the masked MSE
    if not case.global_loss and rng.random() < 0.5:
        case.spec = dataclasses.replace(case.spec, classes=rng.choice([4, 6]),
                                        smoothing=rng.choice([0.0, 0.1]))
    # degree 4 on one pipeline rank without replicas (4 devices at most); sequence
    # parallelism over sequences of a length the degree divides, attention on some stages
    if case.ranks == 1 and rng.random() < 0.4:
        case.tp, case.dp, case.zero, case.grad_sync = 4, 1, 0, None
    if rng.random() < 0.5:
        case.sp = True
        length = case.tp * rng.choice([1, 2])
        case.lengths = (length,) * case.steps
    if case.lengths:
        case.spec = dataclasses.replace(case.spec, attns=tuple(sorted(
            rng.sample(range(stages), rng.randint(0, stages)))))


def _draw_fidelity(rng: random.Random, case: Case) -> None:
    """Custom autograd Functions, eval-mode stages, changing sequence lengths, the global
    loss over masked targets (drawn after everything else: earlier fields keep their draw)."""
    spec, stages = case.spec, case.spec.stages
    functions = tuple(i for i in range(stages) if rng.random() < 0.2)
    # eval mode on some stages (BatchNorm then normalizes with its running statistics, which
    # never move), and sometimes on the dropout too (off, so compared with the reference)
    eval_stages = tuple(i for i in range(stages) if rng.random() < 0.25)
    eval_dropout = bool(spec.dropout) and rng.random() < 0.5
    case.spec = dataclasses.replace(spec, functions=functions, eval_stages=eval_stages,
                                    eval_dropout=eval_dropout)
    if not spec.norms and not case.bf16 and rng.random() < 0.2:
        first = rng.choice([2, 3])
        case.lengths = tuple([first] + [rng.choice([first, 1, 2, 3]) for _ in range(case.steps - 1)])
    case.global_loss = not case.bf16 and rng.random() < 0.25


def _shape(rng: random.Random, schedule: str) -> tuple[int, int, int]:
    """(ranks, stages, microbatches) the schedule accepts."""
    if schedule == "none":
        return 1, rng.randint(1, 4), rng.choice([1, 2, 3])
    if schedule in ("gpipe", "1f1b", "zb1p"):
        r = rng.choice([2, 2, 3, 4])
        return r, r, rng.choice([r, r + 1, 2 * r]) if schedule != "zb1p" else rng.choice([r, 2 * r])
    if schedule.startswith("interleaved"):
        c = int(schedule[-1])
        return 2, 2 * c, rng.choice([2, 4])
    if schedule == "dualpipev":
        r = rng.choice([1, 2, 2])
        return r, 2 * r, rng.choice([2 * r, 2 * r + 2])
    if schedule == "dualpipe":
        r = rng.choice([2, 2, 4])
        return r, r, 2 * r + rng.choice([0, 2])
    r = rng.choice([2, 3, 4])
    return r, rng.randint(r, min(2 * r, 6)), rng.choice([1, 2, 3])


def _random_grid(rng: random.Random, stages: int, ranks: int, micro: int,
                 in_order: bool = False) -> str:
    """A valid grid: stages dealt to ranks, then one random global order of the passes
    (a forward after the previous stage's; a backward, or an I and later its W, after its
    forward and every later stage's), cut into one row per rank. `in_order`: each stage's
    forwards in microbatch order (what a model with BatchNorm statistics needs)."""
    owner = list(range(ranks)) + [rng.randrange(ranks) for _ in range(stages - ranks)]
    rng.shuffle(owner)
    split = {(s, m): rng.random() < 0.3 for s in range(stages) for m in range(micro)}
    done: set[tuple[str, int, int]] = set()
    todo = [(p, s, m) for s in range(stages) for m in range(micro)
            for p in (("F", "I", "W") if split[(s, m)] else ("F", "B"))]
    rows: list[list[str]] = [[] for _ in range(ranks)]

    def grads(s: int, m: int) -> bool:
        return ("B", s, m) in done or ("I", s, m) in done

    def ready(p: str, s: int, m: int) -> bool:
        if p == "F":
            return ((s == 0 or ("F", s - 1, m) in done)
                    and (not in_order or m == 0 or ("F", s, m - 1) in done))
        if p == "W":
            return ("I", s, m) in done
        return ("F", s, m) in done and all(grads(t, m) for t in range(s + 1, stages))

    while todo:
        p, s, m = rng.choice([a for a in todo if ready(*a)])
        todo.remove((p, s, m))
        done.add((p, s, m))
        rows[owner[s]].append(f"{s}{p}{m}")
    return "\n".join(" ".join(r) for r in rows)


def program(case: Case) -> list:
    """The case's directives: the schedule's (with `place`), every pipeline rank r turned
    into the replica group [r, r + ranks, ...] and replicated with the case's ZeRO level;
    under CP, each of those devices d leads the context group [d, d + ranks x dp, ...];
    under TP, each device d so far leads the group [d, d + ranks x dp x cp, ...]."""
    out = _program(case)
    if case.cp > 1:   # device d leads the context group [d, d + ranks x dp, ...]
        lead = case.ranks * case.dp
        group = {d: [d + k * lead for k in range(case.cp)] for d in range(lead)}
        out = [_in_groups(d, group) for d in out]
        out.append(pn.context_parallel({}, list(group.values()), load_balance=case.balance,
                                       rotate=case.rotate))
    if case.tp > 1:   # under CP, the context members lead the TP groups
        lead = case.ranks * case.dp * case.cp
        out.append(pn.tensor_parallel({}, [[d + k * lead for k in range(case.tp)]
                                           for d in range(lead)], sequence_parallel=case.sp))
    return out


def _in_groups(d, group: dict):
    """A place or replicate over devices made one over their context groups, in order."""
    if isinstance(d, (Place, Replicate)):
        return dataclasses.replace(d, devices=tuple(m for x in d.devices for m in group[x]))
    return d


def _program(case: Case) -> list:
    r, c = case.ranks, case.microbatches
    rc = [pn.recompute({"PP": s} if mb < 0 else {"PP": s, "MB": mb}) for s, mb in case.recompute]
    rc += [pn.recompute({"PP": s}, mode="selective") for s in case.selective]
    rc += [pn.float8({"PP": s}) for s in case.float8]
    rc += [pn.compile_regions({"PP": s}, backend="aot_eager") for s in case.compiled]
    if case.schedule == "none":
        devs = list(range(case.dp))
        return [pn.place({}, devs), _replicate({}, devs, case), pn.split({}, "MB", c), *rc]
    build = {
        "gpipe": lambda: pn.schedules.gpipe(r, c, place=True),
        "1f1b": lambda: pn.schedules.one_f_one_b(r, c, place=True),
        "interleaved2": lambda: pn.schedules.interleaved_1f1b(r, c, chunks=2, place=True),
        "interleaved3": lambda: pn.schedules.interleaved_1f1b(r, c, chunks=3, place=True),
        "zb1p": lambda: pn.schedules.zero_bubble(r, c, place=True),
        "dualpipev": lambda: pn.schedules.dualpipev(r, c, place=True),
        "dualpipe": lambda: pn.schedules.dualpipe(r, c, place=True),
        "grid": lambda: pn.schedules.from_grid(case.grid, c, place=True),
    }[case.schedule]
    out, holders = [], {}
    for d in build():
        if not isinstance(d, Place):
            out.append(d)
            continue
        devs = [x + k * r for x in d.devices for k in range(case.dp)]
        out.append(pn.place(d.filter, devs))
        holders.setdefault(d.filter["PP"], set()).update(devs)
    if case.dp > 1 or case.schedule == "dualpipe":   # replicas, or a DualPipe stage's copies
        out += [_replicate({"PP": s}, sorted(devs), case) for s, devs in sorted(holders.items())]
    return out + rc


def _replicate(filt: dict, devs: list[int], case: Case):
    return pn.replicate(filt, devs, zero=case.zero, bucket_size=case.bucket_size,
                        reshard=case.reshard or case.zero != 3,
                        grad_sync=case.grad_sync if case.zero == 3 else None)


TORCH_OPTIMIZERS = {   # element-wise torch.optim optimizers, as users pass them
    "adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
    "adamax": functools.partial(torch.optim.Adamax, lr=1e-2),
    "nadam": functools.partial(torch.optim.NAdam, lr=1e-2),
    "radam": functools.partial(torch.optim.RAdam, lr=1e-2),
}


def optimizer(case: Case):
    if case.optimizer in TORCH_OPTIMIZERS:
        return TORCH_OPTIMIZERS[case.optimizer]
    return pn.optim.SGD(0.05, momentum=0.9) if case.optimizer == "sgd" else pn.optim.AdamW(1e-2)


def recipe(case: Case) -> dict:
    """The training options the case draws, as pn.train and reference_train take them."""
    return {"param_groups": [{"params": "*.bias", "weight_decay": 0.0}] if case.groups else None,
            "lr_scheduler": _warmup if case.warmup else None, "clip_grad_norm": case.clip}


def _warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def masked_sum(output: torch.Tensor, targets: torch.Tensor):
    """The global loss's form: (squared error summed over the valid targets, their count);
    a NaN target is padding."""
    valid = ~torch.isnan(targets)
    diff = torch.where(valid, output - torch.nan_to_num(targets), torch.zeros_like(output))
    return diff.square().sum(), valid.sum()


def batches(case: Case, model: StageGraph) -> list:
    """One batch per step: the same one, or (`lengths`) sequences of each step's length;
    under the global loss, some targets masked out (NaN), more in some rows than others."""
    if case.lengths:
        out = [model.example_batch(case.batch_size, seed=case.seed + s, length=n)
               for s, n in enumerate(case.lengths)]
    else:
        out = [model.example_batch(case.batch_size, seed=case.seed)] * case.steps
    if case.global_loss:
        masked = []
        for x, y in out:
            y = y.clone()
            for row in range(0, y.shape[0], 3):
                y[row, ..., row % y.shape[-1]:] = float("nan")
            masked.append((x, y))
        out = masked
    return out


def check(case: Case, cluster, streams: bool = False) -> str:
    """Train the case and compare; raises AssertionError naming the case and its replay
    command. Returns what was compared. `streams` (on an NCCL-emulated cluster) also
    checks that each device's streams executed exactly the plan's stream program."""
    model = StageGraph(case.spec)
    steps = batches(case, model)
    batch = steps[0]
    loss = ({"loss_fn": masked_sum, "loss_mean": "global"} if case.global_loss else {})
    try:
        plan = pn.compile(pn.annotate(model, model.annotation()), program(case), batch,
                          precision="bf16" if case.bf16 else "fp32", **loss)
        opt = optimizer(case)
        with warnings.catch_warnings():   # a new sequence length: compiled once, and said
            warnings.simplefilter("ignore", UserWarning)
            result = pn.train(plan, iter(steps), case.steps, opt, cluster=cluster,
                              seed=case.seed, **recipe(case))
            if case.spec.dropout and not case.spec.eval_dropout:
                again = pn.train(plan, iter(steps), case.steps, opt, cluster=cluster,
                                 seed=case.seed, **recipe(case))
                _equal(result, again, exact=True)
                if case.dp == 1:   # each forward sees its whole microbatch: the seeded reference
                    ref = pn.reference_train(pn.annotate(reference_model(case, model),
                                                         model.annotation()),
                                             iter(steps), case.steps, plan.microbatches, opt,
                                             precision="bf16" if case.bf16 else "fp32",
                                             seed=case.seed, **recipe(case), **loss)
                    _equal(result, ref, tol=BF16 if case.bf16 else (RTOL, ATOL))
                    return "same twice with one seed, and equal to the seeded reference"
                if case.tp == 1:
                    return "same twice with one seed (dropout; replicas draw their own)"
                # TP draws each device's slice of the unsharded masks: equal to the plan
                # without TP (the MLP's hidden dropout is on a device's share)
                whole = pn.compile(pn.annotate(model, model.annotation()), _program(case),
                                   batch, precision="bf16" if case.bf16 else "fp32", **loss)
                unsharded = pn.train(whole, iter(steps), case.steps, opt, cluster=cluster,
                                     seed=case.seed, **recipe(case))
                _equal(result, unsharded, tol=BF16 if case.bf16 else (RTOL, ATOL))
                return "same twice with one seed, and as without TP (dropout)"
        # the one process a plan equals (`Plan.reference_microbatches`); with BatchNorm,
        # which normalizes each whole microbatch, the plan's own microbatches (the MSE of
        # equal slices averages the same either way)
        micro = case.microbatches if case.spec.norms else plan.reference_microbatches
        if case.float8:   # each forward scales by its own slice's amax: the plan's slices
            micro = case.microbatches * case.dp
        ref = pn.reference_train(reference_model(case, model), iter(steps), case.steps, micro,
                                 opt,
                                 precision="bf16" if case.bf16 else "fp32", **recipe(case),
                                 **loss)
        rtol, atol = BF16 if case.bf16 else (RTOL, ATOL)
        _equal(result, ref, tol=(rtol, atol))
        if case.clip is not None:   # the global norm: every parameter counted once
            torch.testing.assert_close(torch.tensor(result.grad_norms),
                                       torch.tensor(ref.grad_norms), rtol=rtol, atol=atol)
        assert result.leftover == [], f"buffers never freed: {result.leftover[:4]}"
        if streams:
            ran_its_stream_program(plan, batch, cluster, opt)
            return "equal to the reference, its stream program run exactly"
        return "equal to the reference"
    except Exception as err:
        raise AssertionError(f"fuzz case failed: {case.line()}\n  {type(err).__name__}: {err}\n"
                             f"  replay: {case.replay()}") from err


def ran_its_stream_program(plan, batch, cluster, opt) -> None:
    """One more step recording what each stream executed: the plan's stream program."""
    cluster.reset(plan, opt)
    for d, out in enumerate(cluster.step(plan, batch, record_streams=True)[:plan.world]):
        want = plan.streams()[d].streams()
        got = {k: tuple(v) for k, v in out["streams"].items()}
        assert got == want, f"device {d} ran streams {sorted(got)} unlike its program"


def _equal(result, ref, exact: bool = False, tol: tuple = (RTOL, ATOL)) -> None:
    rtol, atol = (0.0, 0.0) if exact else tol
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=rtol, atol=atol, msg=lambda m: f"losses: {m}")
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() == want.keys(), f"state_dict keys differ: {got.keys() ^ want.keys()}"
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")
