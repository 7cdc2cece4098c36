"""The memory model equals the runtime's count, byte for byte, for every strategy.

One rule on both sides (`sim/memory.py`, `runtime/stores.py`): bytes actually held after
each instruction, each tensor once. The runtime samples after every instruction, and so
does `pn.simulate`, so the two sequences are compared sample by sample per device and per
category (params, grads, optim, activations, buffers); times differ and are not compared.
Each plan trains 2 steps and the last one is compared: a steady-state step, where the
optimizer state already exists (the first step is checked with `first_step=True`). The
expert-parallel plan's token buffers are sized by the routing that step made (recorded in
`trace.meta["tokens"]`), as a step's routing is data, not plan.
"""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn
from piper_nb.compiler.clip import with_grad_clipping
from piper_nb.optim import check_optimizer
from piper_nb.sim import CostModel, MemorySettings
from piper_nb.strategies import MATRIX, compile_strategy

pytestmark = pytest.mark.dist

KINDS = ("params", "grads", "optim", "activations", "buffers")
OPT = pn.optim.AdamW(1e-3)


STRATEGIES = MATRIX


def _compile(name: str):
    return compile_strategy(name)



@pytest.fixture(scope="module")
def clusters(cluster2, cluster4):
    """One local cluster per world size: the session's of 2 and 4 workers, and one of
    any other size shared by the module's tests."""
    made: dict[int, pn.LocalCluster] = {2: cluster2, 4: cluster4}
    own = []

    def get(n: int) -> pn.LocalCluster:
        if n not in made:
            made[n] = pn.LocalCluster(n).start()
            own.append(made[n])
        return made[n]
    yield get
    for c in own:
        c.close()


def _by_device(memory, plan) -> dict[int, list[tuple]]:
    out = {d: [] for d in range(plan.world)}
    for m in memory:
        out[m.device].append(tuple(getattr(m, k) for k in KINDS))
    return out


def _assert_equal(plan, measured, predicted) -> None:
    meas, pred = _by_device(measured, plan), _by_device(predicted, plan)
    for d in range(plan.world):
        instrs = plan.devices[d].instrs
        assert len(meas[d]) == len(pred[d]) == len(instrs), f"device {d}: one sample each"
        for k, kind in enumerate(KINDS):   # the peaks first: the headline numbers
            assert max(s[k] for s in meas[d]) == max(s[k] for s in pred[d]), (
                f"device {d}: peak {kind}")
        for i, (m, p) in enumerate(zip(meas[d], pred[d], strict=True)):
            ins = instrs[i]
            text = f"wait({instrs[ins.data.target]})" if ins.kind == "WAIT" else str(ins)
            assert m == p, (f"device {d}, instruction {i} ({text}): measured "
                            f"{dict(zip(KINDS, m, strict=True))}, predicted "
                            f"{dict(zip(KINDS, p, strict=True))}")


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_predicted_memory_equals_measured(clusters, name):
    plan, batch = _compile(name)
    result = pn.train(plan, batch, steps=2, optimizer=OPT, cluster=clusters(plan.world))
    tokens = result.trace.meta.get("tokens")
    assert (tokens is not None) == (name == "pp2-dp2-ep2")
    predicted = pn.simulate(plan, CostModel.uniform(),
                            memory=MemorySettings(optimizer=OPT, tokens=tokens))
    _assert_equal(plan, result.trace.memory, predicted.memory)
    assert predicted.peak_memory == result.trace.peak_memory


@pytest.mark.parametrize("name,optimizer", [("interleaved", pn.optim.SGD(0.1, momentum=0.9)),
                                            ("zero2", OPT)])
def test_first_step_optimizer_state_appears_at_the_update(clusters, name, optimizer):
    plan, batch = _compile(name)
    result = pn.train(plan, batch, steps=1, optimizer=optimizer, cluster=clusters(plan.world))
    settings = MemorySettings(optimizer=optimizer, first_step=True)
    _assert_equal(plan, result.trace.memory, pn.simulate(plan, CostModel.uniform(),
                                                         memory=settings).memory)


@pytest.mark.parametrize("name", ["pp2-dp2-zero3", "zero1"])
def test_groups_and_clipping_are_counted_byte_for_byte(clusters, name):
    """Parameter groups cut shards into pieces, each with its own state (Adam's scalar step
    included); clipping holds an 8-byte all-reduce buffer from issue to WAIT."""
    plan, batch = _compile(name)
    groups = [{"params": "*.bias", "weight_decay": 0.0}]
    plan = with_grad_clipping(plan, 1.0)
    result = pn.train(plan, batch, steps=2, optimizer=torch.optim.AdamW, param_groups=groups,
                      cluster=clusters(plan.world))
    spec = check_optimizer(torch.optim.AdamW, param_groups=groups)
    predicted = pn.simulate(plan, CostModel.uniform(), memory=MemorySettings(optimizer=spec))
    _assert_equal(plan, result.trace.memory, predicted.memory)


