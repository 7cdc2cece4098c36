"""The GPU check (`make gpu-check`): what one GPU can prove about piper_nb, each probe in its
own process under a timeout, one table at the end, under 6 minutes on one H200.

    .venv/bin/python benchmarks/gpu_check.py              # on a machine with CUDA
    .venv/bin/python benchmarks/gpu_check.py --dry-run    # anywhere (the default without CUDA)
    .venv/bin/python benchmarks/gpu_check.py --probe NAME # one probe; prints one result line
    PYTHONPATH=. python3 benchmarks/gpu_check.py          # the machine's own torch, no .venv

The last, from the repository root, is for a GPU host where no .venv can be made (no
package registry): the machine's python3 with its own torch (with CUDA) and numpy, and
cloudpickle; transformers for the hf-llama row only. The probes' processes and the
cluster's workers inherit PYTHONPATH. A torch older than the declared `torch>=2.13` runs
untested by CI (docs/cluster.md, "Running on the GPU machine's own torch").

The probes, and what each proves on real hardware:

- nccl-collectives: all_reduce, reduce_scatter, all_gather and all_to_all on a one-member
  NCCL group, each made by the runtime's `Comm` and launched by its `CudaStreams` from a
  hand-written stream program. The input is made on the compute stream behind a sleep
  kernel (`torch.cuda._sleep`); the op is issued from a second stream that sleeps on after
  the input is ready, so NCCL reads the input late; right after the issue the host drops
  its references and allocates and overwrites same-size tensors on the compute stream,
  which runs those writes a whole sleep before NCCL reads. Exact results prove that NCCL's
  stream waited for the stream the op was issued from, and that no buffer of an op in
  flight was handed to another tensor. Run twice: with the transfer's buffers referenced
  until the WAIT, as `Worker._issue` keeps them (`Pending`), and with only the output kept,
  where nothing but `Comm`, `CudaStreams` and ProcessGroupNCCL (which holds an async op's
  tensors until a `wait()` on it) can keep the input's memory from a new tensor. The row
  passes when both are exact.
- stream-coupling: two one-member communicators on one rank, A and B. A's input is held
  behind a long sleep on the stream A is issued from; B is issued after it from the
  compute stream. B's work completes (`is_completed`, a query of its CUDA event) while A's
  is still held: the runtime's streams do not serialise communicators.
- stream-coupling-old: the contrast, the same two ops under the old coupling (one shared
  stream that waits for each op right after issuing it, as the runtime did before the
  stream program, `tests/conftest.py::coupled_program`): B completes only after A.
- cpu-tensor: a CUDA worker (`Worker` on rank 0 of a PP2 plan) handed a CPU tensor for a
  SEND refuses it with its own error naming the instruction (`transfers._sent`), before
  NCCL sees it; the same SEND from the device is made ready. NCCL's own reaction to a CPU
  tensor is shown beside it.
- tinygpt-fp32, tinygpt-bf16, tinygpt-float8, hf-llama: one rank on NCCL (`LocalCluster(1,
  device="cuda")`) trains TinyGPT in fp32, in bf16 (fp32 masters) and in bf16 with Float8
  linears (`pn.float8`; the CPU runs the same Float8 linears), and a Hugging Face
  `LlamaForCausalLM` captured by `torch.export`, against the CPU reference
  (`pn.reference_train`): fp32 at rtol/atol 1e-4, bf16 at the project's bf16 tolerance
  (tests/runtime/test_precision.py).
- matmul-bf16: a large bf16 matmul timed with CUDA events, against the FLOP/s the analytic
  model assumes for an H200 (peak x matmul_efficiency).
- matmul-fp32, hbm-stream, matmul-fp8: a 4096^3 fp32 matmul (TF32 off), a streaming add
  and a 8192^3 Float8 scaled matmul (`pn.float8`'s), against the fractions of the fp32
  and FP8 peaks and of HBM bandwidth the analytic model assumes
  (`HardwareSpec.matmul_efficiency`, `hbm_efficiency`) and no run has measured yet.
- gpt-mid step, gpt-mid memory: a mid-size GPT trained on one rank; its measured step
  against `CostModel.analytic(plan, "H200")`, and `torch.cuda.max_memory_allocated`
  against the memory model's peak under `MemorySettings.for_cuda(nccl=False)`: NCCL
  allocates its buffers outside PyTorch's allocator, so they are left out of both sides.
- llama-0.5b vs torch, llama-0.5b step, llama-0.5b memory: a bf16 Llama-shaped model of
  0.51 B parameters (`pn.models.Llama`, 28 layers of width 1024, 8 x 1024 tokens in two
  microbatches, AdamW) trained on one rank; its step against a plain PyTorch loop on the
  same model and batch in the probe's process (bf16 autocast, gradient accumulation, the
  same AdamW), then against the analytic model and its memory against the memory model,
  as for gpt-mid. Step 1 of each is a warm-up, left out of the medians.

Every figure is printed as a ratio (measured / predicted, piper_nb / plain PyTorch).

What one GPU cannot show (NOTE): NCCL refuses two ranks on one GPU, so the multi-rank
plans (nccl-pp2, nccl-dualpipev, nccl-pp2-dp2-zero3, nccl-pp2-dp2-ep2) are rows checked
statically and under the CPU emulation; with 2 or 4 GPUs they train on real NCCL against
the reference. Every plan is compiled, and so checked (`check_plan` ends with the NCCL
check of its stream program), in the dry run too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import piper_nb as pn
from piper_nb.cluster.local import LocalCluster
from piper_nb.compiler.nccl import check_nccl
from piper_nb.ir.kinds import Op
from piper_nb.plan.streams import COMPUTE_STREAM, DeviceStreams, Launch, Step, comm_stream
from piper_nb.runtime.comm import Comm
from piper_nb.runtime.streams import CudaStreams
from piper_nb.sim import HARDWARE

MARK = "gpu-check-result: "     # a probe's result line: MARK + JSON list of rows
BUDGET_S = 540.0                # the whole run, probes and all: under 9 minutes
PROBE_TIMEOUT_S = 120.0
LLAMA_TIMEOUT_S = 180.0         # its 0.5 B model: built, compiled and sent to the worker on CPU
COMPILED_TIMEOUT_S = 300.0      # the same, and inductor compiling its 28 layers, twice
STEPS = 3
TOL = {"fp32": {"loss": (1e-4, 1e-4), "weights": (1e-4, 1e-4)},
       # torch.testing's bf16 rtol; atol 1e-3 for weights near zero under SGD (test_precision)
       "bf16": {"loss": (1.6e-2, 0.0), "weights": (1.6e-2, 1e-3)}}
SGD = pn.optim.SGD(0.05, momentum=0.9)
ADAMW = pn.optim.AdamW(1e-4)
N = 1 << 20                     # elements of each collective's buffer (4 MiB)
A, B = "group:0", "group:0#b"   # two communicators of the one rank (see TwoCommunicators)
MID = {"vocab": 8192, "dim": 1024, "layers": 8, "heads": 16, "seq": 1024}
MID_SIZE = {"batch": 8, "microbatches": 4, "stages": 2}
# Llama-shaped, 0.51 B parameters: 28 layers of 15.7 M (GQA, 8 key/value heads; SwiGLU 4096)
# and a 32 K vocabulary; a step is about 50 ms on an H200 (the analytic model's figure)
LLAMA = {"vocab": 32768, "dim": 1024, "layers": 28, "heads": 16, "kv_heads": 8,
         "hidden": 4096, "seq": 1024}
LLAMA_SIZE = {"batch": 8, "microbatches": 2, "stages": 1}
LLAMA_STEPS = 6                 # step 1 warms up, 2-5 are timed, 6 is traced (its memory)
GiB = 2**30
NOTE = (
    "What one GPU cannot show: NCCL refuses two ranks on one GPU (\"Duplicate GPU "
    "detected\"), so the multi-rank NCCL plans (PP, DualPipeV, PP x DP ZeRO-3, EP) are "
    "checked here only statically (compiler.nccl.check_nccl replays their stream programs "
    "under NCCL's rules) and, by make test, under the CPU emulation of NCCL "
    "(LocalCluster(comm=\"nccl-emulated\"), tests/runtime/test_emulation.py). Point-to-point "
    "NCCL between GPUs, communication overlapping compute across devices and link bandwidth "
    "against the cost model need two GPUs or more: with torch.cuda.device_count() >= 2 (PP, "
    "DualPipeV) or >= 4 (ZeRO-3, EP) this check trains those plans on real NCCL against the "
    "CPU reference.")

Row = tuple[str, str, str]


@dataclass(frozen=True)
class Probe:
    name: str
    rows: tuple[tuple[str, str], ...]     # (row, what the probe does for it): the dry run
    run: Callable[[], list[Row]]          # in a process of its own, on the GPU
    plans: Callable[[], list] = list      # what it trains (compiled, so checked) or launches
    gpus: int = 1
    timeout: float = PROBE_TIMEOUT_S      # its process's limit, within what is left of BUDGET_S


# ---- plans -------------------------------------------------------------------------------
def one_rank(microbatches: int = 4) -> list:
    return [pn.place({}, [0]), pn.split({}, "MB", microbatches)]


def tiny_gpt(precision: str = "fp32", float8: bool = False):
    """(the one process to compare with, batch, plan); `float8`: every linear in Float8
    (`pn.float8`), and the one process runs the same Float8 linears."""
    from piper_nb.capture.float8 import Float8Linear
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=False)
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    program = [*one_rank(), *([pn.float8({"PP": "*"})] if float8 else [])]
    plan = pn.compile(spec, program, batch, precision=precision)
    return (Float8Linear.swap(model) if float8 else model), batch, plan


def hf_llama():
    """LlamaForCausalLM from a tiny config (token ids inside the vocabulary), captured by
    torch.export; the loss is the model's own."""
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(0))
    batch = (ids, torch.roll(ids, -1, dims=1))
    ann = {"model.embed_tokens": {"PP": 0}, "model.layers.0": {"PP": 0},
           "model.layers.1": {"PP": 1}, "model.norm": {"PP": 1}, "lm_head": {"PP": 1}}
    return model, batch, pn.compile(pn.annotate(model, ann), one_rank(), batch, capture="export")


