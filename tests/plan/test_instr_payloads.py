"""Instructions by kind: what only one kind has lives in that kind's payload (`Instr.data`),
so a field for one kind touches that payload and its handlers, not every reader."""

from dataclasses import fields

import pytest

from piper_nb.ir.kinds import Op, Purpose
from piper_nb.plan.instr import PAYLOADS, Collective, Instr, Message, Pass, Update, Wait


def test_an_instruction_holds_only_what_every_kind_has():
    shared = [f.name for f in fields(Instr)]
    assert shared == ["kind", "node", "stream", "region", "mb", "replica", "replicas", "data"]
    assert set(PAYLOADS) == set(Op)


def test_each_kind_carries_its_own_payload():
    assert Instr(Op.F).data == Pass() and Instr(Op.U).data == Update()
    send = Instr.of("SEND", "n", "pp", region=0, mb=1, peer=2, tag=7, values=("x",), grad=True)
    assert send.data == Message(2, 7, ("x",), True) and send.kind is Op.SEND
    ar = Instr.of("ALL_REDUCE", group=(0, 1), purpose=Purpose.GRAD, bucket=3)
    assert isinstance(ar.data, Collective) and (ar.purpose, ar.bucket) == (Purpose.GRAD, 3)
    assert (send.purpose, send.bucket, send.overlap) == (Purpose.NONE, -1, -1)
    assert Instr.of("F", overlap=2).overlap == 2


def test_a_field_of_another_kind_is_refused():
    with pytest.raises(TypeError, match="SEND instruction has no field group"):
        Instr.of("SEND", group=(0, 1))
    with pytest.raises(TypeError, match="carries a Pass, not a Wait"):
        Instr(Op.F, data=Wait(0))


def test_with_data_changes_the_payload_only():
    w = Instr.of("WAIT", "n", "pp", target=3)
    moved = w.with_data(target=5)
    assert (moved.data.target, moved.node, moved.stream) == (5, "n", "pp")


def test_the_json_form_stays_flat_and_exact():
    ins = Instr.of("ALL_TO_ALL", "d", "ep", region=2, mb=0, replica=1, replicas=2,
                   group=(0, 1), purpose=Purpose.DISPATCH, values=("h",), owners=(1,))
    obj = ins.to_json()
    assert obj == {"kind": "ALL_TO_ALL", "node": "d", "stream": "ep", "region": 2, "mb": 0,
                   "replica": 1, "replicas": 2, "group": [0, 1], "purpose": "dispatch",
                   "values": ["h"], "owners": [1]}
    assert Instr.from_json(obj) == ins
