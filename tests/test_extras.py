"""The core without the extras: with the notebook UI's, the cluster's and TensorBoard's
packages made unimportable (as in an environment with only `pip install piper_nb`),
piper_nb imports, compiles and simulates, and each optional part says in one line which
extra to install. pyproject.toml's extras are the ones `piper_nb.extras` names."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from piper_nb.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]

CORE_ONLY = '''
import importlib.abc, sys
BLOCKED = {blocked!r}
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Absent())
import piper_nb as pn
from piper_nb.metrics import TensorBoardLog
model = pn.models.MLP(dim=8, depth=2)
plan = pn.compile(model, [pn.replicate({{}}, [0, 1], zero=1)], model.example_batch(8, seed=0))
trace = pn.simulate(plan)
print("core ok", plan.world, trace.step_time > 0)
for what, use in [("designer", lambda: pn.Designer(model)), ("figure", trace.figure),
                  ("ipp", lambda: pn.IPyParallelCluster(n=1)),
                  ("tensorboard", lambda: TensorBoardLog("unused"))]:
    try:
        use()
    except pn.extras.MissingExtra as err:
        print(what, "->", err)
assert not any(m.split(".")[0] in BLOCKED for m in sys.modules), "an extra was imported"
'''


def test_the_core_runs_without_the_extras_and_names_each_missing_one():
    blocked = sorted({p for pkgs in EXTRAS.values() for p in pkgs} | {"IPython", "ipykernel"})
    proc = subprocess.run([sys.executable, "-c", CORE_ONLY.format(blocked=blocked)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "core ok 2 True"
    assert lines[1:] == [
        "designer -> pn.Designer needs ipywidgets, which is not installed: pip install 'piper_nb[lab]'",
        "figure -> the timeline figure needs plotly, which is not installed: pip install "
        "'piper_nb[lab]'",
        "ipp -> IPyParallelCluster needs ipyparallel, which is not installed: pip install "
        "'piper_nb[cluster]'",
        "tensorboard -> pn.train(log_dir=...) needs tensorboard, which is not installed: pip "
        "install 'piper_nb[tensorboard]'"]


def test_pyproject_declares_the_core_and_each_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {d.split(">")[0].split("=")[0] for d in project["dependencies"]}
    assert core == {"torch", "numpy", "cloudpickle"}
    extras = project["optional-dependencies"]
    for extra, packages in EXTRAS.items():
        declared = {d.split(">")[0].split("=")[0] for d in extras[extra]}
        assert declared == set(packages), extra
    assert extras["all"] == ["piper_nb[lab,cluster,tensorboard,docs]"]