def sized(kind, config: dict, size: dict, device: str, precision: str = "fp32",
          compiled: bool = False):
    """(model, batch, plan): `kind(**config)` built on `device`, cut into `size["stages"]`
    stages on one rank, `size["batch"]` sequences in `size["microbatches"]`. On the meta
    device (the dry run) it compiles in a second or two instead of a CPU forward: the same
    instructions and stream program (so the same checks), but attention's saved tensors are
    counted by its math path there, so its memory figure is above the plan the GPU run
    compiles on CPU. `compiled`: every region through torch.compile (`pn.compile_regions`)."""
    with torch.device(device):
        model = kind(**config)
    if device == "meta":
        ids = torch.zeros(size["batch"], config["seq"], dtype=torch.long, device="meta")
        batch = (ids, ids)
    else:
        batch = model.example_batch(batch_size=size["batch"], seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, size["stages"]))
    program = [*one_rank(size["microbatches"]), *([pn.compile_regions({})] if compiled else [])]
    return model, batch, pn.compile(spec, program, batch, precision=precision)


def mid_gpt(device: str = "cpu"):
    """The mid-size GPT: fp32, 8 x 1024 tokens, 4 microbatches, 2 stages on one rank."""
    return sized(pn.models.TinyGPT, {**MID, "tie_embeddings": False}, MID_SIZE, device)


def llama(device: str = "cpu"):
    """The Llama-shaped model of about 0.5 B parameters (`pn.models.Llama`): bf16 (fp32
    masters), 8 x 1024 tokens, 2 microbatches, one stage on one rank."""
    return sized(pn.models.Llama, LLAMA, LLAMA_SIZE, device, "bf16")


def llama_compiled(device: str = "cpu"):
    """The same Llama with its region through torch.compile (inductor)."""
    return sized(pn.models.Llama, LLAMA, LLAMA_SIZE, device, "bf16", compiled=True)


