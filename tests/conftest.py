"""Fixtures every tier shares: one local cluster of 2 and one of 4 workers per session
(spawning costs seconds; plans larger than 2 devices run on the 4), and `one_thread`.

The shared clusters run NCCL's semantics on CPU (`comm="nccl-emulated"`): every test that
trains on them (the pipeline equivalence tests among them) runs the plan's stream program
as a GPU would, so a plan that would hang under NCCL fails here. `pn.train` without a
cluster, and the clusters tests make for themselves, run gloo natively. `same` compares a
run with `pn.reference_train`.

Three tiers. `make test-all` (`pytest --tier all`, and plain `pytest`) runs every test.
`make test` (CI, `--tier test`) leaves out the tests marked `extended`: a proof repeated on
another launcher or a fault injected again (ipyparallel's fault tests, which LocalCluster's
make too; torchrun's restart, a repeating fault's give-up; binder's fresh environment).
`make check` (`--tier check`) is the loop of editing: every test that runs in this process,
and of each test that starts workers (marked `dist`, `cluster` or `browser`) only its first
case: the other cases of such a cross product (every family x every strategy, the fuzz
tier's seeds) repeat its proof on other inputs; tests marked `full` (a whole build, a
browser, a slow negative control) run only in `make test`. `pytest --collect-only -q --tier
check` lists what a check runs."""

from __future__ import annotations

import pytest
import torch

from piper_nb.cluster.local import LocalCluster

RTOL, ATOL = 1e-5, 4e-5
WORKERS = ("dist", "cluster", "browser")   # markers of tests that start processes


def pytest_addoption(parser):
    parser.addoption("--tier", choices=("check", "test", "all"), default="all",
                     help="check: the fast tier of `make check`; test: what `make test` and "
                          "CI run (all but `extended`); all: everything, `make test-all` "
                          "(see tests/conftest.py)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under `--tier test`, leave out `extended` tests; under `--tier check`, `full` ones
    too and the repeated cases of tests that start workers (runs before `-m`/`-k` select,
    so they compose)."""
    tier = config.getoption("--tier")
    if tier == "all":
        return
    seen, keep, left = set(), [], []
    for item in items:
        starts = any(item.get_closest_marker(m) for m in WORKERS)
        case = getattr(item, "originalname", item.name), item.path
        repeat = tier == "check" and starts and hasattr(item, "callspec") and case in seen
        seen.add(case)
        out = item.get_closest_marker("extended") or (
            tier == "check" and item.get_closest_marker("full"))
        (left if repeat or out else keep).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep


def assert_same(result, ref, model=None) -> None:
    """Losses and every parameter equal to the reference's (fp32 rounding), nothing leaked."""
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(ref.losses),
                               rtol=RTOL, atol=ATOL)
    got, want = result.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert result.leftover == []
    if model is not None:  # training really moved the parameters
        init = model.state_dict()
        assert any(not torch.equal(init[k], got[k]) for k in init)


@pytest.fixture
def same():
    """`same(result, ref, model=None)`: see `assert_same`."""
    return assert_same


@pytest.fixture(scope="session")
def cluster2():
    with LocalCluster(2, comm="nccl-emulated") as cluster:
        yield cluster


@pytest.fixture(scope="session")
def cluster4():
    with LocalCluster(4, comm="nccl-emulated") as cluster:
        yield cluster


@pytest.fixture
def one_thread():
    """The driver's reference runs beside the workers on few cores: keep it to one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def coupled_program(plan):
    """`plan`'s stream program as piper_nb's runtime issued it before the stream program
    existed (the negative control): one CUDA stream per logical stream name (`pp`, `dp`),
    which first waits for the compute stream, issues the op, and then waits for it (its
    `on_stream` called `work.wait()` inside `torch.cuda.stream(s)`). So every op on `pp`
    completes after the one before it, whatever its communicator."""
    from piper_nb.ir.kinds import COMM
    from piper_nb.plan.streams import (
        COMPUTE_STREAM,
        DeviceStreams,
        Launch,
        Step,
        StreamProgram,
        comm_stream,
        communicator,
    )
    devices = {}
    for dp in plan.devices:
        out = []
        for x in plan.streams()[dp.device].launches:
            ins = dp.instrs[x.instr] if x.instr >= 0 else None
            if ins is None or ins.kind not in COMM or x.step == Step.SYNC or \
                    x.step == Step.EXCHANGE:
                out.append(x)
                continue
            if x.step != Step.COMM:
                continue   # the launches are rewritten whole, at its COMM
            k, s, comm = x.instr, ins.stream, communicator(dp.device, ins)
            out += [Launch(Step.RECORD, COMPUTE_STREAM, k, f"c{k}"),
                    Launch(Step.WAIT, s, k, f"c{k}"), Launch(Step.RECORD, s, k, f"i{k}"),
                    Launch(Step.WAIT, comm_stream(comm), k, f"i{k}"),
                    Launch(Step.COMM, comm_stream(comm), k, comm=comm),
                    Launch(Step.RECORD, comm_stream(comm), k, f"d{k}"),
                    Launch(Step.WAIT, s, k, f"d{k}")]
        streams = {x.stream for x in out if x.step not in (Step.SYNC, Step.EXCHANGE)}
        ends = [x for x in out if x.step == Step.SYNC and x.instr == -1]
        out = [x for x in out if x not in ends]
        out += [Launch(Step.SYNC, s, -1) for s in sorted(streams, key=lambda s: (s != "compute", s))]
        devices[dp.device] = DeviceStreams(dp.device, tuple(out), dp.instrs)
    program = StreamProgram(plan, devices)
    return program


@pytest.fixture
def coupled():
    """`coupled(plan)`: the old `on_stream` coupling written as a stream program."""
    return coupled_program
