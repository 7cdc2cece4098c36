"""The knobs a strategy search turns, and the space of their values: `Knobs` (one
candidate's settings) and `space` (every combination a device count, a batch and the
user's pins allow, in a fixed order).

A candidate is PP x TP x CP x DP = the device count (TP innermost and inside one node, then
CP, then PP, then DP, Megatron's numbering), a ZeRO level (DP x CP > 1), a schedule (none without PP; GPipe,
1F1B, interleaved 1F1B with two stages a rank, ZB1P, DualPipeV with PP), a microbatch count
dividing each replica's share of the batch, how many leading pipeline ranks recompute their
layers (`recompute`: 0 none, PP all) and, where every rank does, which of them (`every`: one
layer in 1 or 2, or as pinned; torchtitan's `selective_ac_option`), Megatron's sequence
parallelism under TP, and, when pinned, Float8 matmuls in the layers (`pn.float8`, torchao's tensorwise
scaling) without TP (Float8 under TP prices but does not train: its scales would be per
shard). Float8 is not tried unless pinned: regions run eagerly, where its casts cost more
than its matmuls save, and its probe would cost a class of its own. For a mixture-of-experts
model, expert parallelism (`ep`): the experts replicated with their stage (1), or spread
over its DP group (DP, `pn.shard`) where their count allows. Context parallelism (`cp`,
`pn.context_parallel`: the sequence cut over CP devices, attention a ring) is tried for
long sequences (`LONG_SEQUENCE` tokens and more), at the degrees whose zigzag chunks keep
`CP_CHUNK` tokens or more, or as pinned, with TP too (the context over the TP groups'
first devices); not with EP yet. ZeRO shards over DP x CP, as torchtitan's `dp_shard_cp`
does.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum

from piper_nb.errors import PlanError

__all__ = ["Schedule", "Knobs", "KNOBS", "space", "divisors", "check_pins", "stage_rank",
           "context_degrees", "LONG_SEQUENCE"]


class Schedule(StrEnum):
    """The pipeline schedules a search tries (`pn.schedules`' builders)."""

    NONE = "none"             # no pipeline: gradient accumulation over the microbatches
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB1P = "zb1p"
    DUALPIPEV = "dualpipev"

    @property
    def chunks(self) -> int:
        """Stages a rank holds."""
        return 2 if self in (Schedule.INTERLEAVED, Schedule.DUALPIPEV) else 1


@dataclass(frozen=True, order=True)
class Knobs:
    """One candidate's settings."""

    pp: int
    tp: int
    dp: int
    zero: int
    schedule: Schedule
    microbatches: int
    recompute: int          # leading pipeline ranks that recompute their layers (0..pp)
    sp: bool                # Megatron's sequence parallelism (TP > 1)
    float8: bool = False    # the layers' linears multiply in Float8 (`pn.float8`), TP 1
    every: int = 1          # of the recomputing ranks' layers, one in `every` (layer 0, k, ..)
    ep: int = 1             # experts spread over each stage's DP group (1, or DP: `pn.shard`)
    cp: int = 1             # devices sharing each sequence (`pn.context_parallel`)

    @property
    def shards(self) -> int:
        """Devices a stage's parameters are replicated over (and ZeRO shards them over):
        its replicas and their context groups."""
        return self.dp * self.cp

    @property
    def stages(self) -> int:
        return self.pp * self.schedule.chunks

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that runs `stage`: interleaved s % PP, DualPipeV's V shape."""
        return stage_rank(self.schedule, self.pp, stage)

    def label(self) -> str:
        """A short text form, e.g. `PP4 TP8 DP4 Z1 1f1b m16 rc4 sp` (`CP2` after TP, `EP4`
        after DP)."""
        parts = [f"PP{self.pp}", f"TP{self.tp}", *([f"CP{self.cp}"] if self.cp > 1 else []),
                 f"DP{self.dp}",
                 *([f"EP{self.ep}"] if self.ep > 1 else []), f"Z{self.zero}",
                 str(self.schedule), f"m{self.microbatches}"]
        if self.recompute:
            parts.append(f"rc{self.recompute}" + (f"/{self.every}" if self.every > 1 else ""))
        if self.sp:
            parts.append("sp")
        if self.float8:
            parts.append("f8")
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {**asdict(self), "schedule": str(self.schedule)}


def stage_rank(schedule: Schedule, pp: int, stage: int) -> int:
    """The pipeline rank that runs `stage` under `schedule` over `pp` ranks."""
    if schedule is Schedule.DUALPIPEV and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


KNOBS = ("pp", "tp", "dp", "zero", "schedule", "microbatches", "recompute", "sp", "float8",
         "every", "ep", "cp")
EVERY = (1, 2)   # one layer in k recomputed where every rank recomputes (others: pin them)
# context parallelism is tried unpinned from this many tokens a sequence (Megatron's and
# torchtitan's long-context runs start at 8k-32k; shorter ones fit without it) ...
LONG_SEQUENCE = 8192
# ... at degrees whose zigzag chunks (2 CP a sequence) keep this many tokens: a ring step
# over fewer is bound by latency, not by the attention it overlaps
CP_CHUNK = 1024


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_pins(pin: Mapping | None) -> dict:
    """The user's pins as {knob: set of allowed values}; a PlanError names a bad one."""
    out = {}
    for k, v in (pin or {}).items():
        if k not in KNOBS:
            raise PlanError(f"pn.search: cannot pin {k!r}; the knobs are {', '.join(KNOBS)}")
        values = v if isinstance(v, (list, tuple, set, frozenset)) else [v]
        if k == "schedule":
            try:
                values = [Schedule(str(s).lower()) for s in values]
            except ValueError:
                raise PlanError(f"pn.search: pin schedule={v!r} is not a schedule; use one of "
                                f"{', '.join(s.value for s in Schedule)}") from None
        elif k in ("sp", "float8"):
            if any(not isinstance(s, (bool, int)) for s in values):
                raise PlanError(f"pn.search: pin {k}={v!r} must be True or False (or both)")
            values = [bool(s) for s in values]
        elif k == "recompute" and all(isinstance(s, (bool, str)) for s in values):
            words = {True: "all", False: 0, "all": "all", "full": "all", "none": 0}
            if any(s not in words for s in values):
                raise PlanError(f"pn.search: pin recompute={v!r}: use 'all', 'none', True, "
                                "False, or how many leading pipeline ranks recompute")
            values = [words[s] for s in values]
        elif any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in values):
            raise PlanError(f"pn.search: pin {k}={v!r} must be a non-negative int or a list "
                            "of them")
        elif k == "every" and 0 in values:
            raise PlanError(f"pn.search: pin every={v!r}: one layer in every k is "
                            "recomputed, k at least 1")
        out[k] = set(values)
    return out


