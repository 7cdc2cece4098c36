"""Plans as files and batch jobs: `plan.save`, `pn.load_plan`, and `python -m piper_nb
launch` as every rank of a real `torchrun` job and of an emulated `srun` one (Slurm's
variables set by hand), each training equal to `pn.reference_train`."""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import piper_nb as pn
from piper_nb import schedules as S
from piper_nb.cluster.job import JobEnv, first_host
from piper_nb.cluster.local import LocalCluster
from piper_nb.host import free_port
from piper_nb.plan import files

STEPS = 3
OPT = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
HALVES = {"embed": {"PP": 0}, "blocks.0": {"PP": 0}, "blocks.1": {"PP": 0},
          "blocks.2": {"PP": 1}, "blocks.3": {"PP": 1}, "head": {"PP": 1}}


def _gpt(tied: bool = False):
    torch.manual_seed(0)
    model = pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=tied)
    return model, model.example_batch(batch_size=8, seed=0)


def _saved(tmp_path, program, tied: bool = False, with_batch: bool = True):
    model, batch = _gpt(tied)
    plan = pn.compile(pn.annotate(model, HALVES), program, batch)
    path = plan.save(tmp_path / "plan", OPT, batch=batch if with_batch else None, seed=0)
    return model, batch, plan, path


PP2_DP2_ZERO3 = [pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
                 pn.replicate({"PP": 0}, [0, 2], zero=3),
                 pn.replicate({"PP": 1}, [1, 3], zero=3), *S.one_f_one_b(2, 2)]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1", **extra}


def _equal_to_reference(model, batch, plan, out) -> None:
    ref = pn.reference_train(model, batch, STEPS, plan.reference_microbatches, OPT)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    torch.testing.assert_close([r["loss"] for r in rows], ref.losses, rtol=1e-5, atol=0)
    weights = torch.load(out / "weights.pt", weights_only=True)
    assert weights.keys() == ref.params.keys()
    for name, w in ref.params.items():
        torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-6)


def test_torchrun_trains_a_pp2_dp2_zero3_plan_equal_to_one_process(tmp_path):
    model, batch, plan, path = _saved(tmp_path, PP2_DP2_ZERO3)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "-m", "piper_nb", "launch", str(path), "--steps", str(STEPS), "--out", str(out)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sum(line.startswith("step ") for line in done.stdout.splitlines()) == STEPS  # rank 0
    assert any(p.name.startswith("events") for p in (out / "tensorboard").iterdir())
    _equal_to_reference(model, batch, plan, out)


def test_an_srun_job_trains_a_pp2_plan_equal_to_one_process(tmp_path):
    """The plan saved without a batch; every rank draws it from `--data`, the user's
    function (importable from the job's working directory)."""
    model, batch, plan, path = _saved(tmp_path, S.one_f_one_b(2, 4, place=True),
                                      with_batch=False)
    (tmp_path / "mydata.py").write_text(
        "import piper_nb as pn\n\n\ndef batch():\n    return pn.models.TinyGPT(vocab=64, "
        "dim=32, layers=4, heads=2, seq=16).example_batch(batch_size=8, seed=0)\n")
    out, port = tmp_path / "out", free_port()
    cmd = [sys.executable, "-m", "piper_nb", "launch", str(path), "--steps", str(STEPS),
           "--out", str(out), "--data", "mydata:batch"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=_env(
                                  SLURM_PROCID=str(r), SLURM_NTASKS="2", SLURM_LOCALID=str(r),
                                  SLURM_JOB_NODELIST="localhost", MASTER_PORT=str(port)))
        for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "done: 3 steps" in outs[0] and "step " not in outs[1]
    _equal_to_reference(model, batch, plan, out)


def test_a_rank_that_fails_stops_the_job_naming_itself_and_never_hangs(tmp_path):
    _, _, _, path = _saved(tmp_path, PP2_DP2_ZERO3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "4", "-m", "piper_nb", "launch", str(path), "--steps", str(STEPS), "--timeout", "600"]
    done = subprocess.run(cmd, env=_env(PIPER_NB_FAIL_AT="1:r1:B0"), capture_output=True,
                          text=True, timeout=240, cwd=tmp_path)
    assert done.returncode != 0
    said = done.stdout + done.stderr
    assert "error: step 1: rank 1 failed at instruction r1:B0 during step" in said, said
    assert "injected failure" in said and not (tmp_path / "piper_nb_launch" / "weights.pt").exists()