def predicted(plan) -> tuple[float, int]:
    """(step s, peak bytes of device 0): the analytic H200 model and the memory model
    without NCCL's buffers (as torch.cuda.max_memory_allocated sees the device)."""
    sim = pn.simulate(plan, pn.CostModel.analytic(plan, "H200"),
                      memory=pn.MemorySettings.for_cuda(nccl=False, optimizer=ADAMW))
    return sim.step_time, sim.peak_memory[0]


def gpt_for(stages: int):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=False)
    batch = model.example_batch(batch_size=8, seed=0)
    return model, batch, pn.annotate(model, pn.cut_stages(model, stages))


def multi_rank(name: str):
    """(model, batch, plan) of a multi-rank NCCL case."""
    S = pn.schedules
    if name == "nccl-pp2":
        model, batch, spec = gpt_for(2)
        return model, batch, pn.compile(spec, S.one_f_one_b(2, 4, place=True), batch)
    if name == "nccl-dualpipev":
        model, batch, spec = gpt_for(4)
        return model, batch, pn.compile(spec, S.dualpipev(2, 4, place=True), batch)
    pp = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3])]
    if name == "nccl-pp2-dp2-zero3":
        model, batch, spec = gpt_for(2)
        program = [*pp, pn.replicate({"PP": 0}, [0, 2], zero=3),
                   pn.replicate({"PP": 1}, [1, 3], zero=3), *S.one_f_one_b(2, 4)]
        return model, batch, pn.compile(spec, program, batch)
    from piper_nb.strategies import moe_annotation
    model = pn.models.TinyMoE(vocab=64, dim=32, layers=2, experts=2, top_k=1, heads=2, seq=16)
    batch = model.example_batch(batch_size=8, seed=0)
    program = [*pp, pn.replicate({"PP": 0}, [0, 2]), pn.replicate({"PP": 1}, [1, 3]),
               pn.shard({"PP": 0, "EP": "*"}, [0, 2]), pn.shard({"PP": 1, "EP": "*"}, [1, 3]),
               *S.one_f_one_b(2, 4)]
    return model, batch, pn.compile(pn.annotate(model, moe_annotation(2, 2, 2)), program, batch)


# ---- NCCL on a world of one ----------------------------------------------------------------
def world_of_one() -> torch.device:
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=dev)
    return dev


_CYCLES: list[float] = []


def sleep_cycles(seconds: float) -> int:
    """`torch.cuda._sleep` cycles that take about `seconds` on this GPU (timed once)."""
    if not _CYCLES:
        torch.cuda._sleep(1000)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        _CYCLES.append(20_000_000 / (start.elapsed_time(end) / 1e3))
    return max(1, int(_CYCLES[0] * seconds))


def program(*launches: tuple) -> DeviceStreams:
    """A hand-written stream program for rank 0: (step, stream, instruction, event, comm)."""
    return DeviceStreams(0, tuple(Launch(*x) for x in launches))


class TwoCommunicators(Comm):
    """Rank 0's `Comm` with two one-member communicators, A and B: two process groups of
    the same rank, so two NCCL communicators, each with its own stream. (`Comm` keys its
    groups by their ranks; two on the same ranks need names of their own.)"""

    def __init__(self, device: torch.device):
        super().__init__(0, device, "nccl")
        self.named = {A: dist.new_group([0]), B: dist.new_group([0])}
        if self.named[A] is self.named[B]:
            raise RuntimeError("dist.new_group([0]) twice gave one group: no second communicator")
        for g in self.named.values():   # connected on first use: warm both up now
            dist.all_reduce(torch.zeros(1, device=device), group=g)
        torch.cuda.synchronize(device)

    def group_of(self, comm: str):
        return self.named[comm]


# ---- probe: collectives, inputs behind a sleep, memory reused right after issue -------------
KINDS = {"all_reduce": lambda c, x: c.all_reduce(x, A),
         "reduce_scatter": lambda c, x: c.reduce_scatter(x, 1, A),
         "all_gather": lambda c, x: c.all_gather(x, 1, A),
         "all_to_all": lambda c, x: c.all_to_all(x, [x.numel()], [x.numel()], A)}


def collective_program() -> DeviceStreams:
    """0: the input, on compute behind a sleep; 1: the gate stream waits for it and sleeps
    on; 2: the op, issued from the gate (NCCL's stream waits for it); 3: compute waits."""
    c, g, n = COMPUTE_STREAM, "gate", comm_stream(A)
    return program((Step.RUN, c, 0), (Step.RECORD, c, 0, "e0"),
                   (Step.WAIT, g, 1, "e0"), (Step.RUN, g, 1),
                   (Step.RECORD, g, 2, "i2"), (Step.WAIT, n, 2, "i2"),
                   (Step.COMM, n, 2, "", A), (Step.RECORD, n, 2, "d2"), (Step.WAIT, c, 3, "d2"))


def one_collective(streams: CudaStreams, kind: str, cycles: tuple[int, int], keep: bool):
    """(exact, held at issue, junk tensors given the input's address). `keep`: the
    transfer's buffers stay referenced until the WAIT (as the worker's Pending keeps them);
    else the host keeps only the output."""
    comm, dev = streams.comm, streams.device
    torch.cuda.empty_cache()   # no spare blocks: a freed input is the first fit for a new tensor
    streams.begin_step()
    made: dict = {}

    def make_input():
        torch.cuda._sleep(cycles[0])
        made["x"] = torch.arange(N, device=dev, dtype=torch.float32).mul_(3).add_(1)
    streams.launch(0, run=make_input)
    streams.launch(1, run=lambda: torch.cuda._sleep(cycles[1]))
    works = streams.launch(2, transfer=lambda: made.setdefault("t", KINDS[kind](comm, made.pop("x"))))
    t = made.pop("t")
    out, where = t.bufs[0], t.bufs[-1].data_ptr()
    kept = list(t.bufs) if keep else [out]
    del t
    held = not any(w.is_completed() for w in works)
    junk = [torch.full((N,), -7.0, device=dev) for _ in range(4)]   # on compute: runs now
    reused = sum(j.data_ptr() == where for j in junk)
    streams.launch(3)
    streams.end_step()
    want = torch.arange(N, device=dev, dtype=torch.float32).mul_(3).add_(1)
    exact = torch.equal(out, want)
    del kept, junk
    return exact, held, reused