def space(devices: int, batch_size: int, stages_max: int, *, gpus_per_node: int,
          pins: Mapping[str, set] | None = None, experts=None,
          sequence: int | None = None) -> Iterator[Knobs]:
    """Every candidate for `devices` devices and a batch of `batch_size` sequences (samples)
    of `sequence` tokens: a model of `stages_max` pipeline units can hold at most that many
    stages; TP at most `gpus_per_node` (one node), dividing the node; CP for long sequences
    or as pinned (`context_degrees`); Float8 as pinned, without TP; with `experts`
    (`planner.experts.Experts`, a MoE model), EP 1 or DP where they allow it."""
    pins = pins or {}
    ok = lambda k, v: k not in pins or v in pins[k]   # noqa: E731
    node = min(gpus_per_node, devices)
    for tp, cp in ((t, c) for t in divisors(node) if gpus_per_node % t == 0 or t == devices
                   for c in context_degrees(devices // t, sequence, pins)):
        if not ok("tp", tp) or devices % (tp * cp):
            continue
        for pp in divisors(devices // (tp * cp)):
            dp = devices // (tp * cp * pp)
            if not (ok("pp", pp) and ok("dp", dp)) or batch_size % dp:
                continue
            local = batch_size // dp
            for schedule in _schedules(pp):
                if not ok("schedule", schedule) or pp * schedule.chunks > stages_max:
                    continue
                for m in divisors(local):
                    if not ok("microbatches", m) or not _fits_schedule(schedule, pp, m):
                        continue
                    for zero, ep in _zeros(dp, cp, experts):
                        if not (ok("zero", zero) and ok("ep", ep)):
                            continue
                        for rc, every in _recomputes(pp, pins):
                            if not (ok("recompute", rc) or (rc == pp and ok("recompute", "all"))):
                                continue
                            for sp in ((False, True) if tp > 1 else (False,)):
                                if not ok("sp", sp):
                                    continue
                                for f8 in sorted(pins.get("float8", {False})) if tp == 1 \
                                        else (False,):
                                    if ok("float8", f8):
                                        yield Knobs(pp, tp, dp, zero, schedule, m, rc, sp,
                                                    f8, every, ep, cp)


def context_degrees(devices: int, sequence: int | None, pins: Mapping[str, set]) -> list[int]:
    """The CP degrees tried on `devices` devices: the pinned ones that divide them; else 1,
    and for a sequence of `LONG_SEQUENCE` tokens or more each degree dividing the devices
    whose zigzag chunks divide it and keep `CP_CHUNK` tokens."""
    pinned = pins.get("cp")
    if pinned is not None:
        return sorted(c for c in pinned if c >= 1 and devices % c == 0)
    if not sequence or sequence < LONG_SEQUENCE:
        return [1]
    return [c for c in divisors(devices)
            if c == 1 or (sequence % (2 * c) == 0 and sequence // (2 * c) >= CP_CHUNK)]


def _zeros(dp: int, cp: int, experts) -> list[tuple[int, int]]:
    """(ZeRO level, EP) pairs: ZeRO 0-3 with DP or CP (sharded over both), each with the
    experts replicated and, where they allow it (and without CP), spread over the DP
    group."""
    eps = ((1, dp) if dp > 1 and cp == 1 and experts is not None and experts.allows(dp)
           else (1,))
    return [(z, ep) for z in ((0, 1, 2, 3) if dp * cp > 1 else (0,)) for ep in eps]


def _recomputes(pp: int, pins: Mapping[str, set]) -> list[tuple[int, int]]:
    """(leading ranks that recompute, one layer in how many): none, half the ranks, or all
    of them, every layer or one in 2 (or the pinned `every`: 4, ...)."""
    every = sorted(pins.get("every", EVERY))
    out = []
    for rc in sorted({0, pp // 2, pp} if pp > 1 else {0, 1}):
        if rc == max(pp, 1):
            out += [(rc, e) for e in every]
        elif 1 in every:
            out.append((rc, 1))
    return out


def _schedules(pp: int) -> tuple[Schedule, ...]:
    if pp == 1:
        return (Schedule.NONE,)
    return tuple(s for s in Schedule if s is not Schedule.NONE)


def _fits_schedule(schedule: Schedule, pp: int, m: int) -> bool:
    """The builders' own rules (`pn.schedules`), and at least as many microbatches as
    ranks (fewer leave a rank idle for most of the step)."""
    if schedule is Schedule.NONE:
        return True
    if schedule is Schedule.INTERLEAVED:
        return m % pp == 0
    if schedule is Schedule.DUALPIPEV:
        return m >= 2 * pp
    return m >= pp
