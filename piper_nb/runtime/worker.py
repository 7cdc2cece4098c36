"""The worker: executes one device's instruction list, once per training step.

The runtime knows nothing of ZeRO, 1F1B or DualPipe: it runs `plan.devices[rank].instrs`
in order. F runs a region's GraphModule on its inputs (`entries`) and stashes the autograd
state; B (or BI then BW) runs autograd from the stashed outputs with the received output
gradients (the loss's gradient is `plan.loss_scale`) and hands input gradients upstream;
U applies the optimizer to full parameters and to this device's bucket shards (these
compute passes live in `compute`). SEND, RECV
and collectives are issued asynchronously and completed by their WAIT (ALL_TO_ALL, the
token exchange around experts, lives in `exchange`); FREE drops buffers.
Every instruction is timed and memory is counted after each one (see `timing`, `stores`).
The idea is Piper's: the strategy lives in the plan, the runtime only executes it.
"""

from __future__ import annotations

import os

import torch

from piper_nb.capture.batch import Batch
from piper_nb.capture.float8 import check_training as check_float8
from piper_nb.cp import CP_RANK
from piper_nb.ir.kinds import P2P, PASSES, Held, Memory, Op
from piper_nb.ir.loss_outputs import COUNT, metric_name
from piper_nb.optim import check_optimizer
from piper_nb.plan.instr import parse_free
from piper_nb.plan.precision import PRECISIONS
from piper_nb.plan.streams import DeviceStreams, communicators
from piper_nb.runtime.buffers import Buffers
from piper_nb.runtime.bundle import Bundle, bind_params, direct_calls, to_device
from piper_nb.runtime.comm import Comm, Pending
from piper_nb.runtime.compiled import compiled_modules
from piper_nb.runtime.compute import ComputePasses
from piper_nb.runtime.emulation import EmulatedStreams
from piper_nb.runtime.exchange import TokenExchange
from piper_nb.runtime.layout import bucket_layouts, local_init
from piper_nb.runtime.rng import ForwardRng
from piper_nb.runtime.stores import ParamStore, ValueStore
from piper_nb.runtime.streams import CudaStreams, HostStreams
from piper_nb.runtime.syncbn import sync_batchnorms
from piper_nb.runtime.timing import Clock, Recorder
from piper_nb.runtime.transfers import Transfers
from piper_nb.runtime.update import Updater
from piper_nb.tp import TP_RANK

__all__ = ["Worker", "FAIL_ENV"]

# Fault injection: "<device>:<instruction text>[:exit]" makes that device raise (or exit)
# right before that instruction. It ships, rather than being patched in by tests, because
# the failures it rehearses happen in worker processes and engines the tests cannot patch,
# and so that a user can rehearse a failure on a real cluster (docs/cluster.md).
FAIL_ENV = "PIPER_NB_FAIL_AT"
_COMPUTE, _ISSUE, _WAIT, _FREE = range(4)    # how the step loop dispatches an instruction


