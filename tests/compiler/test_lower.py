"""The lowering's waits: a ZeRO-2/3 bucket's microbatch reduce-scatters one at a time."""

import pytest

import piper_nb as pn
from piper_nb.ir.kinds import Op, Purpose
from piper_nb.sim import CostModel


def plan(zero: int, microbatches: int):
    model = pn.models.MLP(dim=32, depth=4)
    batch = model.example_batch(batch_size=4 * microbatches, seed=0)   # microbatches of 4
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=zero),
               pn.replicate({"PP": 1}, [1, 3], zero=zero),
               *pn.schedules.one_f_one_b(2, microbatches)]
    return pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, batch)


@pytest.mark.parametrize("zero", [2, 3])
def test_each_reduce_scatter_is_waited_for_before_the_buckets_next(zero):
    for dp in plan(zero, 8).devices:
        ins = dp.instrs
        waited = {x.data.target: i for i, x in enumerate(ins) if x.kind == Op.WAIT}
        scatters = {}
        for i, x in enumerate(ins):
            if x.kind == Op.REDUCE_SCATTER and x.purpose == Purpose.GRAD:
                scatters.setdefault(x.bucket, []).append(i)
        assert scatters and all(len(v) == 8 for v in scatters.values())
        for issued in scatters.values():
            for a, b in zip(issued, issued[1:], strict=False):
                assert a < waited[a] < b, f"dev{dp.device}: {ins[a]} waited after {ins[b]}"


def gradient_peaks(trace) -> dict[int, int]:
    """Per device, the most bytes of gradients and communication buffers held at once."""
    out: dict[int, int] = {}
    for s in trace.memory:
        out[s.device] = max(out.get(s.device, 0), s.grads + s.buffers)
    return out


@pytest.mark.parametrize("zero", [2, 3])
def test_gradient_memory_does_not_grow_with_the_microbatches(zero):
    peaks = [gradient_peaks(pn.simulate(plan(zero, m), CostModel())) for m in (4, 8, 16)]
    assert peaks[0] == peaks[1] == peaks[2]