@pytest.mark.extended
def test_launch_max_restarts_restarts_a_killed_rank_and_resumes_from_its_checkpoint(tmp_path):
    """`launch --max-restarts 1` outside a job becomes `torchrun --max-restarts 1` over the
    plan's 4 devices. SIGKILL of one rank mid-run (after step 12 of 40, checkpoints every 5
    steps): torchrun starts every rank again, each resumes from the newest checkpoint, and
    the job ends with the weights of an uninterrupted run."""
    model, batch, plan, path = _saved(tmp_path, PP2_DP2_ZERO3)
    out, ckpt, steps = tmp_path / "out", tmp_path / "ckpt", 40
    cmd = [sys.executable, "-m", "piper_nb", "launch", str(path), "--steps", str(steps),
           "--out", str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
           "--max-restarts", "1"]
    job = subprocess.Popen(cmd, env=_env(), cwd=tmp_path,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and _logged(out) < 12:
            time.sleep(0.02)
        assert 12 <= _logged(out) < steps, "the job did not run long enough to be killed"
        ranks = _children(job.pid)
        assert len(ranks) == 4
        os.kill(ranks[1], signal.SIGKILL)
        said = job.communicate(timeout=240)[0]
    finally:
        job.kill()
    assert job.returncode == 0, said
    assert "done: " in said and not any(pid in _children(job.pid) for pid in ranks)
    with LocalCluster(4) as cluster:                # the same cadence, never killed
        full = pn.train(plan, batch, steps, OPT, cluster=cluster)
    weights = torch.load(out / "weights.pt", weights_only=True)
    for name, w in full.params.items():
        assert torch.equal(weights[name], w), name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == steps and len(rows) > steps     # some steps trained twice
    assert {r["step"]: r["loss"] for r in rows} == dict(enumerate(full.losses, 1))
    assert all(r["loss"] == full.losses[r["step"] - 1] for r in rows)


def _logged(out) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except FileNotFoundError:
        return 0


def _children(pid: int) -> list[int]:
    """The live processes whose parent is `pid`, in pid order."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return sorted(found)


@pytest.mark.parametrize("flags, env, said", [
    (["--max-restarts", "2"], {}, "--max-restarts needs --checkpoint-dir"),
    (["--max-restarts", "2", "--checkpoint-dir", "ck"],
     {"RANK": "0", "WORLD_SIZE": "4", "TORCHELASTIC_MAX_RESTARTS": "0"},
     "torchrun was started with --max-restarts 0: .* give it --max-restarts 2"),
    (["--max-restarts", "2", "--checkpoint-dir", "ck"],
     {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n1"},
     "srun restarts no ranks; requeue or resubmit"),
])
def test_max_restarts_that_cannot_work_is_refused_before_any_process_group(tmp_path, flags,
                                                                           env, said):
    _, _, _, path = _saved(tmp_path, PP2_DP2_ZERO3)
    done = subprocess.run([sys.executable, "-m", "piper_nb", "launch", str(path), "--steps",
                           "2", *flags], env=_env(**env), cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and re.search(said, done.stderr), done.stderr


def test_a_job_of_the_wrong_size_is_refused_before_any_process_group(tmp_path):
    _, _, _, path = _saved(tmp_path, PP2_DP2_ZERO3)
    done = subprocess.run([sys.executable, "-m", "piper_nb", "launch", str(path), "--steps",
                           "1"], env=_env(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                          MASTER_PORT="1"), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2
    assert "runs on 4 devices and this torchrun job has 2 ranks" in done.stderr
    assert "launch 4 processes" in done.stderr


def test_a_saved_plan_trains_as_the_plan_did_with_tied_weights_still_tied(tmp_path):
    _, batch, plan, path = _saved(tmp_path, S.one_f_one_b(2, 2, place=True), tied=True)
    saved = pn.load_plan(path)
    model = saved.plan.capture.model
    assert model.head.proj.weight is model.embed.tok.weight
    assert saved.settings["seed"] == 0 and saved.plan.world == 2
    with pn.LocalCluster(2) as cluster:
        again = pn.train(saved.plan, saved.batch, STEPS, saved.optimizer, cluster,
                         **saved.settings)
        first = pn.train(plan, batch, STEPS, OPT, cluster=cluster, seed=0)
    assert again.losses == first.losses
    for name, w in first.params.items():
        assert torch.equal(again.params[name], w), name


def test_the_weights_load_as_tensors_only(tmp_path):
    _, _, _, path = _saved(tmp_path, S.one_f_one_b(2, 2, place=True))
    tensors = torch.load(path / files.WEIGHTS, weights_only=True)
    assert tensors and all(isinstance(t, torch.Tensor) for t in tensors.values())
    with pytest.raises(pickle.UnpicklingError, match="persistent"):   # by reference only
        pickle.loads((path / files.CODE).read_bytes())


@pytest.mark.parametrize("damage, match", [
    (lambda p: (p / files.WEIGHTS).write_bytes((p / files.WEIGHTS).read_bytes()[:1000]),
     r"weights\.pt is 1000 bytes, the manifest says \d+: truncated or corrupted"),
    (lambda p: (p / files.CODE).write_bytes(b"x" + (p / files.CODE).read_bytes()[1:]),
     r"plan\.pkl does not match the manifest's SHA-256"),
    (lambda p: (p / files.MANIFEST).write_text("{"), r"manifest\.json is corrupted"),
    (lambda p: (p / files.CODE).unlink(), r"plan\.pkl is missing"),
    (lambda p: _edit(p, piper_nb="0.1.0"), r"saved by piper_nb 0\.1\.0 and this is piper_nb"),
    (lambda p: _edit(p, torch="1.13.1"), r"saved with torch 1\.13\.1 and this is torch "),
    (lambda p: _edit(p, format=99), r"plan format 99, and this piper_nb .* reads format 1"),
])
def test_a_damaged_or_foreign_plan_directory_is_a_clear_error(tmp_path, damage, match):
    _, _, _, path = _saved(tmp_path, S.one_f_one_b(2, 2, place=True))
    damage(path)
    with pytest.raises(pn.PlanError, match=match):
        pn.load_plan(path)


def _edit(path, **changes) -> None:
    manifest = json.loads((path / files.MANIFEST).read_text())
    (path / files.MANIFEST).write_text(json.dumps({**manifest, **changes}))


def test_saving_replaces_a_plan_directory_and_nothing_else(tmp_path):
    _, _, plan, path = _saved(tmp_path, S.one_f_one_b(2, 2, place=True))
    assert plan.save(path, OPT) == path and pn.load_plan(path).batch is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan"]      # nothing left aside
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(pn.PlanError, match="holds no plan"):
        plan.save(mine)
    assert (mine / "notes.txt").read_text() == "keep me"
    with pytest.raises(pn.PlanError, match="not a plan directory"):
        pn.load_plan(mine)


def test_the_job_environment_of_torchrun_and_slurm():
    env = JobEnv.read({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3",
                       "MASTER_ADDR": "n1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world, env.local_rank, env.host, env.port, env.launcher) == (
        3, 8, 3, "n1", 1234, "torchrun")
    env = JobEnv.read({"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1",
                       "SLURM_JOB_NODELIST": "gpu[003-010,017],cpu1"})
    assert (env.rank, env.world, env.local_rank, env.host, env.port, env.launcher) == (
        9, 16, 1, "gpu003", 29500, "srun")
    assert first_host("node7") == "node7" and first_host("a[1,4-5]") == "a1"
    with pytest.raises(pn.PlanError, match="start it with torchrun"):
        JobEnv.read({})
    with pytest.raises(pn.PlanError, match="RANK='x' is not an integer"):
        JobEnv.read({"RANK": "x", "WORLD_SIZE": "2"})