def probe_collectives() -> list[Row]:
    dev = world_of_one()
    comm = Comm(0, dev, "nccl")
    comm.ensure_groups([A])                     # the runtime's own group creation
    streams = CudaStreams(comm, collective_program(), timeout=60.0)   # one set of streams
    cycles = (sleep_cycles(0.05), sleep_cycles(0.25))
    for kind in KINDS:                          # warm-up: every kernel loaded once
        one_collective(streams, kind, (1, 1), True)
    parts, ok = [], True
    for kind in KINDS:
        kept = one_collective(streams, kind, cycles, True)
        dropped = one_collective(streams, kind, cycles, False)
        good = kept[0] and kept[1] and dropped[0] and dropped[1]
        ok &= good
        parts.append(f"{kind} {'exact' if kept[0] else 'WRONG'} buffers kept / "
                     f"{'exact' if dropped[0] else 'WRONG'} only output kept"
                     f"{'' if kept[1] and dropped[1] else ' (NOT held at issue)'}, "
                     f"input address handed out again {dropped[2]}x")
    why = "" if ok else (" -- WRONG with only the output kept: an input's memory went to a new "
                         "tensor before NCCL read it (ProcessGroupNCCL holds an async op's "
                         "tensors until a wait(): something waited for the work before the "
                         "plan's WAIT)")
    return [("nccl-collectives", "pass" if ok else "FAIL",
             "1-member NCCL group via Comm + CudaStreams, input made behind a 50 ms sleep, "
             "issued from a stream held 250 ms more, same-size tensors allocated and "
             "overwritten right after issue: " + "; ".join(parts) + why)]


# ---- probe: two communicators and a held stream -----------------------------------------------
def coupling_program(old: bool) -> DeviceStreams:
    """0: A's input on `held`, behind a sleep; 1: A issued from `held`; 2: B issued from
    compute; 3, 4: compute waits for B, then A. `old`: every op goes through one shared
    stream that waits for its input, issues it and waits for it (the old coupling)."""
    h, c, s = "held", COMPUTE_STREAM, "shared"

    def issue(k: int, src: str, comm: str) -> list[tuple]:
        n = comm_stream(comm)
        if old:
            return [(Step.RECORD, src, k, f"c{k}"), (Step.WAIT, s, k, f"c{k}"),
                    (Step.RECORD, s, k, f"i{k}"), (Step.WAIT, n, k, f"i{k}"),
                    (Step.COMM, n, k, "", comm), (Step.RECORD, n, k, f"d{k}"),
                    (Step.WAIT, s, k, f"d{k}")]
        return [(Step.RECORD, src, k, f"i{k}"), (Step.WAIT, n, k, f"i{k}"),
                (Step.COMM, n, k, "", comm), (Step.RECORD, n, k, f"d{k}")]
    return program((Step.RUN, h, 0), *issue(1, h, A), *issue(2, c, B),
                   (Step.WAIT, c, 3, "d2"), (Step.WAIT, c, 4, "d1"))


def first_complete(works: dict[str, list], t0: float, limit: float) -> dict[str, float]:
    """Name -> seconds after t0 at which all its works were first seen complete."""
    seen: dict[str, float] = {}
    while len(seen) < len(works) and time.perf_counter() - t0 < limit:
        now = time.perf_counter() - t0
        for name, ws in works.items():
            if name not in seen and all(w.is_completed() for w in ws):
                seen[name] = now
        time.sleep(2e-4)
    return seen


def race(streams: CudaStreams, cycles: int, limit: float) -> dict:
    """Run the coupling program once: when A and B were first seen complete, from B's
    issue, and whether both results are exact."""
    comm, dev = streams.comm, streams.device
    streams.begin_step()
    bufs: dict = {}

    def held_input():
        torch.cuda._sleep(cycles)
        bufs["a"] = torch.full((N,), 1.0, device=dev)
    streams.launch(0, run=held_input)
    wa = streams.launch(1, transfer=lambda: comm.all_reduce(bufs["a"], A))
    bufs["b"] = torch.full((N,), 2.0, device=dev)
    t0 = time.perf_counter()
    wb = streams.launch(2, transfer=lambda: comm.all_reduce(bufs["b"], B))
    seen = first_complete({"A": wa, "B": wb}, t0, limit)
    streams.launch(3)
    streams.launch(4)
    streams.end_step()
    seen["exact"] = bool((bufs["a"] == 1).all()) and bool((bufs["b"] == 2).all())
    return seen


def probe_coupling(old: bool) -> list[Row]:
    streams = CudaStreams(TwoCommunicators(world_of_one()), coupling_program(old), 60.0)
    hold = 1.0
    race(streams, sleep_cycles(0.01), 10.0)     # warm-up: kernels loaded, streams made
    seen = race(streams, sleep_cycles(hold), 3 * hold + 5)
    a, b = seen.get("A"), seen.get("B")
    if a is None or b is None:
        return [(f"stream-coupling{'-old' if old else ''}", "FAIL",
                 f"not complete within {3 * hold + 5:.0f} s: A {a}, B {b}")]
    times = f"B done {b * 1e3:.1f} ms after its issue, A (held {hold:.1f} s) at {a * 1e3:.0f} ms"
    if old:
        ok = b >= a and a > 0.5 * hold and seen["exact"]
        return [("stream-coupling-old", "pass" if ok else "FAIL",
                 f"contrast, the old coupling (one shared stream that waits after each op): "
                 f"{times}: {'serialised, as predicted' if ok else 'NOT serialised'}")]
    ok = b < 0.25 * hold and a > 0.5 * hold and seen["exact"]
    verdict = "B completed while A was held, no coupling" if ok else \
        "NOT shown (pass: B done within a quarter of the hold, A after half of it)"
    return [("stream-coupling", "pass" if ok else "FAIL",
             f"A on {A} issued from a stream held behind a sleep, then B on {B} from compute: "
             f"{times}: {verdict}; "
             f"results {'exact' if seen['exact'] else 'WRONG'}")]


# ---- probe: a CPU tensor handed to a CUDA worker's SEND --------------------------------------
class Unwired(Comm):
    """A CUDA worker's `Comm` without peers or process groups: the probe stops before
    anything reaches NCCL."""

    def ensure_groups(self, comms=(), counted=(), batchnorm=()) -> None:
        pass


