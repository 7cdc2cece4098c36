"""The one table of constants per GPU (`sim.gpus`): every shipped number says where it comes
from, and no benchmark that checks the analytic model against a measured run passes a
constant of its own (a per-run efficiency would be fitted to the run it predicts)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from piper_nb.sim import HARDWARE, HardwareSpec, Topology
from piper_nb.sim.topology import TOPOLOGY_SOURCES

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# what a benchmark could tune: every rate and fraction of the model and of the topology
TUNABLE = ({f.name for f in dataclasses.fields(HardwareSpec)} - {"name", "memory", "sources"}) \
    | ({f.name for f in dataclasses.fields(Topology)} - {"name", "gpus_per_node"})


def test_every_shipped_gpu_sources_each_number():
    for name, hw in HARDWARE.items():
        sources = dict(hw.sources)
        sources |= dict(TOPOLOGY_SOURCES)
        assert TUNABLE - {"node_size", "nvlink_bandwidth", "network_bandwidth"} <= \
            set(sources) | {"memory"}, name
        assert all(len(text) > 20 for text in sources.values()), name


@pytest.mark.parametrize("bench", [
    "bench_published.py", "published.py", "bench_analytic.py"])
def test_a_benchmark_passes_the_model_no_constant_of_its_own(bench):
    tree = ast.parse((BENCHMARKS / bench).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = ast.unparse(node.func)
            assert not called.endswith("HardwareSpec"), f"{bench}:{node.lineno} builds a GPU"
            tuned = {k.arg for k in node.keywords} & TUNABLE
            assert not tuned, f"{bench}:{node.lineno} sets {sorted(tuned)}"
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            assert node.attr not in TUNABLE, f"{bench}:{node.lineno} sets {node.attr}"


def test_the_check_catches_a_tuned_efficiency():
    """The test above can fail: a benchmark replacing an efficiency is caught."""
    src = "import dataclasses\nhw = dataclasses.replace(HARDWARE['H100'], matmul_efficiency=0.4)\n"
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call)]
    assert any({k.arg for k in c.keywords} & TUNABLE for c in calls)