class Worker(ComputePasses, Transfers):
    """Runs device `rank`'s instructions: the step loop, communication and memory
    accounting here, the compute passes (`run`) in `compute.ComputePasses`."""

    def __init__(self, rank: int, bundle: Bundle, comm: Comm, device: torch.device,
                 timeout: float = 300.0):
        plan = bundle.plan
        self.plan, self.rank, self.comm, self.device = plan, rank, comm, device
        self.timeout = timeout
        self.instrs = plan.devices[rank].instrs if rank < plan.world else ()
        regions = sorted({i.region for i in self.instrs if i.kind in PASSES})
        names = dict.fromkeys(p for r in regions for p in plan.regions[r].params)
        names.update(dict.fromkeys(p for i in self.instrs if i.kind == Op.U for p in i.data.params))
        self.layouts = bucket_layouts(plan)
        # a tensor-parallel member other than the first reports no loss (its copy is equal)
        self.tp_rank = plan.tp_rank(rank)
        self.init = local_init(bundle.init, plan, rank)
        self.store = ParamStore(list(names), self.init, self.layouts, rank, device,
                                frozenset(plan.frozen))
        self.modules = {}
        check_float8([bundle.modules[r] for r in regions], plan.tp_groups, device)
        for r in regions:
            mod = to_device(bundle.modules[r], device, region=f"{r} ({plan.regions[r].name})")
            rank_of = getattr(mod, TP_RANK, None)   # a vocabulary-parallel part's own range
            if isinstance(rank_of, torch.Tensor):
                rank_of.fill_(self.tp_rank)
            in_context = getattr(mod, CP_RANK, None)   # a context-parallel part's rank
            if isinstance(in_context, torch.Tensor):
                in_context.fill_(self._context_rank(r))
            bind_params(mod, self.store.params, bundle.aliases)
            self.modules[r] = mod   # each module in the mode the user left it (eval, train)
        self.buffers = Buffers(plan, self.modules, self.instrs)
        self.values = ValueStore()
        self.exchange = TokenExchange(plan, comm, self.values, rank, device)
        self.needs = {r: sorted({b for b in self.store.full
                                 if set(self.layouts[b].names) & set(plan.regions[r].params)})
                      for r in regions}  # ZeRO-3 buckets each region's passes must have gathered
        replicas = replica_groups(plan)
        # replicated regions with BatchNorm, over every region (every rank creates the same
        # groups, in the same order, or group creation hangs)
        synced = {r for r in replicas if any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                             for m in bundle.modules[r].modules())}
        comm.ensure_groups(communicators(plan),
                           counted=[i.data.group for dp in plan.devices for i in dp.instrs
                                    if i.is_counted_dispatch],
                           batchnorm=sorted({replicas[r] for r in synced}))
        bn_groups = getattr(comm, "bn_groups", None)   # None: a profiler's worker, no peers
        for r, mod in self.modules.items():   # BatchNorm over the whole microbatch
            if r in synced and bn_groups is not None:   # only this rank's regions
                sync_batchnorms(mod, lambda r=r: bn_groups[replicas[r]])
            self.modules[r] = direct_calls(mod)
        self.modules = compiled_modules(plan, self.instrs, self.modules)   # compile_regions
        program = plan.streams()[rank] if rank < plan.world else DeviceStreams(rank, ())
        if not program.instrs:   # a program shipped on its own names no instructions
            program = DeviceStreams(rank, program.launches, self.instrs)
        self.streams = make_streams(comm, program, timeout)
        # decoded once, not on every step: how each instruction dispatches, what every
        # RECV allocates, and what every FREE drops
        self.dispatch = [_COMPUTE if i.is_compute else _ISSUE if i.is_issue else
                         _WAIT if i.kind == Op.WAIT else _FREE if i.kind == Op.FREE else -1
                         for i in self.instrs]
        self.recv_specs = {k: [(tuple(plan.values[v].shape), getattr(torch, plan.values[v].dtype))
                               for v in i.data.values]
                           for k, i in enumerate(self.instrs) if i.kind == Op.RECV}
        self.frees = {k: [parse_free(key) for key in i.data.keys]
                      for k, i in enumerate(self.instrs) if i.kind == Op.FREE}
        self.updater: Updater | None = None
        self.rng, self.seed, self.tracing = ForwardRng(plan, self.device), 0, True
        self.step_no, self.current = 0, -1
        self.compiled_s = 0.0   # seconds the compiled regions' first calls took so far

    # ---- driver commands ---------------------------------------------------------------
    def reset(self, optimizer, seed: int = 0) -> None:
        """Parameters and buffers back to the model's, a fresh optimizer (an `OptimizerSpec`,
        or a factory) without state, step 0; `seed` seeds the random operations (dropout) of
        every forward (see `runtime.rng`)."""
        self.store.reset(self.init)
        self.buffers.reset()
        self.values.clear()
        self.updater = Updater(check_optimizer(optimizer, "worker"), self.store, self.plan,
                               self.instrs)
        self.step_no, self.seed = 0, seed

    def text(self, idx: int) -> str:
        ins = self.instrs[idx]
        return f"wait({self.instrs[ins.data.target]})" if ins.kind == Op.WAIT else str(ins)

    def step(self, batch, fail_at: str | None = None, trace: bool = True,
             record_streams: bool = False) -> dict:
        """Run the plan once on `batch` (inputs, targets); times relative to the step start.

        With `trace=False` the step is timed but memory is not counted (no per-instruction
        accounting, no saved-tensor hooks): what `pn.train` does on all but the last step.
        `record_streams` returns what each stream executed (`out["streams"]`)."""
        tracker = getattr(self.streams, "tracker", None)   # emulated CUDA: host tensors
        if tracker is None:
            return self._step(batch, fail_at, trace, record_streams)
        with tracker:
            return self._step(batch, fail_at, trace, record_streams)

    def _step(self, batch, fail_at, trace: bool, record_streams: bool) -> dict:
        self.step_no += 1
        self.tracing = trace
        self.streams.begin_step(record_streams)
        self.begin(batch)
        fail = _parse_fail(fail_at, self.rank)
        self.comm.barrier()
        if trace and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.clock = Clock(self.device)
        self.clock.start()
        rec = self.rec = Recorder(self.rank, self.clock)
        mark = self.clock.mark
        for idx, (ins, how) in enumerate(zip(self.instrs, self.dispatch, strict=True)):
            self.current = idx
            if fail is not None and self.text(idx) == fail[0]:
                if fail[1] == "exit":
                    os._exit(17)
                raise RuntimeError(f"injected failure ({FAIL_ENV}={fail_at})")
            if how == _COMPUTE:
                start = mark()
                self.streams.launch(idx, run=lambda ins=ins: self.run(ins))
                rec.event(ins, start, mark())
            elif how == _ISSUE:
                self._issue(idx, ins)
            elif how == _WAIT:
                self._wait(ins)
            elif how == _FREE:
                self._free(idx)
            else:
                raise RuntimeError(f"unknown instruction kind {ins.kind!r}")
            if trace:
                rec.memory(self.clock.mark(), *self.memory())
        self.current = -1
        self.streams.end_step()
        loss = self._step_loss()
        end = self.clock.mark()
        leftover = self._leftover()
        events, memory = rec.resolve()
        compiled, self.compiled_s = self.compiled_s, sum(   # compile_regions' first calls
            getattr(m, "seconds", 0.0) for m in self.modules.values())
        out = {"loss": loss, "end": self.clock.resolve(end), "events": events,
               "memory": memory, "leftover": leftover, "lr": self.updater.lr(),
               "grad_norm": self.updater.norm, "count": self.updater.count,
               "metrics": self._metrics(), "compile_s": self.compiled_s - compiled}
        self.updater.end_step()
        if record_streams:
            out["streams"] = {k: list(v) for k, v in self.streams.log.items()}
        if trace and self.exchange.counts:  # token rows per group member, "value@mb" -> rows
            out["tokens"] = {f"{v}@{mb}": list(c) for (v, mb), c in self.exchange.counts.items()}
        if trace and self.device.type == "cuda":   # what the allocator really held at its peak
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
        return out

    def bench(self, batch, step: int = 1) -> None:
        """Set up a step without running it (a profiler then times single instructions with
        `run` and the bookkeeping with `clock`, `rec` and `memory`)."""
        self.step_no = step
        self.begin(batch)
        self.clock = Clock(self.device)
        self.clock.start()
        self.rec = Recorder(self.rank, self.clock)

    def begin(self, batch) -> None:
        """The per-step state, empty, for a step on `batch`: the `Batch` `cluster.step`
        ships, or its tensors in the order of `plan.batch_names` ((inputs, targets) for a
        pair)."""
        low = PRECISIONS[self.plan.precision]   # bf16 plans: floating inputs in bf16
        batch = Batch.ordered(self.plan.batch_names, batch, "worker")
        self.batch = {name: t.to(self.device, low) if t.is_floating_point() else t.to(self.device)
                      for name, t in batch.items()}
        self.parts: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        self.pending: dict[int, Pending] = {}
        self.exchange.reset()
        self.rng.new_step()
        self.losses: list[torch.Tensor] = []   # each forward's detached loss, summed at the end
        self.ends: dict[str, list[torch.Tensor]] = {}   # count and metrics, per forward

    def _context_rank(self, region: int) -> int:
        """This device's rank in the context group that runs `region` (its place among the
        forward's devices)."""
        first = next(i for i in self.instrs if i.kind == Op.F and i.region == region)
        return first.replica % self.plan.regions[region].context[0]

    def count_share(self) -> torch.Tensor:
        """What this device's loss forwards counted this step (float64), for `count:AR`."""
        counts = self.ends.get(COUNT, []) if not self.tp_rank else []
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        return total + torch.stack([c.reshape(()) for c in counts]).double().sum() \
            if counts else total

    def _metrics(self) -> dict[str, tuple[float, int]]:
        """Metric name -> (sum over this device's loss forwards, how many): the driver
        averages over every microbatch and replica."""
        return {metric_name(k): (float(torch.stack([t.reshape(()) for t in v]).double().sum()),
                                 len(v)) for k, v in self.ends.items()
                if metric_name(k) and not self.tp_rank}

    def _step_loss(self) -> float:
        """This device's share of the step's loss: every microbatch's loss times the plan's
        loss scale, summed in float64 (one reduction per step, not one per forward)."""
        if not self.losses or self.tp_rank:
            return 0.0
        total = torch.stack([t.reshape(()) for t in self.losses]).double().sum()
        return float(total) * self.plan.loss_scale

    def memory(self) -> tuple[int, int, int, int, int]:
        """(params, grads, optim, activations, buffers) bytes held right now."""
        params, grads, optim = self.store.bytes()
        acts, bufs = self.values.bytes(), self.store.pending_bytes()
        for p in self.pending.values():
            if p.memory == Memory.PARAMS:
                params += p.bytes
            elif p.memory == Memory.ACTIVATIONS:
                acts += p.bytes
            else:
                bufs += p.bytes
        return params, grads, optim, acts, bufs

    def export_state(self) -> dict:
        """Parameters held (full, or ZeRO-3 shards) and the buffers this device trains."""
        return {**self.store.export(), "buffers": self.buffers.export(owned=True)}

    def train_state(self) -> dict:
        """Everything a step boundary holds, for a checkpoint: parameters (full, or ZeRO-3
        shards), buffers, optimizer state and the step count; CPU copies."""
        return {"step": self.step_no, **self.store.export_train_state(),
                "buffers": self.buffers.export(owned=False), "update": self.updater.state_dict()}

    def load_train_state(self, state: dict) -> None:
        """Continue from `train_state()`'s output (after `reset`)."""
        self.store.load_train_state(state)
        self.buffers.load(state.get("buffers", {}))
        if "update" in state:   # a rank beyond the plan's world holds nothing
            self.updater.load_state_dict(state["update"])
        self.step_no = state["step"]

    # ---- communication -----------------------------------------------------------------
    def _issue(self, idx: int, ins) -> None:
        """Make the instruction's transfer and launch it where the stream program says."""
        start = self.clock.mark()
        made: dict = {}

        def transfer():
            t, made["memory"], made["new"], made["meta"] = self._transfer(ins, idx)
            t.index, t.text = idx, str(ins)
            made["t"] = t
            return t
        works = self.streams.launch(idx, transfer=transfer,
                                    exchange=lambda: self.exchange.count(ins))
        t = made["t"]
        span = getattr(self.streams, "span", None) if self.device.type == "cuda" else None
        p = Pending(idx, works, t.outputs, span[0] if span and span[0] else start,
                    memory=made["memory"], new=made["new"], meta=made["meta"],
                    end=span[1] if span else None)
        if ins.kind not in P2P:  # gloo p2p has no future and reports completion
            self.comm.watch(p, self.clock)         # only at wait(): its WAIT marks the end
        self.pending[idx] = p

    def _wait(self, ins) -> None:
        p = self.pending.pop(ins.data.target)
        src = self.instrs[ins.data.target]
        self.streams.launch(self.current)   # the waiting stream waits for the transfer
        results = self.comm.results(p)
        if self.comm.cuda:   # made on a communicator's stream, used on the compute stream
            for t in p.tensors:
                t.record_stream(torch.cuda.current_stream(self.device))
        if p.end is None:
            p.end = self.clock.mark()
        self.rec.event(src, p.start, p.end)
        if src.kind == Op.RECV:
            for v, t in zip(src.data.values, results, strict=True):
                if src.data.grad:
                    self.values.add_grad(v, src.mb, t)
                else:
                    self.values.acts[(v, src.mb)] = t
        elif src.is_norm:   # the gradient norm (clipping)
            self.updater.set_norm(results[0])
        elif src.is_count:   # the global-batch loss's count
            self.updater.set_count(results[0])
        elif src.sums_values:   # a tensor- or context-parallel sum: partials, gradients
            self._summed(src, results[0])
        elif src.kind == Op.ALL_REDUCE:
            self.store.set_grads(src.data.bucket, results[0])
        elif src.kind == Op.REDUCE_SCATTER:
            self.store.add_grad_shard(src.data.bucket, results[0])
        elif src.kind == Op.ALL_GATHER:
            if self.layouts[src.data.bucket].zero == 3:
                self.store.acquire(src.data.bucket, results[0])
            else:
                self.store.write_params(src.data.bucket, results[0])
        elif src.kind == Op.ALL_TO_ALL:
            self.exchange.finish(src, results[0], p.meta)

    def _free(self, idx: int) -> None:
        for kind, key in self.frees[idx]:
            if kind == Held.PARAM:
                self.store.free(key)
            else:
                self.values.drop(kind, key)

    def _leftover(self) -> list[str]:
        """Buffers still held at the step end (the plan never freed them); dropped now."""
        v = self.values
        out = [f"act:{k}@{m}" for k, m in v.acts] + [f"grad:{k}@{m}" for k, m in v.grads]
        out += [f"stash:{r}@{m}" for r, m in v.stash]
        out += [f"issue:{self.instrs[i]}" for i in self.pending]
        v.clear()
        self.pending.clear()
        for p in self.store.params.values():
            p.grad = None
        self.comm.recycle()
        return sorted(out)