def nccl_on_cpu_tensor() -> str:
    """What NCCL (through torch.distributed) says to a CPU tensor: the contrast."""
    world_of_one()
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as err:   # whatever it raises is the finding
        return f"{type(err).__name__}: {short(err, 140)}"
    return "accepted it"


def probe_cpu_tensor() -> list[Row]:
    from piper_nb.runtime.bundle import load_bundle, make_bundle
    from piper_nb.runtime.worker import Worker
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    _, batch, plan = multi_rank("nccl-pp2")
    worker = Worker(0, load_bundle(make_bundle(plan)), Unwired(0, dev, "nccl"), dev)
    worker.reset(SGD)
    worker.bench(batch)
    k, ins = next((k, i) for k, i in enumerate(worker.instrs) if i.kind == Op.SEND)

    def hand(device) -> None:
        for v in ins.data.values:
            info = plan.values[v]
            worker.values.acts[(v, ins.mb)] = torch.zeros(
                info.shape, dtype=getattr(torch, info.dtype), device=device)
    hand("cpu")
    try:
        worker._issue(k, ins)
        refused = ""
    except RuntimeError as err:
        refused = str(err)
    hand(dev)
    made = worker._transfer(ins, k)[0]          # the same SEND from the device: ready
    ok = "not on the device" in refused and all(b.device == dev for b in made.bufs)
    row = ("cpu-tensor", "pass" if ok else "FAIL",
           f"CUDA worker, {ins} given a CPU activation: "
           f"{'refused: ' + short(refused, 160) if refused else 'NOT refused'}; from the "
           f"device it is made ready")
    report([row])                               # kept if NCCL's contrast below crashes
    return [(row[0], row[1], f"{row[2]}; NCCL itself on a CPU tensor: {nccl_on_cpu_tensor()}")]


# ---- probes: training against the CPU reference ------------------------------------------------
def against_reference(name: str, made, precision: str = "fp32",
                      clip: float | None = None) -> list[Row]:
    """Train `made` = (model, batch, plan) on CUDA workers over NCCL; compare with the CPU."""
    model, batch, plan = made
    with LocalCluster(plan.world, device="cuda", timeout=100) as cluster:
        backend = ",".join(sorted({i["backend"] for i in cluster.info}))
        got = pn.train(plan, batch, STEPS, SGD, cluster=cluster, clip_grad_norm=clip)
    ref = pn.reference_train(model, batch, STEPS, plan.microbatches, SGD, precision=precision,
                             clip_grad_norm=clip)
    tol = TOL[precision]
    where = f"{plan.world} rank{'s' if plan.world > 1 else ''} on {backend}, {STEPS} steps"
    mine, theirs = got.state_dict(), ref.state_dict()
    try:
        torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses),
                                   rtol=tol["loss"][0], atol=tol["loss"][1])
        for k, v in theirs.items():
            torch.testing.assert_close(mine[k], v, rtol=tol["weights"][0], atol=tol["weights"][1],
                                       msg=lambda m, k=k: f"{k}: {m}")
    except AssertionError as err:
        return [(name, "FAIL", f"{where}: {short(err, 300)}")]
    worst = max(float((mine[k].float() - v.float()).abs().max()) for k, v in theirs.items())
    return [(name, "pass", f"{where}: losses and weights match the CPU reference at {precision} "
             f"tolerance (rtol {tol['weights'][0]:g}, atol {tol['weights'][1]:g}); weights "
             f"within {worst:.1e}, losses {got.losses[0]:.4f} -> {got.losses[-1]:.4f}")]


def probe_matmul() -> list[Row]:
    n, reps = 8192, 50
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    c = torch.empty_like(a)
    for _ in range(5):
        torch.matmul(a, b, out=c)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(reps):
        torch.matmul(a, b, out=c)
    end.record()
    end.synchronize()
    rate = 2 * n**3 * reps / (start.elapsed_time(end) / 1e3)
    hw = HARDWARE["H200"]
    assumed = hw.peak("bf16") * hw.matmul_efficiency
    ok = rate >= assumed
    return [("matmul-bf16", "pass" if ok else "FAIL",
             f"{rate / 1e12:.0f} TFLOP/s on a {n}^3 bf16 matmul ({torch.cuda.get_device_name()}), "
             f"{rate / hw.peak('bf16'):.0%} of H200's bf16 peak; the analytic model assumes "
             f"{assumed / 1e12:.0f} (peak {hw.peak('bf16') / 1e12:.0f} x efficiency "
             f"{hw.matmul_efficiency:g}): measured / assumed {rate / assumed:.2f} (pass: >= 1)")]


