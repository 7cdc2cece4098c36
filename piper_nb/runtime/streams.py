"""Executing a device's stream program (`plan.streams()[rank]`): the runtime's only rules
about streams are the ones written there.

The worker walks its instructions; for each it hands the executor that instruction's
launches (`DeviceStreams.by_instr`), with what they need: the pass to run (RUN), the
transfer to start (COMM), the token counts to exchange (EXCHANGE). Three executors:

- `HostStreams` (CPU, gloo): the host is the compute stream. A transfer starts
  asynchronously on its communicator's group; a `wait` for it on the compute stream blocks
  the host (with the cluster's timeout). Streams other than `compute` and the
  communicators' are CUDA's: a program that uses them runs on CUDA or emulated.
- `CudaStreams` (NCCL on GPUs): RUN runs with its stream current; a COMM starts with the
  stream that recorded its issue event current, so ProcessGroupNCCL's own stream for that
  communicator first waits for it (its `syncStream`); a `wait` for a transfer is
  `work.wait()` with the waiting stream current (the stream waits, the host goes on); other
  events are CUDA events; a `sync` synchronises that stream.
- `EmulatedStreams` (`runtime.emulation`): the same program on CPU, one thread per stream,
  each communicator a FIFO over gloo that completes as NCCL's does.

Each executor records what it did (`log`: per stream, the launches it executed, in
order), so a test compares what ran with the program.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from piper_nb.plan.streams import COMPUTE_STREAM, DeviceStreams, Launch, Step

__all__ = ["HostStreams", "CudaStreams", "is_comm_stream"]


def is_comm_stream(name: str) -> bool:
    """A communicator's own stream (`nccl:<communicator>`)."""
    return name.startswith("nccl:")


class HostStreams:
    """CPU with gloo: the host is the compute stream; transfers are gloo's async works."""

    def __init__(self, comm, program: DeviceStreams, timeout: float):
        self.comm, self.timeout = comm, timeout
        self.launches = program.by_instr()
        self.works: dict[str, list] = {}          # "d<k>" -> the works that record it
        self.log: dict[str, list[Launch]] = defaultdict(list)
        self.recording = False
        for xs in self.launches.values():
            for x in xs:
                if x.stream != COMPUTE_STREAM and not is_comm_stream(x.stream) and \
                        x.step not in (Step.SYNC, Step.EXCHANGE):
                    raise RuntimeError(
                        f"the stream program puts {x.step} on stream {x.stream!r}, a CUDA "
                        "stream: run it on CUDA or with LocalCluster(comm='nccl-emulated')")

    def begin_step(self, record: bool = False) -> None:
        self.works.clear()
        self.log.clear()
        self.recording = record

    def _note(self, x: Launch) -> None:
        if self.recording:
            self.log["host" if x.step in (Step.SYNC, Step.EXCHANGE) else x.stream].append(x)

    def launch(self, k: int, run=None, transfer=None, exchange=None):
        """Execute instruction k's launches. `run()` runs its pass, `exchange()` its token
        count exchange, `transfer()` makes its transfer; the works started, if any."""
        works = None
        for x in self.launches.get(k, ()):
            self._note(x)
            if x.step == Step.RUN:
                run()
            elif x.step == Step.EXCHANGE:
                exchange()
            elif x.step == Step.COMM:
                t = transfer()
                works = self.comm.start(t)
                self.pending_transfer = t
            elif x.step == Step.RECORD and is_comm_stream(x.stream):
                self.works[x.event] = works
            elif x.step == Step.WAIT and x.stream == COMPUTE_STREAM and x.event in self.works:
                self.comm.wait_works(self.works.pop(x.event), self.timeout)
        return works

    def end_step(self) -> None:
        for x in self.launches.get(-1, ()):
            self._note(x)


class CudaStreams(HostStreams):
    """NCCL on GPUs: the program's streams are CUDA streams, its communicators
    ProcessGroupNCCL's."""

    def __init__(self, comm, program: DeviceStreams, timeout: float):
        self.comm, self.timeout = comm, timeout
        self.launches = program.by_instr()
        self.works: dict[str, list] = {}
        self.events: dict[str, tuple[str, torch.cuda.Event]] = {}   # event -> (stream, event)
        self.log = defaultdict(list)
        self.recording = False
        self.device = comm.device
        self.named: dict[str, torch.cuda.Stream] = {}

    def stream(self, name: str):
        if name == COMPUTE_STREAM:
            return torch.cuda.current_stream(self.device)
        s = self.named.get(name)
        if s is None:
            s = self.named[name] = torch.cuda.Stream(device=self.device)
        return s

    def begin_step(self, record: bool = False) -> None:
        super().begin_step(record)
        self.events.clear()

    def launch(self, k: int, run=None, transfer=None, exchange=None):
        works = None
        issue_on = COMPUTE_STREAM
        for x in self.launches.get(k, ()):
            self._note(x)
            if x.step == Step.RUN:
                with torch.cuda.stream(self.stream(x.stream)):
                    run()
            elif x.step == Step.EXCHANGE:
                exchange()
            elif x.step == Step.SYNC:
                if not is_comm_stream(x.stream):
                    self.stream(x.stream).synchronize()
            elif x.step == Step.RECORD and not is_comm_stream(x.stream):
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(self.stream(x.stream))
                self.events[x.event] = (x.stream, ev)
            elif x.step == Step.WAIT and is_comm_stream(x.stream):
                issue_on = self.events[x.event][0]   # NCCL's stream waits for this one
            elif x.step == Step.COMM:
                t = transfer()
                with torch.cuda.stream(self.stream(issue_on)):
                    works = self.comm.start(t)
                self.span = self._span(x.comm, works, self.events.get(f"i{k}"))
            elif x.step == Step.RECORD:
                self.works[x.event] = works
            elif x.step == Step.WAIT:
                with torch.cuda.stream(self.stream(x.stream)):
                    if x.event in self.works:
                        for w in self.works[x.event]:
                            w.wait()
                    else:
                        torch.cuda.current_stream(self.device).wait_event(self.events[x.event][1])
        return works

    def _span(self, comm: str, works, start):
        """(start, None) of a transfer: its issue event; its end is marked where the plan
        waits for it (`Worker._wait`, an event on the waiting stream). Waiting for the work
        anywhere sooner, even on a stream of its own, would end ProcessGroupNCCL's hold on
        the transfer's tensors before the plan's WAIT."""
        return (start[1] if start else None, None)

    def end_step(self) -> None:
        super().end_step()
        torch.cuda.synchronize(self.device)
