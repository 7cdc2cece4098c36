"""Plans: one instruction list per device (`DevicePlan`), the only thing the runtime executes,
and the `Plan` that holds them with the tables the runtime and the simulator share.

Instructions are `plan.instr.Instr` values in the notation of `piper_nb.ir.text`, whose
docstring is the glossary. Communication is issued on its own logical stream and waited
for right before its consumer, so it overlaps compute. `print(plan)` shows every device's
list side by side with what the `r`/`b` prefixes stand for; the JSON form is exact.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from piper_nb.capture.annotate import Spec
from piper_nb.capture.split import Capture, RegionInfo
from piper_nb.directives.replicate import Bucket
from piper_nb.directives.spec import Program
from piper_nb.ir.dag import TrainingDAG
from piper_nb.ir.filters import freeze_tags
from piper_nb.ir.kinds import Op
from piper_nb.ir.text import bucket_legend, region_legend, wait_text
from piper_nb.plan.instr import Instr
from piper_nb.plan.sizes import ValueInfo
from piper_nb.plan.streams import StreamProgram
from piper_nb.schedules.torch_csv import plan_to_torch_csv

__all__ = ["Instr", "DevicePlan", "StampedDevicePlan", "Plan"]


@dataclass(frozen=True)
class DevicePlan:
    device: int
    instrs: tuple[Instr, ...]
    # (template's instrs, stamper) on a `StampedDevicePlan`: the lowering stamped this
    # device's instructions out of another replica's (equal but for replica, peers, tags)
    stamp: tuple | None = field(default=None, compare=False, repr=False)

    def text(self, waits: bool = False) -> list[str]:
        out = []
        for ins in self.instrs:
            if ins.kind == Op.WAIT:
                if waits:
                    out.append(wait_text(self.instrs[ins.data.target]))
            elif ins.kind != Op.FREE or waits:
                out.append(str(ins))
        return out

    def compute(self) -> list[Instr]:
        return [i for i in self.instrs if i.is_compute]

    def __str__(self) -> str:
        """`dev0: r0:F0 r0:SEND_F0>1 ...`: the instructions (no waits, no frees) in order."""
        return f"dev{self.device}: " + " ".join(self.text())


class StampedDevicePlan(DevicePlan):
    """A replica's DevicePlan whose instructions are stamped out of its template's on first
    use (`stamp = (template's instrs, stamper)`, the stamper a callable device ->
    instructions): a plan of 16,384 devices holds one list per class of replicas until a
    device's own list is asked for. Equal to a DevicePlan of the same device and list."""

    def __init__(self, device: int, template: tuple[Instr, ...], stamper):
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "stamp", (template, stamper))
        object.__setattr__(self, "_instrs", None)

    @property
    def instrs(self) -> tuple[Instr, ...]:
        made = self._instrs
        if made is None:
            made = self.stamp[1](self.device)
            object.__setattr__(self, "_instrs", made)
        return made

    def stamped(self) -> tuple[Instr, ...]:
        """The instructions, stamped afresh when not made yet, and not kept."""
        return self._instrs if self._instrs is not None else self.stamp[1](self.device)

    def __eq__(self, other) -> bool:
        if not isinstance(other, DevicePlan):
            return NotImplemented
        return (self.device, self.instrs) == (other.device, other.instrs)

    __hash__ = DevicePlan.__hash__