def _timed(fn, reps: int) -> float:
    """Seconds per call of `fn` on the GPU (CUDA events, after 5 warm-up calls)."""
    for _ in range(5):
        fn()
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def probe_kernel_rates() -> list[Row]:
    """What the analytic model assumes and no run has measured: an fp32 matmul's fraction of
    the fp32 peak (TF32 off, PyTorch's default), a streaming kernel's fraction of HBM
    bandwidth, and a Float8 scaled matmul's of the FP8 peak. Each is printed measured /
    assumed; informational (pass within 2x)."""
    hw = HARDWARE["H200"]
    torch.backends.cuda.matmul.allow_tf32 = False
    n = 4096
    a = torch.randn(n, n, device="cuda")
    c = torch.empty_like(a)
    fp32 = 2 * n**3 / _timed(lambda: torch.matmul(a, a, out=c), 20)
    assumed = hw.peak("fp32") * hw.matmul_efficiency
    x = torch.randn(1 << 28, device="cuda")
    y = torch.empty_like(x)
    stream = 3 * x.numel() * 4 / _timed(lambda: torch.add(x, x, out=y), 20)
    bw = hw.hbm_bandwidth * hw.hbm_efficiency
    x = y = None   # free the 2 GiB before the next operands
    m = 8192   # pn.float8's matmul: e4m3 operands, the second column-major, bf16 out
    a8 = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn)
    b8 = torch.randn(m, m, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8 = 2 * m**3 / _timed(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one,
                                                      out_dtype=torch.bfloat16), 20)
    fp8_assumed = hw.peak("fp8") * hw.matmul_efficiency
    return [("matmul-fp32", "pass" if 0.5 <= fp32 / assumed <= 2 else "FAIL",
             f"{fp32 / 1e12:.1f} TFLOP/s on a {n}^3 fp32 matmul (TF32 off), {fp32 / hw.peak('fp32'):.0%} "
             f"of the fp32 peak; the analytic model assumes {assumed / 1e12:.1f}: measured / "
             f"assumed {fp32 / assumed:.2f} (informational: pass within 2x)"),
            ("hbm-stream", "pass" if 0.5 <= stream / bw <= 2 else "FAIL",
             f"{stream / 1e12:.2f} TB/s by an add of 2^28 fp32 elements (read 2, write 1), "
             f"{stream / hw.hbm_bandwidth:.0%} of the HBM peak; the analytic model assumes "
             f"{bw / 1e12:.2f}: measured / assumed {stream / bw:.2f} (informational: pass "
             "within 2x)"),
            ("matmul-fp8", "pass" if 0.5 <= fp8 / fp8_assumed <= 2 else "FAIL",
             f"{fp8 / 1e12:.0f} TFLOP/s on a {m}^3 torch._scaled_mm (e4m3, pn.float8's), "
             f"{fp8 / hw.peak('fp8'):.0%} of the FP8 peak; the analytic model assumes "
             f"{fp8_assumed / 1e12:.0f}: measured / assumed {fp8 / fp8_assumed:.2f} "
             "(informational: pass within 2x)")]


def trained(plan, batch, steps: int) -> tuple[float, int]:
    """Train `plan` on one CUDA rank over NCCL for `steps` steps with AdamW: (the median
    step, s, of steps 2 to steps - 1: warm and untraced; torch.cuda.max_memory_allocated
    over the last step, the traced one)."""
    with LocalCluster(1, device="cuda", timeout=100) as cluster:
        got = pn.train(plan, batch, steps, ADAMW, cluster=cluster)
    return statistics.median(got.step_times[1:-1]), got.trace.meta["cuda_max_allocated"][0]


def against_models(name: str, what: str, plan, step: float, measured: int,
                   steps: int) -> list[Row]:
    """Rows `name step` and `name memory`: a measured step (`trained`) against
    `CostModel.analytic(plan, "H200")`, its max_memory_allocated against the memory model."""
    want_step, want_peak = predicted(plan)
    r_step, r_mem = step / want_step, measured / want_peak
    return [
        (f"{name} step", "pass" if 0.25 <= r_step <= 4 else "FAIL",
         f"{what}: median step {step * 1e3:.1f} ms (steps 2-{steps - 1} of {steps}), "
         f"CostModel.analytic(plan, 'H200') predicts {want_step * 1e3:.1f} ms: measured / "
         f"predicted {r_step:.2f} (pass: within 4x)"),
        (f"{name} memory", "pass" if 2 / 3 <= r_mem <= 1.5 else "FAIL",
         f"{what}: torch.cuda.max_memory_allocated {measured / GiB:.2f} GiB, memory model peak "
         f"{want_peak / GiB:.2f} GiB under MemorySettings.for_cuda(nccl=False), i.e. without "
         "the per-communicator NCCL allowance: NCCL allocates its buffers outside PyTorch's "
         "caching allocator, so max_memory_allocated never sees them and they are counted on "
         f"neither side; measured / model {r_mem:.2f} (pass: 2/3 to 1.5)")]


def probe_mid() -> list[Row]:
    _, batch, plan = mid_gpt()
    step, measured = trained(plan, batch, 5)
    what = f"TinyGPT {MID['layers']}x{MID['dim']}, seq {MID['seq']}, fp32, AdamW"
    return against_models("gpt-mid", what, plan, step, measured, 5)


