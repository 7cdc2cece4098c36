"""`pn.float8(filter)`: the matched regions' linear layers multiply in Float8 (torchao's
tensorwise dynamic scaling, `torch._scaled_mm`, which runs on the CPU too). A plan trains
like one process running the same Float8 linears (`Float8Linear.swap`) under 1F1B, a split
backward (ZB1P) and ZeRO-3; a split backward computes each gradient once; the analytic
model prices the matmuls at the GPU's FP8 rate and refuses a GPU without FP8; tensor
parallelism compiles and prices but is refused before training; bad filters are
PlanErrors naming the fix."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import piper_nb as pn
from piper_nb.capture.float8 import Float8Linear, Float8Matmul, float8_linear, uses_float8
from piper_nb.directives.spec import directive_from_json

SGD = pn.optim.SGD(lr=0.1)
RTOL, ATOL = 1e-5, 1e-6
LAYERS = {"embed": {"PP": 0, "L": 0}, "blocks.0": {"PP": 0, "L": 1, "AC": 1},
          "blocks.1": {"PP": 1, "L": 2, "AC": 1}, "head": {"PP": 1, "L": 3}}
FP8 = pn.float8({"AC": 1})    # the decoder layers; the head stays as it is (torchtitan)


def _gpt():
    return pn.models.MegatronGPT(vocab=32, dim=32, layers=2, heads=2, seq=8, p=0.0)


PROGRAMS = {
    "1f1b": lambda: [*pn.schedules.one_f_one_b(2, 4, place=True), FP8],
    "zb1p": lambda: [*pn.schedules.zero_bubble(2, 4, place=True), FP8],
    "zero3": lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1], zero=3),
                      pn.split({}, "MB", 2), FP8],
}


@pytest.mark.dist
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_float8_plan_trains_like_one_process_with_float8_linears(cluster2, one_thread, name):
    model = _gpt()
    batch = model.example_batch(batch_size=8, seed=0)
    spec = pn.annotate(model, LAYERS)
    plan = pn.compile(spec, PROGRAMS[name](), batch)
    assert sum(isinstance(m, Float8Matmul) for r in plan.capture.modules
               for m in r.modules()) == 2 * 4               # qkv, out, fc1, fc2 in each layer
    # the user's capture stays as it was: a plan without the directive has none
    assert not uses_float8(pn.compile(spec, PROGRAMS[name]()[:-1], batch).capture.modules)
    result = pn.train(plan, batch, 3, SGD, cluster=cluster2, seed=5)
    swapped = Float8Linear.swap(model, ["blocks"])
    ref = pn.reference_train(swapped, batch, 3, plan.reference_microbatches, SGD, seed=5)
    plain = pn.reference_train(model, batch, 3, plan.reference_microbatches, SGD, seed=5)
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    assert result.losses[-1] != plain.losses[-1]           # Float8 is not bf16's rounding
    got = result.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=lambda m, k=k: f"{k}: {m}")


class _Calls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[str(func._overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def test_float8_linear_is_close_to_linear_and_computes_only_the_gradients_asked():
    torch.manual_seed(0)
    x = torch.randn(4, 8, 32, requires_grad=True)
    w = torch.randn(48, 32, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    h = x * 1.0                                             # x's gradient through a node
    out = float8_linear(h, w, b)
    want = F.linear(x, w, b)
    assert out.shape == want.shape
    assert 0 < _error(out, want) < 0.05      # e4m3 keeps 3 mantissa bits: errors average out
    for wrt, mms in (([x], 1), ([w], 1), ([x, w], 2)):
        with _Calls() as calls:
            grads = torch.autograd.grad(out.sum(), wrt, retain_graph=True)
        assert calls.seen["aten._scaled_mm"] == mms, wrt
        assert all(g is not None for g in grads)
    gx, gw = torch.autograd.grad(out.sum(), [x, w])
    rx, rw = torch.autograd.grad(want.sum(), [x, w])
    assert 0 < _error(gx, rx) < 0.05 and 0 < _error(gw, rw) < 0.05


def _plan(program, precision="bf16", model=None, device="cpu"):
    model = model or _gpt()
    spec = pn.annotate(model, {k: {**v, "PP": 0} for k, v in LAYERS.items()})
    with torch.device(device):
        batch = model.example_batch(4, seed=0)
    return pn.compile(spec, [pn.place({}, [0]), *program], batch, precision=precision)


def test_the_analytic_model_prices_float8_matmuls_and_refuses_a_gpu_without_them():
    with torch.device("meta"):
        big = pn.models.MegatronGPT(vocab=256, dim=4096, layers=2, heads=32, seq=2048, p=0.0)
    plain, fp8 = _plan([], model=big, device="meta"), _plan([FP8], model=big, device="meta")
    f = {k: pn.CostModel.analytic(p, "H100", compiled=True) for k, p in (("bf16", plain),
                                                                         ("fp8", fp8))}
    for region in (1, 2):   # large layers: faster in Float8, the casts included
        assert f["fp8"].passes[(region, "F")] < f["bf16"].passes[(region, "F")]
    assert f["fp8"].passes[(3, "F")] == f["bf16"].passes[(3, "F")]   # the head as it was
    with pytest.raises(pn.PlanError, match="A100 has no FP8 tensor cores"):
        pn.CostModel.analytic(fp8, "A100")
    pn.CostModel.analytic(plain, "A100")


def test_the_directive_round_trips_and_bad_filters_name_the_fix():
    d = directive_from_json({"op": "float8", "filter": {"AC": 1}})
    assert d == FP8 and FP8.to_json() == {"op": "float8", "filter": {"AC": 1}}
    assert FP8.code() == 'pn.float8({"AC": 1})'
    with pytest.raises(pn.PlanError, match="names MB"):
        pn.float8({"MB": 0})
    with pytest.raises(pn.PlanError, match="matches no region"):
        _plan([pn.float8({"L": 9})])
    tiny = pn.models.MegatronGPT(vocab=32, dim=8, layers=1, heads=2, seq=4, p=0.0)
    spec = pn.annotate(tiny, {"embed": {"L": 0}, "blocks.0": {"L": 1}, "head": {"L": 2}})
    with pytest.raises(pn.PlanError, match="multiples of 16"):
        pn.compile(spec, [pn.place({}, [0]), pn.float8({"L": 1})], tiny.example_batch(2, seed=0))


def test_float8_with_tensor_parallelism_prices_but_is_refused_before_training():
    model = _gpt()
    batch = model.example_batch(batch_size=4, seed=0)
    spec = pn.annotate(model, LAYERS)
    plan = pn.compile(spec, [pn.tensor_parallel({}, [0, 1]), FP8], batch)
    assert uses_float8(plan.capture.modules)
    assert pn.simulate(plan, pn.CostModel.analytic(plan, "H100")).step_time > 0
    with pytest.raises(pn.PlanError, match="each shard scaled by its own amax"):
        pn.train(plan, batch, 1, SGD)


def test_a_float8_plan_compiled_again_for_another_batch_keeps_its_float8_linears():
    from piper_nb.compiler.compile import rebatch
    model = _gpt()
    spec = pn.annotate(model, {k: {**v, "PP": 0} for k, v in LAYERS.items()})
    plan = pn.compile(spec, [pn.place({}, [0]), FP8], model.example_batch(4, seed=0))
    again = rebatch(plan, model.example_batch(2, seed=1))
    assert again.batch_size == 2
    assert sum(isinstance(m, Float8Matmul) for r in again.capture.modules
               for m in r.modules()) == 2 * 4