def replica_groups(plan) -> dict[int, tuple[int, ...]]:
    """Region -> its replica group, for regions whose forwards run on several replicas
    (the devices running its first microbatch's forward, in replica order)."""
    found: dict[int, dict[int, int]] = {}
    for dp in plan.devices:
        for ins in dp.instrs:
            if ins.kind == Op.F and ins.replicas > 1 and ins.mb <= 0:
                found.setdefault(ins.region, {})[ins.replica] = dp.device
    return {r: tuple(devs[k] for k in sorted(devs)) for r, devs in found.items()}


def _parse_fail(spec: str | None, rank: int) -> tuple[str, str] | None:
    if not spec:
        return None
    dev, _, rest = spec.partition(":")
    text, mode = (rest[:-5], "exit") if rest.endswith(":exit") else (rest, "")
    if dev.strip() != str(rank):
        return None
    return text, mode


def make_streams(comm, program: DeviceStreams, timeout: float):
    """The executor of `program` for this worker's communication (see `runtime.streams`):
    NCCL emulated on CPU, CUDA streams, or the host's gloo."""
    if getattr(comm, "emulated", False):
        return EmulatedStreams(comm, program, timeout * 0.8)   # its report beats the cluster's
    if getattr(comm, "cuda", False):
        return CudaStreams(comm, program, timeout)
    return HostStreams(comm, program, timeout)