@dataclass(frozen=True)
class Plan:
    """Per-device instruction lists plus the tables the runtime and simulator share."""

    world: int
    devices: tuple[DevicePlan, ...]
    microbatches: int
    batch_size: int
    loss_scale: float
    regions: tuple[RegionInfo, ...] = ()
    buckets: tuple[Bucket, ...] = ()
    values: dict[str, ValueInfo] = field(default_factory=dict)    # by value name
    saved: dict[int, int] = field(default_factory=dict)   # region -> saved activation bytes
    # region -> (inputs, outputs) whose buffers autograd saves: held by the stash, counted
    # once with the value's buffer (not in `saved`)
    kept: dict[int, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    # region -> (output, input) pairs that are one buffer (an alias): counted once
    aliases: dict[int, tuple[tuple[str, str], ...]] = field(default_factory=dict)
    rows: dict[str, str] = field(default_factory=dict)    # value -> symbol of its routed rows
    saved_rows: dict = field(default_factory=dict)    # region -> {symbol: saved bytes per row}
    params: dict[str, tuple] = field(default_factory=dict)   # name -> (shape, dtype)
    frozen: tuple[str, ...] = ()    # parameters without requires_grad: never updated
    batch_names: tuple[str, ...] = ("inputs", "targets")   # the batch's tensors, in order
    samples: tuple = ()             # (name, per-sample shape, dtype) the plan is compiled for
    pieces: dict = field(default_factory=dict)  # expert piece -> (stacked param, lo, hi)
    clip_grad_norm: float | None = None   # max global gradient norm (`compiler.clip`)
    precision: str = "fp32"         # "bf16": bf16 weights, activations, grads; fp32 masters
    reduce_dtype: str | None = None  # dtype gradients are reduced in (None: the grads')
    loss_mean: str = "microbatch"   # "global": the loss over the whole batch (`compiler.global_loss`)
    # tensor parallelism (`piper_nb.tp.widen_plan`): the device groups, and
    # each sharded parameter's (dim, degree, blocks)
    tp_groups: tuple[tuple[int, ...], ...] = ()
    tp_params: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    dag: TrainingDAG | None = None      # the placed, ordered DAG it was lowered from
    program: Program | None = None      # the directives it was compiled from
    capture: Capture | None = None      # the captured model (absent in a plan read from JSON)
    spec: Spec | None = field(default=None, compare=False, repr=False)   # what a new shape
                                                                         # re-captures
    # the stream program to run instead of the one lowered from `devices` (None: lowered);
    # set only to run a hand-made program, such as a test's negative control
    stream_program: StreamProgram | None = field(default=None, compare=False, repr=False)

    def __getitem__(self, device: int) -> DevicePlan:
        return self.devices[device]

    def tp_rank(self, device: int) -> int:
        """`device`'s position in its tensor-parallel group (0 outside any)."""
        for g in self.tp_groups:
            if device in g:
                return g.index(device)
        return 0

    def __getstate__(self) -> dict:
        """Pickled without what is derived and cached (the lowered stream program)."""
        return {k: v for k, v in self.__dict__.items() if k != "_streams"}

    def streams(self) -> StreamProgram:
        """What a GPU runs: per device, each stream's operations, their communicators,
        events and the host's synchronisations (`plan.streams`). Made once per plan."""
        if self.stream_program is not None:
            return self.stream_program
        made = self.__dict__.get("_streams")
        if made is None:
            made = StreamProgram(self)
            object.__setattr__(self, "_streams", made)
        return made

    def stamps(self) -> dict[int, int]:
        """Device -> the device its instructions were stamped from by the lowering (same
        instructions but for replica, peers and tags), for devices where that still holds:
        the template's instruction tuple is the very one the stamp was made from."""
        templates = {id(dp.instrs): dp.device for dp in self.devices if dp.stamp is None}
        out = {}
        for dp in self.devices:
            if dp.stamp is not None:
                t = templates.get(id(dp.stamp[0]))
                if t is not None and self.devices[t].instrs is dp.stamp[0]:
                    out[dp.device] = t
        return out

    def replayed(self) -> list[bool]:
        """Per device: whether checks and the simulator must run it themselves. All but the
        devices stamped from a template (`stamps`) whose point-to-point peers are all
        replayed: a replayed device then only meets replayed ones, or, in a collective,
        members that do what their template, a member of the same group, does."""
        template = self.stamps()
        active = [d not in template for d in range(self.world)]
        if not template:
            return active
        todo = [d for d in range(self.world) if active[d]]
        while todo:
            for ins in self.devices[todo.pop()].instrs:
                if (ins.kind == Op.SEND or ins.kind == Op.RECV) and not active[ins.data.peer]:
                    active[ins.data.peer] = True
                    todo.append(ins.data.peer)
        return active

    def grid(self, waits: bool = False, compute_only: bool = False) -> str:
        """A text grid: one column per device, one row per step."""
        cols = []
        for dp in self.devices:
            rows = [str(i) for i in dp.instrs if i.is_compute] if compute_only else dp.text(waits)
            cols.append([f"dev{dp.device}", *rows])
        return columns_text(cols)

    def legend(self) -> str:
        """What the prefixes of the instructions stand for: `r0 = {PP=0}`, one line per
        bucket `b0 = 2 parameters of r0, r1 over devices 0,1 (ZeRO-0)`, and the regions
        run through torch.compile (`compiled (inductor): r0, r1`)."""
        compiled: dict[str, set[int]] = {}
        for n in self.dag.nodes if self.dag is not None else ():
            if n.attrs and n.attr("compiled"):
                compiled.setdefault(n.attr("compiled"), set()).add(n.region)
        lines = [f"compiled ({k}): " + ", ".join(f"r{r}" for r in sorted(v))
                 for k, v in sorted(compiled.items())]
        return "\n".join([region_legend(self.regions), *bucket_legend(self.buckets),
                          *lines]).strip()

    def text(self) -> str:
        """`plan.grid()` and, beneath it, `plan.legend()`: what `print(plan)` shows."""
        legend = self.legend()
        return self.grid() + ("\n\n" + legend if legend else "")

    def __str__(self) -> str:
        return self.text()

    def to_torch_csv(self, devices: tuple[int, ...] | list[int] | None = None) -> str:
        """The compute passes per device (or per one of `devices`) as PyTorch pipelining's
        schedule CSV (`0F1`, stage = PP index); see `piper_nb.schedules.torch_csv`."""
        return plan_to_torch_csv(self, devices)

    @property
    def reference_microbatches(self) -> int:
        """The `microbatches` with which `pn.reference_train` (one process) trains as this
        plan does. The step's loss is the mean of one mean per slice the loss region runs
        on: per microbatch, and per replica within it when the loss region is replicated,
        in batch order; so a PP x DP plan equals the reference with microbatches x replicas.
        Under `loss_mean="global"` the loss is the whole batch's whatever the slicing: 1."""
        if self.loss_mean == "global":
            return 1
        # devices sharing one sample's sequence (context parallelism) average their shares'
        # means, which is the sample's mean: one slice, not one per device
        per = next((r.context[0] for r in self.regions if r.has_loss and r.context), 1)
        return round(1 / self.loss_scale) // per

    def __repr__(self) -> str:
        n = sum(len(d.stamp[0]) if d.stamp and d.stamp[0] else len(d.instrs) for d in self.devices)
        return (f"Plan(world={self.world}, microbatches={self.microbatches}, "
                f"regions={len(self.regions)}, buckets={len(self.buckets)}, instructions={n})")

    def save(self, path, optimizer=None, **settings):
        """Write this plan, its captured model and its training settings as the directory
        `path`, which `pn.load_plan` reads and `python -m piper_nb launch` runs:
        `plan.save("plan/", optimizer, batch=batch, seed=0)` (`plan.files.save_plan`)."""
        from piper_nb.plan.files import save_plan
        return save_plan(self, path, optimizer, **settings)

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps({
            "world": self.world, "microbatches": self.microbatches,
            "batch_size": self.batch_size, "loss_scale": self.loss_scale,
            "regions": [{"index": r.index, "tags": dict(r.tags), "inputs": list(r.inputs),
                         "outputs": list(r.outputs), "params": list(r.params),
                         **({"context": [r.context[0], r.context[1], list(r.context[2])]}
                            if r.context else {})}
                        for r in self.regions],
            "buckets": [asdict(b) for b in self.buckets],
            "values": {k: {"shape": list(v.shape), "dtype": v.dtype,
                           "requires_grad": v.requires_grad} for k, v in self.values.items()},
            "saved": {str(k): v for k, v in self.saved.items()},
            "kept": {str(k): [list(i), list(o)] for k, (i, o) in self.kept.items()},
            "aliases": {str(k): [list(p) for p in v] for k, v in self.aliases.items()},
            "rows": self.rows,
            "saved_rows": {str(k): v for k, v in self.saved_rows.items()},
            "params": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.params.items()},
            "frozen": list(self.frozen),
            "batch_names": list(self.batch_names),
            "samples": [[k, list(shape), dtype] for k, shape, dtype in self.samples],
            "pieces": {k: list(v) for k, v in self.pieces.items()},
            **({"clip_grad_norm": self.clip_grad_norm} if self.clip_grad_norm is not None else {}),
            **({"precision": self.precision, "reduce_dtype": self.reduce_dtype}
               if self.precision != "fp32" else {}),
            **({"loss_mean": self.loss_mean} if self.loss_mean != "microbatch" else {}),
            **({"tp_groups": [list(g) for g in self.tp_groups],
                "tp_params": {k: list(v) for k, v in self.tp_params.items()}}
               if self.tp_groups else {}),
            "devices": [[i.to_json() for i in dp.instrs] for dp in self.devices],
        }, indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        obj = json.loads(text)
        regions = tuple(RegionInfo(index=r["index"], tags=freeze_tags(r["tags"]), modules=(),
                                   params=tuple(r["params"]), buffers=(), inputs=tuple(r["inputs"]),
                                   outputs=tuple(r["outputs"]),
                                   context=_context(r.get("context")))
                        for r in obj["regions"])
        buckets = tuple(Bucket(**{k: tuple(v) if isinstance(v, list) else v for k, v in b.items()})
                        for b in obj["buckets"])
        values = {k: ValueInfo(k, tuple(v["shape"]), v["dtype"], v["requires_grad"])
                  for k, v in obj["values"].items()}
        devices = tuple(DevicePlan(d, tuple(Instr.from_json(i) for i in instrs))
                        for d, instrs in enumerate(obj["devices"]))
        return cls(world=obj["world"], devices=devices, microbatches=obj["microbatches"],
                   batch_size=obj["batch_size"], loss_scale=obj["loss_scale"], regions=regions,
                   buckets=buckets, values=values,
                   saved={int(k): v for k, v in obj["saved"].items()},
                   kept={int(k): (tuple(i), tuple(o)) for k, (i, o) in obj.get("kept", {}).items()},
                   aliases={int(k): tuple(tuple(p) for p in v)
                            for k, v in obj.get("aliases", {}).items()},
                   rows=obj.get("rows", {}),
                   saved_rows={int(k): v for k, v in obj.get("saved_rows", {}).items()},
                   params={k: (tuple(v["shape"]), v["dtype"]) for k, v in obj["params"].items()},
                   frozen=tuple(obj.get("frozen", ())),
                   batch_names=tuple(obj.get("batch_names", ("inputs", "targets"))),
                   samples=tuple((k, tuple(shape), dtype)
                                 for k, shape, dtype in obj.get("samples", ())),
                   pieces={k: tuple(v) for k, v in obj.get("pieces", {}).items()},
                   clip_grad_norm=obj.get("clip_grad_norm"),
                   precision=obj.get("precision", "fp32"), reduce_dtype=obj.get("reduce_dtype"),
                   loss_mean=obj.get("loss_mean", "microbatch"),
                   tp_groups=tuple(tuple(g) for g in obj.get("tp_groups", ())),
                   tp_params={k: tuple(v) for k, v in obj.get("tp_params", {}).items()})


def columns_text(cols: list[list[str]], mark: dict[int, int] | None = None) -> str:
    """Text columns side by side (one per device, its title first); `mark` = {column: row}
    wraps those cells in `>x<` (where the dry run finds each device stuck)."""
    height = max(len(c) for c in cols)
    width = [max(len(x) for x in c) + 2 for c in cols]
    lines = []
    for r in range(height):
        cells = []
        for ci, c in enumerate(cols):
            cell = c[r] if r < len(c) else ""
            if mark and mark.get(ci) == r:
                cell = f">{cell}<"
            cells.append(cell.ljust(width[ci] + 2))
        lines.append("".join(cells).rstrip())
    return "\n".join(lines)


def _context(obj) -> tuple:
    """A region's `context` from its JSON form: (degree, load balance, the inputs cut)."""
    return () if not obj else (obj[0], obj[1], tuple(obj[2]))
