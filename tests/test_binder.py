"""The Binder (repo2docker) environment installs piper_nb itself.

repo2docker installs binder/requirements.txt into the kernel's environment (before the rest of
the repository is copied in, when the file names no local path), then runs ./binder/postBuild
from the repository root. The slow test replays that second half for real: a copy of the
repository as git would ship it, a fresh virtual environment whose dependencies are this
environment's (requirements.txt's part, already installed), and postBuild run as repo2docker
runs it; afterwards the fresh environment imports piper_nb from the copy.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"


def _requirements() -> list[str]:
    lines = (BINDER / "requirements.txt").read_text().splitlines()
    return [ln.split("#", 1)[0].strip() for ln in lines if ln.split("#", 1)[0].strip()]


def _is_local(line: str) -> bool:
    """repo2docker's test (utils.is_local_pip_requirement): a local path or -r/-c reference."""
    if line.startswith(("-r", "-c", "--requirement", "--constraint")):
        return True
    if line.startswith("--") and "=" in line:
        line = line.split("=", 1)[1]
    elif line.startswith("-"):
        rest = line.split(None, 1)[1:]
        if not rest:
            return False
        line = rest[0]
    if "file://" in line:
        return True
    return line.split("://", 1)[-1].startswith(".")


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].lower().replace("_", "-")


def test_requirements_name_no_local_path_and_cover_the_package_dependencies():
    reqs = _requirements()
    assert not [r for r in reqs if _is_local(r)], "local paths make repo2docker skip its cache; " \
                                                  "binder/postBuild installs piper_nb"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pinned = {_name(r): r.replace(" ", "") for r in reqs if not r.startswith("-")}
    extras = project["optional-dependencies"]
    # postBuild installs with --no-deps: the core and the extras the notebooks use must be here
    for dep in [*project["dependencies"], *extras["lab"], *extras["cluster"], *extras["tensorboard"]]:
        assert _name(dep) in pinned, f"{dep} is missing from binder/requirements.txt"
    assert pinned["torch"] == "torch==2.13.0"
    assert '"torch==2.13.0"' in (ROOT / "Makefile").read_text()
    assert "torch>=2.13" in project["dependencies"]   # the range the CPU pin satisfies
    assert any(r.startswith("--extra-index-url") and "whl/cpu" in r for r in reqs)


def test_runtime_python_satisfies_requires_python():
    runtime = (BINDER / "runtime.txt").read_text().strip()
    major, minor = (int(x) for x in runtime.removeprefix("python-").split(".")[:2])
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = re.fullmatch(r">=\s*3\.(\d+)", requires)
    assert low and major == 3 and minor >= int(low.group(1)), (runtime, requires)


def test_postbuild_installs_the_package_and_is_executable():
    text = (BINDER / "postBuild").read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    assert re.search(r"-m pip install [^\n]*--no-deps[^\n]* -e \.$", text, re.M)
    assert os.access(BINDER / "postBuild", os.X_OK)
    if shutil.which("git") and (ROOT / ".git").exists():
        staged = subprocess.run(["git", "ls-files", "-s", "binder/postBuild"], cwd=ROOT,
                                capture_output=True, text=True).stdout
        assert not staged or staged.startswith("100755"), "git must keep postBuild executable"


def _shipped_files() -> list[str]:
    """What a clone would hold: tracked plus untracked-but-not-ignored files."""
    if not (shutil.which("git") and (ROOT / ".git").exists()):
        pytest.skip("needs git to list the repository's files")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout.decode()
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


@pytest.mark.extended
@pytest.mark.timeout(180)
def test_postbuild_makes_piper_nb_importable_in_a_fresh_environment(tmp_path):
    repo = tmp_path / "repo"
    for rel in _shipped_files():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, repo / rel)
    assert not (repo / ".venv").exists()

    venv = tmp_path / "kernel"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    # requirements.txt's part is done: lend the fresh environment this one's packages. A .pth
    # line adds the folder only (its own .pth files, this checkout's editable install among
    # them, are not read), so piper_nb itself can only come from what postBuild installs.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    deps = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (Path(site) / "zz_binder_test_deps.pth").write_text("\n".join(deps) + "\n")

    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "KERNEL_PYTHON_PREFIX", "NB_PYTHON_PREFIX", "PYTHONHOME")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PIP_RETRIES="0", PIP_DISABLE_PIP_VERSION_CHECK="1")
    # pip builds the editable wheel in an isolated environment with the build backend
    # (hatchling). Fetch it once, from whatever pip is configured with (a local mirror
    # here); then postBuild itself runs with no index at all.
    wheels = tmp_path / "wheels"
    # (hatchling asks for `editables` too when it builds an editable wheel)
    backend = tomllib.loads((repo / "pyproject.toml").read_text())["build-system"]["requires"]
    backend = [*backend, "editables"]
    got = subprocess.run([str(py), "-m", "pip", "download", "-q", "--dest", str(wheels), *backend],
                         env={**env, "PIP_DEFAULT_TIMEOUT": "10"}, capture_output=True, text=True,
                         timeout=120)
    if got.returncode:
        pytest.skip(f"cannot fetch the build backend {backend} without a network: "
                    f"{got.stderr.strip()[-300:]}")
    env.update(PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels))

    proc = subprocess.run(["./binder/postBuild"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "piper_nb ready" in proc.stdout

    elsewhere = tmp_path / "notebooks_dir"
    elsewhere.mkdir()
    check = ("import importlib.metadata as md, json, piper_nb\n"
             "from piper_nb.ui.widgets import asset_dir\n"
             "print(json.dumps({'file': piper_nb.__file__, 'version': md.version('piper_nb'),\n"
             "                  'assets': str(asset_dir()),\n"
             "                  'model': type(piper_nb.models.MLP(dim=8, depth=2)).__name__}))\n")
    out = subprocess.run([str(py), "-c", check], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["file"], "piper_nb imported as a bare namespace: postBuild did not install it"
    assert Path(info["file"]) == repo / "piper_nb" / "__init__.py"
    assert Path(info["assets"]) == repo / "widgets"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert info["version"] == project["version"] and info["model"] == "MLP"