@pytest.mark.parametrize("zero,reduce_dtype", [(1, "fp32"), (3, "bf16"), (0, "fp32")])
def test_bf16_plans_are_counted_byte_for_byte(clusters, zero, reduce_dtype):
    """bf16 weights, grads and activations; fp32 masters and state beside the optimizer's;
    reduction buffers and ZeRO gradient shards in the reduction's dtype."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    batch = model.example_batch(batch_size=8, seed=0)
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=zero),
               pn.replicate({"PP": 1}, [1, 3], zero=zero), *pn.schedules.one_f_one_b(2, 4)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, batch,
                      precision="bf16", reduce_dtype=reduce_dtype, clip_grad_norm=1.0)
    result = pn.train(plan, batch, steps=2, optimizer=OPT, cluster=clusters(plan.world))
    predicted = pn.simulate(plan, CostModel.uniform(), memory=MemorySettings(optimizer=OPT))
    _assert_equal(plan, result.trace.memory, predicted.memory)


def _tied(zero: int):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=True)
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=zero),
               pn.replicate({"PP": 1}, [1, 3], zero=zero), *pn.schedules.one_f_one_b(2, 4)]
    return model, pn.cut_stages(model, 2), program


def _pp2_dp2_zero3(reshard: bool, grad_sync: str):
    """ZeRO-3 under 1F1B: full gradients held over the step and reduced once, or a gather
    held over the step with one reduction per microbatch."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=False)
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               *(pn.replicate({"PP": s}, [s, s + 2], zero=3, reshard=reshard,
                              grad_sync=grad_sync) for s in (0, 1)),
               *pn.schedules.one_f_one_b(2, 4)]
    return model, pn.cut_stages(model, 2), program


def _dualpipe_zero(zero: int):
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16, tie_embeddings=True)
    program = [*pn.schedules.dualpipe(2, 4, place=True),
               pn.replicate({"PP": 0}, [0, 1], zero=zero), pn.replicate({"PP": 1}, [0, 1], zero=zero)]
    return model, pn.cut_stages(model, 2), program


def _frozen_zero3():
    model = pn.models.MLP(dim=16, depth=4)
    model.layers[1].requires_grad_(False)
    program = [pn.replicate({}, [0, 1], zero=3), pn.split({}, "MB", 2)]
    return model, {"layers": {"PP": 0}}, program


def _recompute(kind: str):
    """`pn.recompute` under a split backward (the stash holds BI's graph until BW), under
    ZeRO-3 and on a 1F1B pipeline (one microbatch only)."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    program = {
        "zb1p": lambda: [*pn.schedules.zero_bubble(2, 4, place=True), pn.recompute({"PP": "*"})],
        "zero3": lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1], zero=3),
                          pn.split({}, "MB", 2), pn.recompute({"PP": 0})],
        "1f1b": lambda: [*pn.schedules.one_f_one_b(2, 4, place=True),
                         pn.recompute({"PP": 1, "MB": 1})],
    }[kind]()
    return model, pn.cut_stages(model, 2), program


def _sequence_parallel(recompute: str | None):
    """TP 2 with sequence parallelism (slices, the zeros they are laid in, copies of the
    norm weights), recomputed (full, or selective: the attention cores) or not."""
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    ann = {"embed": {"PP": 0}, **{f"blocks.{i}": {"PP": 0, "L": i} for i in range(2)},
           "head": {"PP": 0, "L": 2}}
    program = [pn.tensor_parallel({}, [0, 1], sequence_parallel=True), pn.split({}, "MB", 2)]
    return model, ann, program + ([pn.recompute({"L": 0}, mode=recompute)] if recompute else [])


def _units(sp: bool):
    """TP 2 layers recomputed as one unit (`compiler.layer_recompute`) under 1F1B's order:
    one layer for every microbatch, the other for its second only."""
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    ann = {"embed": {"PP": 0}, **{f"blocks.{i}": {"PP": 0, "L": i} for i in range(2)},
           "head": {"PP": 0, "L": 2}}
    return model, ann, [pn.tensor_parallel({}, [0, 1], sequence_parallel=sp),
                        pn.split({}, "MB", 2), pn.recompute({"L": 0}),
                        pn.recompute({"L": 1, "MB": 1})]


def _float8():
    """Float8 linears (`pn.float8`: what they save, their scales and copies within a pass)
    under ZB1P's split backward, replicated with ZeRO-1."""
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    program = [*pn.schedules.zero_bubble(2, 4), pn.place({"PP": 0}, [0, 2]),
               pn.place({"PP": 1}, [1, 3]), pn.replicate({"PP": 0}, [0, 2], zero=1),
               pn.replicate({"PP": 1}, [1, 3], zero=1), pn.float8({"PP": "*"})]
    return model, pn.cut_stages(model, 2), program


