"""Routed rows: an expert plan knows which sizes the routing decides, and how.

TinyMoE (top-1 over two experts) compiled as PP 2 x DP 2 x EP 2: every value that carries
an expert's tokens has a symbol for its first dimension, and every region's saved bytes are
an affine function of those symbols that reproduces the captured figure, and a real run at
another row count (or what it saves of the rows are its routed outputs, counted as values).
"""

from __future__ import annotations

import torch

from piper_nb.compiler.shapes import param_ptrs
from piper_nb.plan.plan import Plan
from piper_nb.plan.sizes import SavedBytes
from piper_nb.plan.token_rows import captured_rows, saved_at
from piper_nb.strategies import compile_strategy


def _plan():
    return compile_strategy("pp2-dp2-ep2")[0]


def test_routed_values_share_their_experts_symbol():
    plan = _plan()
    dispatched = [v for dp in plan.devices for i in dp.instrs
                  if i.kind == "ALL_TO_ALL" and i.purpose == "dispatch" and not i.data.grad
                  for v in i.data.values]
    symbols = {plan.rows[v] for v in dispatched}
    assert len(symbols) == len(set(dispatched)) == 4  # 2 blocks x 2 experts, one each
    for v, s in plan.rows.items():                    # indices, weights, expert outputs
        assert s in symbols and plan.values[v].shape[0] == captured_rows(plan.rows,
                                                                         plan.values)[s]
    dense = {"add_1", "add_2", "inputs", "targets", "loss"}
    assert not dense & set(plan.rows)


def test_saved_bytes_reproduce_the_captured_figure():
    plan = _plan()
    hints = captured_rows(plan.rows, plan.values)
    # every MoE block region: its own saved bytes follow the rows, or (the router's region)
    # what it saves of the rows is its routed outputs, value buffers sized by the routing
    routed_out = {r for r, (_, outs) in plan.kept.items() if set(outs) & set(plan.rows)}
    assert set(plan.saved_rows) | routed_out == {r.index for r in plan.regions}
    assert not set(plan.saved_rows) & routed_out
    for r, coef in plan.saved_rows.items():
        assert all(c > 0 for c in coef.values())
        assert saved_at(plan.saved[r], coef, hints, hints) == plan.saved[r]


def test_an_experts_saved_bytes_follow_its_rows():
    """Run expert 0 of block 0 for real on 3 rows and on 40: the bytes autograd saves are
    what the plan's per-row figure says."""
    plan = _plan()
    hints = captured_rows(plan.rows, plan.values)
    region = next(r for r in plan.regions if dict(r.tags).get("EP") == 0)
    (value,) = region.inputs
    symbol = plan.rows[value]
    module = plan.capture.modules[region.index]
    for rows in (3, 40):
        x = torch.randn(rows, plan.values[value].shape[1], requires_grad=True)
        with SavedBytes(param_ptrs(plan.capture) | {x.untyped_storage().data_ptr()}) as c:
            module(x)
        want = saved_at(plan.saved[region.index], plan.saved_rows[region.index],
                        {symbol: rows}, hints)
        assert c.bytes == want


def test_rows_survive_the_json_form_and_dense_plans_have_none():
    plan = _plan()
    back = Plan.from_json(plan.to_json())
    assert back.rows == plan.rows and back.saved_rows == plan.saved_rows
    dense = compile_strategy("1f1b")[0]
    assert dense.rows == {} and dense.saved_rows == {}
