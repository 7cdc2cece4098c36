"""Any last batch: a loader's batch of another size (40 samples in batches of 16: 16, 16,
8) trains on the same program compiled once for its size, from the same parameters and
optimizer state, equal to the single-process reference; with drop_last=True it is skipped
(as the reference skips it); a size the microbatches cannot split is refused with the way
out. The user is told which, once per size."""

from __future__ import annotations

import pytest
import torch

import piper_nb as pn

pytestmark = pytest.mark.dist


def setup(zero: int = 0):
    torch.manual_seed(0)
    model = pn.models.MLP(dim=8, depth=4)
    spec = pn.annotate(model, pn.cut_stages(model, 2))
    x, y = torch.randn(40, 8), torch.randn(40, 8)
    loader = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 40, 16)]      # 16, 16, 8
    program = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
               pn.replicate({"PP": 0}, [0, 2], zero=zero),
               pn.replicate({"PP": 1}, [1, 3], zero=zero),
               *pn.schedules.one_f_one_b(ranks=2, microbatches=4)]
    return model, pn.compile(spec, program, loader[0]), loader


def same(got, ref):
    torch.testing.assert_close(torch.tensor(got.losses), torch.tensor(ref.losses), rtol=1e-5,
                               atol=1e-7)
    theirs = ref.state_dict()
    for k, v in got.state_dict().items():
        torch.testing.assert_close(v, theirs[k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("zero", [0, 3])
def test_a_smaller_last_batch_trains_on_the_program_compiled_for_it(zero, cluster4):
    model, plan, loader = setup(zero)
    opt = pn.optim.AdamW(lr=1e-2)
    with pytest.warns(UserWarning, match="a batch of 8 samples .* compiled once for this size"):
        got = pn.train(plan, loader, steps=3, optimizer=opt, cluster=cluster4)
    assert len(got.losses) == 3 and got.skipped == []
    same(got, pn.reference_train(model, loader, steps=3, microbatches=4, optimizer=opt))


def test_drop_last_skips_it_as_the_reference_does(cluster4):
    model, plan, loader = setup()
    opt = pn.optim.AdamW(lr=1e-2)
    with pytest.warns(UserWarning, match="a batch of 8 samples .* is skipped"):
        got = pn.train(plan, loader, steps=3, optimizer=opt, cluster=cluster4, drop_last=True)
    assert len(got.losses) == 2 and got.skipped == [3]
    ref = pn.reference_train(model, loader, steps=3, microbatches=4, optimizer=opt,
                             drop_last=True)
    assert ref.skipped == [3]
    same(got, ref)


def test_a_size_the_microbatches_cannot_split_is_refused_with_the_way_out(cluster4):
    _, plan, loader = setup()
    odd = [loader[0], (loader[2][0][:6], loader[2][1][:6])]
    with pytest.raises(pn.PlanError, match="step 2: a batch of 6 samples .* drop_last=True"):
        pn.train(plan, odd, steps=2, optimizer=pn.optim.SGD(lr=0.1), cluster=cluster4)
