"""Fixtures for simulator tests: hand-written plans in the Instr text form (`hand_plan`),
timelines as text (`spans`), and small compiled MLP plans (`compile_schedule`)."""

from __future__ import annotations

import re

import pytest

import piper_nb as pn
from piper_nb.plan.instr import Instr
from piper_nb.plan.plan import DevicePlan, Plan

_PASS = {"F": "F", "B": "B", "I": "BI", "W": "BW"}
_COMP = re.compile(r"^r(\d+):([FBIW])(\d+)$")
_P2P = re.compile(r"^r(\d+):(SEND|RECV)_([FB])(\d+)([<>])(\d+)$")
_COLL = {"AR": "ALL_REDUCE", "RS": "REDUCE_SCATTER", "AG": "ALL_GATHER", "A2A": "ALL_TO_ALL"}


def _instr(tok: str, world: int, overlap: int = -1) -> Instr:
    if m := _COMP.match(tok):
        return Instr.of(_PASS[m[2]], f"n:{tok}", region=int(m[1]), mb=int(m[3]), overlap=overlap)
    if m := re.match(r"^r(\d+):U$", tok):
        return Instr.of("U", f"n:{tok}", region=int(m[1]))
    if m := _P2P.match(tok):
        grad = m[3] == "B"
        return Instr.of(m[2], f"n:{tok}", "pp", region=int(m[1]), mb=int(m[4]), peer=int(m[6]),
                     tag=2 * int(m[4]) + grad, grad=grad)
    if m := re.match(r"^(AR|RS|AG|A2A)(?:@(\d+))?$", tok):
        return Instr.of(_COLL[m[1]], f"n:{tok}", "dp", mb=int(m[2]) if m[2] else -1,
                     group=tuple(range(world)))
    raise ValueError(f"cannot parse {tok!r}")


def _hand_plan(*rows: str) -> Plan:
    """One row of space-separated instructions per device: `r0:F0 r0:SEND_F0>1 wait(r0:SEND_F0>1)`,
    `(r0:F1;r1:B0)` an overlapped slot, `AR@0` a collective over every device."""
    world = len(rows)
    devices, overlap = [], 0
    for d, row in enumerate(rows):
        out: list[Instr] = []
        for tok in row.split():
            if tok.startswith("wait("):
                name = tok[5:-1]
                target = max(i for i, x in enumerate(out) if str(x) == name)
                out.append(Instr.of("WAIT", out[target].node, out[target].stream, target=target))
            elif tok.startswith("("):
                for part in tok[1:-1].split(";"):
                    out.append(_instr(part, world, overlap))
                overlap += 1
            else:
                out.append(_instr(tok, world))
        devices.append(DevicePlan(d, tuple(out)))
    return Plan(world=world, devices=tuple(devices), microbatches=1, batch_size=1, loss_scale=1.0)


def _spans(trace, device: int, stream: str | None = None) -> list[str]:
    """`label@start-end` of a device's events in start order: a timeline in text form."""
    evs = sorted((e for e in trace.events if e.device == device
                  and (stream is None or e.stream == stream)), key=lambda e: (e.start, e.label))
    return [f"{e.label}@{e.start:g}-{e.end:g}" for e in evs]


def _compile_schedule(model, builder, ranks: int, stages: int, microbatches: int, **kw) -> Plan:
    batch = model.example_batch(batch_size=2 * microbatches, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, stages))
    return pn.compile(spec, builder(ranks=ranks, microbatches=microbatches, place=True, **kw),
                      batch)


@pytest.fixture
def hand_plan():
    return _hand_plan


@pytest.fixture
def spans():
    return _spans


@pytest.fixture(scope="session")
def compile_schedule():
    return _compile_schedule
