"""Training as users train: torch.optim optimizers with parameter groups, a warmup-then-cosine
schedule and global gradient clipping, under every kind of plan, equal to `reference_train`,
which is itself checked against the plain PyTorch loop written out here."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch

import piper_nb as pn
from piper_nb import strategies
from piper_nb.compiler.clip import with_grad_clipping
from piper_nb.strategies import PP2_DP2_ZERO3, compile_strategy
from piper_nb.train import reference_train, train

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
NO_DECAY = [{"params": ["*norm*", "*ln*", "*.bias"], "weight_decay": 0.0}]
CLIP = 0.05   # the tiny models' norms are ~0.1-1: every step clips


def warmup_cosine(opt, warmup: int = 2, total: int = 6):
    """Linear warmup then cosine decay, as torchtitan and nanoGPT schedule it."""
    return torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup)],
        milestones=[warmup])


RECIPE = {"param_groups": NO_DECAY, "lr_scheduler": warmup_cosine, "clip_grad_norm": CLIP}


def test_reference_train_is_the_plain_pytorch_loop():
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=2, heads=2, seq=16)
    batch = model.example_batch(batch_size=8, seed=0)
    ref = reference_train(model, batch, 3, 2, ADAMW, **RECIPE)
    twin = copy.deepcopy(model)
    plain = lambda n: n.endswith(".bias") or "ln" in n or "norm" in n   # noqa: E731
    decay = [p for n, p in twin.named_parameters() if not plain(n)]
    rest = [p for n, p in twin.named_parameters() if plain(n)]
    opt = torch.optim.AdamW([{"params": rest, "weight_decay": 0.0}, {"params": decay}],
                            lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    sched = warmup_cosine(opt)
    losses, norms, lrs = [], [], []
    for _ in range(3):
        opt.zero_grad()
        total = 0.0
        for x, y in zip(batch[0].chunk(2), batch[1].chunk(2), strict=True):
            loss = model.loss_fn(twin(x), y) / 2
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(twin.parameters(), CLIP)))
        lrs.append(opt.param_groups[-1]["lr"])
        opt.step()
        sched.step()
        losses.append(total)
    assert rest and ref.losses == pytest.approx(losses, rel=1e-6)
    assert ref.grad_norms == pytest.approx(norms, rel=1e-6) and min(norms) > CLIP
    assert ref.lrs == pytest.approx(lrs) and lrs[0] < lrs[1]       # warming up
    for k, v in twin.state_dict().items():
        torch.testing.assert_close(ref.state_dict()[k], v)


def _pp2_dp2(zero: int):
    model, batch = strategies._gpt("test")
    program = [dict(d, zero=zero) if d["op"] == "replicate" else d for d in PP2_DP2_ZERO3]
    return pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), program, batch), batch


PLANS = {
    "pp2-1f1b": lambda: compile_strategy("1f1b"),
    **{f"pp2-dp2-zero{z}": functools.partial(_pp2_dp2, z) for z in (1, 2, 3)},
    "dualpipev": lambda: compile_strategy("dualpipev"),
    "tied-embeddings": lambda: compile_strategy("tied-embeddings"),
    "pp2-dp2-ep2": lambda: compile_strategy("pp2-dp2-ep2"),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", PLANS)
def test_the_recipe_trains_like_the_reference_under_every_plan(name, cluster2, cluster4, same):
    plan, batch = PLANS[name]()
    result = train(plan, batch, 3, ADAMW, cluster=cluster2 if plan.world == 2 else cluster4,
                   seed=0, **RECIPE)
    ref = reference_train(plan.capture.model, batch, 3, plan.microbatches, ADAMW, **RECIPE)
    same(result, ref, plan.capture.model)
    # each parameter counted once: tied weights, DualPipe's two copies, replicas, shards
    assert result.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
    assert min(ref.grad_norms) > CLIP and result.lrs == pytest.approx(ref.lrs)


ELEMENTWISE = {
    "SGD": functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=0.01),
    "Adam": functools.partial(torch.optim.Adam, lr=1e-2),
    "AdamW": ADAMW,
    "Adagrad": functools.partial(torch.optim.Adagrad, lr=1e-2),
    "RMSprop": functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5),
    "Adamax": functools.partial(torch.optim.Adamax, lr=1e-2),
    "NAdam": functools.partial(torch.optim.NAdam, lr=1e-2),
    "RAdam": functools.partial(torch.optim.RAdam, lr=1e-2),
}


@pytest.mark.dist
@pytest.mark.parametrize("opt", ELEMENTWISE)
def test_element_wise_optimizers_equal_the_reference_at_every_zero_level(opt, cluster2, same):
    for zero in range(4):
        plan, batch = compile_strategy(f"zero{zero}")
        result = train(plan, batch, 2, ELEMENTWISE[opt], cluster=cluster2, seed=0,
                       param_groups=[{"params": "*.bias", "weight_decay": 0.0}])
        ref = reference_train(plan.capture.model, batch, 2, plan.microbatches, ELEMENTWISE[opt],
                              param_groups=[{"params": "*.bias", "weight_decay": 0.0}])
        same(result, ref, plan.capture.model)


@pytest.mark.dist
def test_an_optimizer_that_is_not_element_wise_needs_whole_parameters(cluster2, same):
    adafactor = functools.partial(torch.optim.Adafactor, lr=1e-2)
    plan, batch = compile_strategy("zero1")
    with pytest.raises(pn.PlanError, match=r"Adafactor keeps factored row and column statistics"
                                           r".*ZeRO-1 shards of bucket 0.*zero=0"):
        train(plan, batch, 2, adafactor, cluster=cluster2)
    plan, batch = compile_strategy("1f1b")       # whole parameters on each stage
    result = train(plan, batch, 2, adafactor, cluster=cluster2, seed=0)
    same(result, reference_train(plan.capture.model, batch, 2, plan.microbatches, adafactor),
         plan.capture.model)


def test_clipping_is_an_all_reduce_before_the_updates_that_the_tools_see():
    model, batch = strategies._gpt("test")
    spec, program = pn.annotate(model, pn.cut_stages(model, 2)), PP2_DP2_ZERO3
    plan = pn.compile(spec, program, batch)
    clipped = pn.compile(spec, program, batch, clip_grad_norm=1.0)
    assert clipped.clip_grad_norm == 1.0 and plan.clip_grad_norm is None
    assert pn.Plan.from_json(clipped.to_json()).clip_grad_norm == 1.0
    for dp in clipped.devices:
        first_u = next(k for k, i in enumerate(dp.instrs) if i.kind == "U")
        norm, wait = dp.instrs[first_u - 2:first_u]
        assert (norm.kind, norm.purpose, norm.data.group) == ("ALL_REDUCE", "norm", (0, 1, 2, 3))
        assert (wait.kind, wait.data.target) == ("WAIT", first_u - 2)
        later = [i for i in dp.instrs[first_u:] if i.kind in ("B", "BW", "REDUCE_SCATTER")]
        assert later == []    # every gradient is final before the norm
    trace = pn.simulate(clipped, pn.CostModel.uniform())
    assert sum(e.label == str(norm) for e in trace.events) == clipped.world
    assert trace.step_time >= pn.simulate(plan, pn.CostModel.uniform()).step_time


def test_every_matrix_plan_passes_the_static_checks_with_clipping():
    for name in strategies.MATRIX:
        plan, _ = compile_strategy(name)
        assert with_grad_clipping(plan, 1.0).clip_grad_norm == 1.0   # checked inside
    with pytest.raises(pn.PlanError, match="positive number"):
        with_grad_clipping(plan, math.nan)


@pytest.mark.dist
def test_metrics_reach_progress_and_tensorboard_and_resume_with_the_schedule(cluster2, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    plan, batch = compile_strategy("tied-embeddings")     # TinyGPT: batches of token ids
    seen = []
    result = train(plan, batch, 4, ADAMW, cluster=cluster2, seed=0, log_dir=tmp_path / "tb",
                   progress=lambda s, n, m: seen.append((s, n, m)), **RECIPE)
    assert [(s, n) for s, n, _ in seen] == [(s, 4) for s in range(1, 5)]
    assert [m for _, _, m in seen] == result.metrics
    m = result.metrics[-1]
    assert m.loss == result.losses[-1] and m.step_time == result.step_times[-1]
    assert m.samples_per_s == pytest.approx(batch[0].shape[0] / m.step_time)
    assert m.tokens_per_s == pytest.approx(batch[0].numel() / m.step_time)   # token ids
    assert "grad norm" in m.text() and "tok/s" in m.text()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    for name in ("loss", "grad_norm", "lr", "samples_per_s", "tokens_per_s", "step_time"):
        scalars = events.Scalars(f"train/{name}")
        assert [e.step for e in scalars] == [1, 2, 3, 4]
        assert [e.value for e in scalars] == pytest.approx(
            [getattr(x, name) for x in result.metrics], rel=1e-6)
    # killed after step 2 and resumed: the schedule and the optimizer carry on exactly
    ck = tmp_path / "ck"
    train(plan, batch, 2, ADAMW, cluster=cluster2, seed=0, checkpoint_dir=ck, **RECIPE)
    resumed = train(plan, batch, 4, ADAMW, cluster=cluster2, seed=0, checkpoint_dir=ck,
                    resume=True, **RECIPE)
    assert resumed.losses == result.losses and resumed.lrs == result.lrs   # every step's
    for k, v in result.state_dict().items():
        assert torch.equal(resumed.state_dict()[k], v), k


@pytest.mark.dist
def test_the_trained_model_loads_into_its_own_class(cluster2):
    plan, batch = compile_strategy("tied-embeddings")
    result = train(plan, batch, 2, ADAMW, cluster=cluster2, seed=0)
    fresh = pn.models.TinyGPT(**plan.capture.model.config)
    fresh.load_state_dict(result.state_dict())     # strict: every key, tied names included
    assert fresh.head.proj.weight is fresh.embed.tok.weight
    out = fresh(batch[0])
    ref = reference_train(plan.capture.model, batch, 2, plan.microbatches, ADAMW)
    twin = copy.deepcopy(plan.capture.model)
    twin.load_state_dict(ref.state_dict())
    torch.testing.assert_close(out, twin(batch[0]), rtol=1e-5, atol=1e-5)
