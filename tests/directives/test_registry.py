"""Every registered directive round-trips Python -> JSON -> Python -> generated code -> the
same program, with every field away from its default somewhere (the Designer's code view
once dropped `reshard=False`; a field a future directive forgets fails here)."""

from __future__ import annotations

import dataclasses
import json

import pytest

import piper_nb as pn
from piper_nb.compiler.compile import expand
from piper_nb.directives.spec import REGISTRY, Program, directive_from_json

EXAMPLES = {
    "place": [pn.place({"PP": 1}, devices=[2, 3], stream="pp")],
    "replicate": [pn.replicate({"PP": 0}, [0, 2], zero=3, bucket_size=0.5, reduce_stream="rs",
                               gather_stream="ag", reshard=False),
                  pn.replicate({"PP": 0, "EP": "*"}, [0, 1], zero=1),
                  pn.replicate({"PP": 1}, [1, 3], zero=3, grad_sync="step")],
    "shard": [pn.shard({"PP": 0, "EP": "*"}, devices=[0, 2], stream="ep")],
    "split": [pn.split({"PP": "*"}, dim="CH", num=3)],
    "recompute": [pn.recompute({"PP": 1, "MB": 0}), pn.recompute({"PP": 1}, mode="selective")],
    "float8": [pn.float8({"PP": 1})],
    "tensor_parallel": [pn.tensor_parallel({"PP": 0}, [[0, 1], [4, 5]],
                                           plan={"layers.*.up": "colwise:2",
                                                 "layers.*.down": "rowwise"},
                                           sequence_parallel=True),
                        pn.tensor_parallel({"PP": 1}, [2, 3])],
    "compile_regions": [pn.compile_regions({"PP": 0}, mode="max-autotune", dynamic=True,
                                           backend="aot_eager")],
    "context_parallel": [pn.context_parallel({"PP": 0}, [0, 1, 2, 3], load_balance="contiguous",
                                             rotate="p2p")],
    "order": [pn.order([[{"PP": 0, "MB": 0, "PASS": "F"}],
                        [{"PP": 0, "MB": 1, "PASS": "F"}, {"PP": 0, "MB": 0, "PASS": "B"}]])],
    "schedule": [directive_from_json({"op": "schedule", "name": "interleaved", "ranks": 2,
                                      "microbatches": 4, "chunks": 2, "place": True}),
                 directive_from_json({"op": "schedule", "name": "grid",
                                      "text": "0F0 0B0\n1F0 1B0"})],
}


def _defaults(cls) -> dict:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_every_registered_directive_has_examples_that_move_every_field():
    assert set(EXAMPLES) == set(REGISTRY)
    for op, cls in REGISTRY.items():
        defaults = _defaults(cls)
        for name in set(defaults) - cls.json_skip:     # json_skip: provenance, not arguments
            assert any(getattr(d, name) != defaults[name] for d in EXAMPLES[op]), \
                f"no {op} example sets {name}"


@pytest.mark.parametrize("d", [d for ds in EXAMPLES.values() for d in ds], ids=repr)
def test_python_json_python_code_is_the_same_program(d):
    text = json.dumps(d.to_json())
    back = directive_from_json(json.loads(text))
    assert back == d and type(back) is type(d)
    code = back.code()
    made = eval(f"[{code}]", {"pn": pn})            # a schedule's code is starred
    assert [x for _, x in expand(made)] == [x for _, x in expand([d])]


def test_a_programs_code_rebuilds_it():
    program = Program([d for ds in EXAMPLES.values() for d in ds if d.op != "schedule"])
    assert eval(program.code(), {"pn": pn}) == program


def test_json_keeps_piper_field_names():
    assert pn.split({}, dim="MB", num=4).to_json() == {
        "op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 4}
    assert pn.order([[{"PP": 0}]]).to_json() == {"op": "order", "filters": [[{"PP": 0}]]}
    zero2 = directive_from_json({"op": "replicate", "filter": {}, "devices": [0, 1],
                                 "shard_grads": True})
    assert zero2.zero == 2


def test_unset_fields_are_not_written_and_old_nulls_still_read():
    assert pn.place({"PP": 0}, [0]).to_json() == {"op": "place", "filter": {"PP": 0},
                                                  "devices": [0]}
    assert "null" not in pn.Program(pn.schedules.one_f_one_b(2, 2, place=True)).to_json()
    old = directive_from_json({"op": "place", "filter": {"PP": 0}, "devices": [0], "stream": None})
    assert old == pn.place({"PP": 0}, [0])


def test_print_program_is_its_json_one_directive_per_line():
    program = pn.Program([pn.place({"PP": 0}, [0]), *pn.schedules.gpipe(1, 2)])
    lines = str(program).splitlines()
    assert lines[:2] == ['[{"op": "place", "filter": {"PP": 0}, "devices": [0]},',
                         ' {"op": "split", "filter": {}, "dim_name": "MB", "num_microbatches": 2},']
    # the order's four slots wrap onto a second line; the text still reads back
    assert lines[3] == '   [{"PP": 0, "MB": 0, "PASS": "B"}], [{"PP": 0, "MB": 1, "PASS": "B"}]]}]'
    assert max(map(len, lines)) <= 100 and Program.from_json(str(program)) == program


@pytest.mark.parametrize("row, message", [
    ({"op": "split", "filter": {}, "dim": "MB", "num_microbatches": 2},
     "split: unknown field(s) dim; allowed: dim_name, filter, num_microbatches"),
    ({"op": "split", "filter": {}}, "split: missing field 'num_microbatches'"),
    ({"op": "order"}, "order: missing field 'filters'"),
    ({"op": "split", "filter": {}, "num_microbatches": 0},
     "split: num (JSON num_microbatches) must be a positive integer"),
    ({"op": "checkpoint"}, "unknown op 'checkpoint'; the ops are compile_regions, context_parallel, "
                           "float8, order, place"),
    ({"op": "recompute"}, "recompute: missing field 'filter'"),
    ({"op": "recompute", "filter": {"PASS": "F"}}, "recompute filter {'PASS': 'F'} names a PASS"),
])
def test_json_errors_name_the_field_in_both_spellings(row, message):
    with pytest.raises(pn.PlanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        directive_from_json(row)