def plain_loop(model, batch, microbatches: int, steps: int, compiled: bool = False
               ) -> list[float]:
    """The plain PyTorch loop the Llama row compares with, in this process: `model` on the
    GPU in fp32, each microbatch's forward and loss under bf16 autocast and its backward
    (gradients accumulated, the loss scaled as the mean of the microbatches' mean losses),
    then the same optimizer (`ADAMW` builds torch.optim.AdamW, as on the workers). The
    seconds of each step, the batch's copy to the GPU included, synchronised at both ends.
    `compiled`: the model called through `torch.compile` (inductor; step 1 compiles)."""
    dev = torch.device("cuda", 0)
    model = model.to(dev)
    net = torch.compile(model) if compiled else model
    opt = ADAMW(list(model.parameters()))
    times = []
    for _ in range(steps):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        inputs, targets = (t.to(dev) for t in batch)
        for x, y in zip(inputs.chunk(microbatches), targets.chunk(microbatches), strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model.loss_fn(net(x), y) / microbatches
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
    return times


def probe_llama() -> list[Row]:
    """piper_nb first (its worker is another process, gone when the cluster closes), then
    the plain loop here on the same model, still at its initial weights, and batch."""
    model, batch, plan = llama()
    step, measured = trained(plan, batch, LLAMA_STEPS)
    plain = statistics.median(plain_loop(model, batch, plan.microbatches, LLAMA_STEPS - 1)[1:])
    params = sum(p.numel() for p in model.parameters())
    what = (f"Llama {LLAMA['layers']}x{LLAMA['dim']} ({params / 1e9:.2f} B parameters), "
            f"{LLAMA_SIZE['batch']} x {LLAMA['seq']} tokens in {plan.microbatches} "
            "microbatches, bf16, AdamW")
    ratio = step / plain
    return [
        ("llama-0.5b vs torch", "pass" if ratio <= 1.25 else "FAIL",
         f"{what}: median step {step * 1e3:.1f} ms (steps 2-{LLAMA_STEPS - 1} of "
         f"{LLAMA_STEPS}), a plain PyTorch loop on the same model and batch (fp32 weights, "
         f"bf16 autocast, gradient accumulation, the same AdamW) {plain * 1e3:.1f} ms (steps "
         f"2-{LLAMA_STEPS - 1} of {LLAMA_STEPS - 1}): piper_nb / plain {ratio:.2f} "
         "(pass: <= 1.25)"),
        *against_models("llama-0.5b", what, plan, step, measured, LLAMA_STEPS)]


def probe_llama_compiled() -> list[Row]:
    """Both compiled: piper_nb's region through `compile_regions` (its worker reports the
    first step's compile), then the plain loop under `torch.compile` on the same model."""
    model, batch, plan = llama_compiled()
    with LocalCluster(1, device="cuda", timeout=LLAMA_TIMEOUT_S) as cluster:
        got = pn.train(plan, batch, LLAMA_STEPS, ADAMW, cluster=cluster)
    step = statistics.median(got.step_times[1:-1])
    times = plain_loop(model, batch, plan.microbatches, LLAMA_STEPS - 1, compiled=True)
    plain = statistics.median(times[1:])
    ratio = step / plain
    return [("llama-0.5b compiled vs torch", "pass" if ratio <= 1.00 else "FAIL",
             f"both under torch.compile (inductor): median step {step * 1e3:.1f} ms (steps "
             f"2-{LLAMA_STEPS - 1}; the first compiled for {got.compile_s[0]:.0f} s), the plain "
             f"loop compiled {plain * 1e3:.1f} ms (steps 2-{LLAMA_STEPS - 1}; the first "
             f"{times[0]:.0f} s): piper_nb / plain {ratio:.2f} (pass: <= 1.00, issue 60's "
             "goal)")]


# ---- the probes --------------------------------------------------------------------------------
def probes() -> list[Probe]:
    multi = [("nccl-pp2", 2, "PP2 1F1B"), ("nccl-dualpipev", 2, "DualPipeV"),
             ("nccl-pp2-dp2-zero3", 4, "PP2 x DP2 ZeRO-3"), ("nccl-pp2-dp2-ep2", 4, "PP2 x DP2 x EP2")]

    def on_meta(name: str, build):
        """The dry run's plan of a sized model (`sized`), with what the models predict."""
        def plans():
            model, _, plan = build("meta")
            step, peak = predicted(plan)
            params = sum(p.numel() for p in model.parameters())
            print(f"  {name} ({params / 1e9:.2f} B parameters), compiled on the meta device: "
                  f"predicted step {step * 1e3:.1f} ms "
                  f"(analytic H200), peak {peak / GiB:.2f} GiB (for_cuda(nccl=False)); the GPU "
                  "run compiles it on CPU, where attention saves less")
            return [plan]
        return plans
    return [
        Probe("nccl-collectives", (("nccl-collectives", "all_reduce, reduce_scatter, all_gather, "
              "all_to_all on a 1-member NCCL group via Comm + CudaStreams, input behind a sleep "
              "kernel, memory reallocated and overwritten right after issue; results exact"),),
              probe_collectives, lambda: [collective_program()]),
        Probe("stream-coupling", (("stream-coupling", "two 1-member communicators: B, issued "
              "from compute after A, completes while A is held behind a sleep on its stream"),),
              lambda: probe_coupling(False), lambda: [coupling_program(False)]),
        Probe("stream-coupling-old", (("stream-coupling-old", "contrast: the old coupling (one "
              "shared stream that waits after each op) makes B complete only after A"),),
              lambda: probe_coupling(True), lambda: [coupling_program(True)]),
        Probe("cpu-tensor", (("cpu-tensor", "a CUDA worker refuses a CPU tensor given to a SEND "
              "with its own error naming the instruction, before NCCL sees it"),),
              probe_cpu_tensor, lambda: [multi_rank("nccl-pp2")[2]]),
        Probe("tinygpt-fp32", (("tinygpt-fp32", "TinyGPT, 1 rank on NCCL, 3 steps against the "
              "CPU reference at rtol/atol 1e-4"),),
              lambda: against_reference("tinygpt-fp32", tiny_gpt()),
              lambda: [tiny_gpt()[2]]),
        Probe("tinygpt-bf16", (("tinygpt-bf16", "TinyGPT in bf16 (fp32 masters), 1 rank on "
              "NCCL, against the CPU bf16 reference at bf16 tolerance (rtol 1.6e-2)"),),
              lambda: against_reference("tinygpt-bf16", tiny_gpt("bf16"), "bf16", 1.0),
              lambda: [tiny_gpt("bf16")[2]]),
        Probe("tinygpt-float8", (("tinygpt-float8", "TinyGPT in bf16 with every linear in "
              "Float8 (pn.float8, torch._scaled_mm), 1 rank on NCCL, against the CPU's Float8 "
              "run at bf16 tolerance"),),
              lambda: against_reference("tinygpt-float8", tiny_gpt("bf16", float8=True),
                                        "bf16", 1.0),
              lambda: [tiny_gpt("bf16", float8=True)[2]]),
        Probe("hf-llama", (("hf-llama", "Hugging Face LlamaForCausalLM (tiny config, torch.export "
              "capture), 1 rank on NCCL, against the CPU reference at rtol/atol 1e-4"),),
              lambda: against_reference("hf-llama", hf_llama()), lambda: [hf_llama()[2]]),
        Probe("matmul-bf16", (("matmul-bf16", "an 8192^3 bf16 matmul timed with CUDA events, "
              "TFLOP/s against the analytic model's H200 peak x matmul_efficiency"),), probe_matmul),
        Probe("kernel-rates", (("matmul-fp32", "a 4096^3 fp32 matmul (TF32 off) against "
              "the analytic model's fp32 peak x matmul_efficiency"),
              ("hbm-stream", "an add of 2^28 fp32 elements against the model's HBM "
              "bandwidth x hbm_efficiency"),
              ("matmul-fp8", "a 8192^3 Float8 scaled matmul against the model's FP8 peak "
              "x matmul_efficiency")), probe_kernel_rates),
        Probe("gpt-mid", (("gpt-mid step", "a mid-size GPT's measured step against "
              "CostModel.analytic(plan, 'H200')"),
              ("gpt-mid memory", "its torch.cuda.max_memory_allocated against the memory "
              "model's peak under MemorySettings.for_cuda(nccl=False), without the NCCL "
              "allowance: NCCL's buffers are outside PyTorch's allocator, counted on neither "
              "side")),
              probe_mid, on_meta("gpt-mid", mid_gpt)),
        Probe("llama-0.5b", (("llama-0.5b vs torch", "a Llama-shaped model of about 0.5 B "
              f"parameters (pn.models.Llama, {LLAMA['layers']} x {LLAMA['dim']}, "
              f"{LLAMA_SIZE['batch']} x {LLAMA['seq']} tokens), bf16, "
              f"{LLAMA_SIZE['microbatches']} microbatches, AdamW, 1 rank on "
              "NCCL: its step against a plain PyTorch loop (bf16 autocast, gradient "
              "accumulation, the same AdamW) on the same model and batch"),
              ("llama-0.5b step", "its step against CostModel.analytic(plan, 'H200')"),
              ("llama-0.5b memory", "its torch.cuda.max_memory_allocated against the memory "
               "model's peak under MemorySettings.for_cuda(nccl=False)")),
              probe_llama, on_meta("llama-0.5b", llama), timeout=LLAMA_TIMEOUT_S),
        Probe("llama-0.5b-compiled", (("llama-0.5b compiled vs torch", "the same Llama with "
              "its region through torch.compile (pn.compile_regions, inductor) against the "
              "plain loop under torch.compile, both on one GPU (goal: <= 1.00)"),),
              probe_llama_compiled, on_meta("llama-0.5b-compiled", llama_compiled),
              timeout=COMPILED_TIMEOUT_S),
        *(Probe(name, ((name, f"{label} on {gpus} GPUs over NCCL against the CPU reference"),),
                lambda name=name: against_reference(name, multi_rank(name)),
                lambda name=name: [multi_rank(name)[2]], gpus=gpus)
          for name, gpus, label in multi)]


# ---- the parent: each probe in a process of its own --------------------------------------------
def short(err, limit: int = 200) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def report(rows: list[Row]) -> None:
    print(MARK + json.dumps([list(r) for r in rows]), flush=True)


def in_process(probe: Probe, timeout: float) -> list[Row]:
    """Run `probe` as `gpu_check.py --probe NAME`; its last result line, or why none came."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--probe", probe.name]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)   # its own group: its workers die with it
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:   # a pipe held open by an escaped process
            pass
        return [(r, "timeout", f"no result within {timeout:.0f} s; its processes were killed")
                for r, _ in probe.rows]
    lines = [x for x in out.splitlines() if x.startswith(MARK)]
    if lines:
        return [tuple(r) for r in json.loads(lines[-1][len(MARK):])]
    tail = short((err.strip().splitlines() or ["no output"])[-1])
    return [(r, "FAIL", f"exit {proc.returncode} without a result: {tail}") for r, _ in probe.rows]


def static_row(probe: Probe, gpus: int) -> Row:
    """A multi-rank plan on a machine with too few GPUs: its stream program checked."""
    (plan,) = probe.plans()
    check_nccl(plan)                            # compile ran it too; here it is the row
    streams = plan.streams()
    launches = sum(len(ds.launches) for ds in streams)
    named_streams = sum(len(ds.streams()) for ds in streams)
    return (probe.name, "static + emulated",
            f"{plan.world} ranks need {probe.gpus} GPUs, this machine has {gpus}: NCCL refuses "
            f"two ranks on one GPU; its stream program ({launches} launches, {named_streams} "
            f"streams over {plan.world} devices) passed compiler.nccl.check_nccl, and make "
            "test runs its schedule under LocalCluster(comm='nccl-emulated') "
            "(tests/runtime/test_emulation.py)")


def dry_rows(probe: Probe) -> list[Row]:
    try:
        made = probe.plans()
    except Exception as err:   # a plan that does not compile is the finding
        return [(r, "FAIL", f"does not compile: {type(err).__name__}: {short(err)}")
                for r, _ in probe.rows]
    for x in made:
        if isinstance(x, DeviceStreams):        # a hand-written program: show what it launches
            print("\n".join("    " + line for line in x.text().splitlines()))
    checked = "; compiled and checked (NCCL check included)" if any(
        not isinstance(x, DeviceStreams) for x in made) else ""
    return [(r, "would run", does + checked) for r, does in probe.rows]


def run(dry: bool, gpus: int) -> list[Row]:
    rows: list[Row] = []
    deadline = time.monotonic() + BUDGET_S
    for probe in probes():
        t0 = time.monotonic()
        if probe.gpus > 1 and gpus < probe.gpus:
            got = [static_row(probe, gpus)]
        elif dry:
            got = dry_rows(probe)
        elif deadline - time.monotonic() < 20:
            got = [(r, "skipped", f"the run's {BUDGET_S:.0f} s budget is spent")
                   for r, _ in probe.rows]
        else:
            got = in_process(probe, min(probe.timeout, deadline - time.monotonic()))
        for case, status, _ in got:
            print(f"  {case}: {status} ({time.monotonic() - t0:.1f} s)", flush=True)
        rows += got
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description="piper_nb's GPU check (see the module docstring)")
    ap.add_argument("--dry-run", action="store_true", help="compile, check and list; run nothing")
    ap.add_argument("--probe", help="run one probe in this process and print its result line")
    args = ap.parse_args()
    if args.probe:
        probe = {p.name: p for p in probes()}[args.probe]
        try:
            rows = probe.run()
        except Exception as err:   # reported as the probe's row
            rows = [(r, "FAIL", f"{type(err).__name__}: {short(err)}") for r, _ in probe.rows]
        report(rows)
        return 0
    dry = args.dry_run or not torch.cuda.is_available()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs: {gpus}" + (" (dry run: compiles and checks every plan, runs nothing)" if dry
                             else f"; each probe in its own process, {PROBE_TIMEOUT_S:.0f} s each"
                             f" (llama-0.5b {LLAMA_TIMEOUT_S:.0f} s)"))
    t0 = time.monotonic()
    rows = run(dry, gpus)
    print("\n| case | status | detail |\n|---|---|---|")
    for case, status, detail in rows:
        print(f"| {case} | {status} | {detail.replace('|', '/')} |")
    print(f"\n{NOTE}\n\n{time.monotonic() - t0:.0f} s")
    return 1 if any(s in ("FAIL", "timeout") for _, s, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