def _context(extra: str | None):
    """CP 2 (each device's tokens, every member's keys and values gathered between parts,
    their gradients reduce-scattered), with ZeRO-3 or full recompute."""
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    more = {None: [], "zero3": [pn.replicate({}, [0, 1], zero=3)],
            "recompute": [pn.recompute({"L": 0})]}[extra]
    ann = {"embed": {"PP": 0}, **{f"blocks.{i}": {"PP": 0, "L": i} for i in range(2)},
           "head": {"PP": 0, "L": 2}}
    return model, ann, [pn.context_parallel({}, [0, 1]), pn.split({}, "MB", 2), *more]


def _ring(extra: str | None):
    """CP 2 on the point-to-point ring (`rotate="p2p"`: each step a part, the keys and
    values received between them), alone, with one layer recomputed, and CP 2 x TP 2 + SP
    with one layer recomputed as a unit."""
    if extra == "tp2-sp-units":
        model, ann, program = _context_tensor(True)
        return model, ann, [pn.context_parallel({}, [0, 2], rotate="p2p"), *program[1:]]
    model, ann, program = _context(extra)
    return model, ann, [pn.context_parallel({}, [0, 1], rotate="p2p"), *program[1:]]


def _compiled(backend: str):
    """Regions through torch.compile under 1F1B: what AOTAutograd's partition saves
    (inductor's min-cut recomputes cheap ops; aot_eager's default partition), measured at
    compile time as the workers will run them."""
    model = pn.models.Llama(vocab=32, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, seq=8)
    return model, pn.cut_stages(model, 2), [*pn.schedules.one_f_one_b(2, 2),
                                            pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
                                            pn.compile_regions({}, backend=backend)]


def _context_tensor(sp: bool):
    """CP 2 x TP 2 (the context over the groups' first devices, each region cut by both:
    TP's parts cut again at the attentions), with sequence parallelism and one layer
    recomputed as a unit over both cuts' parts."""
    model, ann, _ = _context(None)
    return model, ann, [pn.context_parallel({}, [0, 2]),
                        pn.tensor_parallel({}, [[0, 1], [2, 3]], sequence_parallel=sp),
                        pn.split({}, "MB", 2), *([pn.recompute({"L": 0})] if sp else [])]


MORE = {**{f"tied-zero{z}-pp2-dp2": lambda z=z: _tied(z) for z in (1, 2, 3)},
        **{f"dualpipe-copies-zero{z}": lambda z=z: _dualpipe_zero(z) for z in (2, 3)},
        **{f"recompute-{k}": lambda k=k: _recompute(k) for k in ("zb1p", "zero3", "1f1b")},
        "frozen-zero3": _frozen_zero3,
        **{f"tp2-sp{'-' + r if r else ''}": lambda r=r: _sequence_parallel(r)
           for r in (None, "full", "selective")},
        **{f"tp2{'-sp' if sp else ''}-units": lambda sp=sp: _units(sp) for sp in (False, True)},
        "float8-zb1p-zero1": lambda: _float8(),
        **{f"cp2{'-' + x if x else ''}": lambda x=x: _context(x) for x in (None, "zero3", "recompute")},
        **{f"cp2-tp2{'-sp-units' if sp else ''}": lambda sp=sp: _context_tensor(sp)
           for sp in (False, True)},
        **{f"cp2-ring{'-' + x if x else ''}": lambda x=x: _ring(x)
           for x in (None, "recompute", "tp2-sp-units")},
        **{f"compiled-{b}-1f1b": lambda b=b: _compiled(b) for b in ("aot_eager", "inductor")},
        "pp2-dp2-zero3-step-sync": lambda: _pp2_dp2_zero3(True, "step"),
        "pp2-dp2-zero3-noreshard-microbatch-sync": lambda: _pp2_dp2_zero3(False, "microbatch")}


@pytest.mark.parametrize("name", sorted(MORE))
def test_predicted_memory_equals_measured_beyond_the_matrix(clusters, name):
    """Weights tied across stages and DualPipe copies under ZeRO, frozen weights, recompute."""
    model, annotation, program = MORE[name]()
    batch = model.example_batch(batch_size=8, seed=0)
    plan = pn.compile(pn.annotate(model, annotation), program, batch)
    result = pn.train(plan, batch, steps=2, optimizer=OPT, cluster=clusters(plan.world))
    predicted = pn.simulate(plan, CostModel.uniform(), memory=MemorySettings(optimizer=OPT))
    _assert_equal(plan, result.trace.memory, predicted.memory)
