"""A candidate's knobs as what a user would write: the stage cut (a `pn.annotate` mapping)
and the directive program (`pn.Program`), and the tokens a step trains on.

Devices are numbered TP innermost, then context rank, then pipeline rank, then replica
(Megatron's order; a TP group is consecutive devices, inside one node). A stage is
replicated over its replicas' context groups (ZeRO shards over both, torchtitan's
`dp_shard_cp`). Stages are cut over the pipeline units
(`pn.cut_stages`' units: embedding, layers, head) so the largest stage's forward and
backward time is smallest, which leaves the first and last stages fewer layers where the
embedding and the head weigh. A stage is recomputed when its rank is among the first
`recompute` ranks; its layers (the units between the first and the last) are, or one in
`every` of them counting from the first layer (tagged `AC: 2` then). With EP, a stage's
experts are spread over its replicas (`pn.shard`, the experts tagged `EP`). Float8
(`pn.float8`) rewrites the layers' linears, not the embedding's or the head's (torchtitan's
`filter_fqns` leaves the output projection in bf16).
"""

from __future__ import annotations

from piper_nb.capture.annotate import _linear_partition
from piper_nb.capture.batch import Batch
from piper_nb.planner.knobs import Knobs, Schedule

__all__ = ["token_count", "cut", "annotation", "program", "is_layer", "recomputes"]


def token_count(batch: Batch) -> int:
    """Tokens a step trains on: the first integer tensor's elements (ids), else samples."""
    for t in batch.values():
        if not t.is_floating_point() and t.dim() >= 2:
            return t.numel()
    return batch.size


def cut(weights: list[float], stages: int) -> list[int]:
    """The stage of each unit: contiguous, each stage at least one unit, the heaviest
    stage as light as can be."""
    return _linear_partition([max(w, 1e-12) for w in weights], stages)


def annotation(units: list[str], stage_of: list[int], every: int = 1,
               experts: dict | None = None) -> dict:
    """The `pn.annotate` mapping: each unit's stage and its index `L` (a region of its own,
    recomputed alone, as the probe priced it); the layers between the first and the last
    unit tagged `AC` (what a recompute directive names): 1, or 2 for the one layer in
    `every` that recomputes; and `experts`, the entries tagging a MoE model's experts
    (`planner.experts.Experts.tags`)."""
    n = len(units)
    return {**{u: {"PP": s, "L": i, **({"AC": _ac(i, n, every)} if is_layer(i, n) else {})}
               for i, (u, s) in enumerate(zip(units, stage_of, strict=True))},
            **(experts or {})}


def _ac(i: int, n: int, every: int) -> int:
    return 2 if every > 1 and _one_in(i, n, every) else 1


def is_layer(i: int, n: int) -> bool:
    """Whether unit `i` of `n` is a layer (not the first or last unit of three or more)."""
    return 0 < i < n - 1 or n <= 2


def _one_in(i: int, n: int, every: int) -> bool:
    """Whether layer unit `i` of `n` is one of the layers 0, `every`, 2 `every`, ..."""
    return (i if n <= 2 else i - 1) % every == 0


def recomputes(k: Knobs, stage: int, i: int, n: int) -> bool:
    """Whether candidate `k` recomputes unit `i` of `n`, on `stage`."""
    return k.rank_of(stage) < k.recompute and is_layer(i, n) and _one_in(i, n, k.every)


def program(k: Knobs, stage_of: list[int], expert_units=()) -> list:
    """The directives of candidate `k` whose units run on stages `stage_of` (see the module
    docstring); with EP, each stage holding one of `expert_units` (unit indices) shards its
    experts over its replicas."""
    from piper_nb import schedules
    from piper_nb.cp import context_parallel
    from piper_nb.directives.float8 import float8
    from piper_nb.directives.shard import shard
    from piper_nb.directives.spec import place, recompute, replicate, split
    from piper_nb.tp import tensor_parallel
    # the first device of pipeline rank r's context member c in replica rep
    lead = lambda r, rep, c=0: ((rep * k.pp + r) * k.cp + c) * k.tp   # noqa: E731
    out = []
    for s in range(k.stages):
        devs = [lead(k.rank_of(s), rep, c) for rep in range(k.dp) for c in range(k.cp)]
        out.append(place({"PP": s}, devs))
        if k.dp > 1 or k.zero:
            out.append(replicate({"PP": s}, devs, zero=k.zero,
                                    reshard=k.pp == 1 or k.zero < 3))
        if k.ep > 1 and any(stage_of[i] == s for i in expert_units):
            out.append(shard({"PP": s, "EP": "*"}, devs))
    if k.tp > 1:
        groups = [[lead(r, rep, c) + t for t in range(k.tp)] for rep in range(k.dp)
                  for r in range(k.pp) for c in range(k.cp)]
        out.append(tensor_parallel({"PP": "*"}, groups, sequence_parallel=k.sp))
    if k.cp > 1:
        groups = [[lead(r, rep, c) for c in range(k.cp)] for rep in range(k.dp)
                  for r in range(k.pp)]
        out.append(context_parallel({}, groups))
    m, pp = k.microbatches, k.pp
    out += {Schedule.NONE: lambda: [split({}, "MB", m)],
            Schedule.GPIPE: lambda: schedules.gpipe(pp, m),
            Schedule.ONE_F_ONE_B: lambda: schedules.one_f_one_b(pp, m),
            Schedule.INTERLEAVED: lambda: schedules.interleaved_1f1b(pp, m, chunks=2),
            Schedule.ZB1P: lambda: schedules.zero_bubble(pp, m),
            Schedule.DUALPIPEV: lambda: schedules.dualpipev(pp, m)}[k.schedule]()
    if k.float8:
        out.append(float8({"AC": "*"}))
    n = len(stage_of)
    chosen = {s for i, s in enumerate(stage_of) if recomputes(k, s, i, n)}
    out += [recompute({"PP": s, "AC": 2 if k.every > 1 else 1}) for s in range(k.stages)
            if s in chosen]
    return out
