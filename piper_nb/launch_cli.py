"""Command line: `python -m piper_nb launch PLAN_DIR --steps N`, one rank of a batch job.

`torchrun --nproc-per-node 4 -m piper_nb launch plan/ --steps 100` or, in a Slurm
allocation, `srun python -m piper_nb launch plan/ --steps 100`: every rank reads the plan
directory `plan.save` wrote (`pn.load_plan`), checks that the job's world size is the
plan's device count before any process group is made, and trains with `pn.train` on a
`cluster.job.JobRank` (its own device's plan, the same runtime a notebook's workers run).
Every rank draws the same batches: the batch saved with the plan, or `--data
package.module:function`, which returns a batch or a loader.

Rank 0 prints a line per step and writes into `--out`: `metrics.jsonl` (a JSON object per
step: loss, step time, tokens/s, samples/s, learning rate, gradient norm), TensorBoard
event files (`tensorboard/`) and, after the last step, the trained weights (`weights.pt`,
full tensors by parameter name). With `--checkpoint-dir`, rank 0 checkpoints there
(`pn.train`'s DCP checkpoints) and every rank starts from the newest one, so a job that
torchrun starts again after a rank fails (`--max-restarts N`), or a resubmitted job,
continues the run. `launch --max-restarts N` outside any job starts that torchrun job on
this machine itself.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

__all__ = ["add_parser", "run"]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("launch", help="run as one rank of a torchrun or srun job",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("plan", help="the plan directory plan.save wrote (on a shared filesystem)")
    p.add_argument("--steps", type=int, required=True, help="training steps")
    p.add_argument("--data", metavar="MODULE:FUNCTION", default=None,
                   help="a function returning a batch or a loader (imported with the current "
                        "directory on sys.path); default: the batch saved with the plan")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cpu (gloo) or cuda (NCCL, the GPU of LOCAL_RANK / SLURM_LOCALID)")
    p.add_argument("--out", default="piper_nb_launch",
                   help="rank 0's folder for metrics.jsonl, tensorboard/ and weights.pt")
    p.add_argument("--checkpoint-dir", default=None,
                   help="rank 0 checkpoints there (on a shared filesystem); every rank "
                        "resumes from the newest one, so torchrun --max-restarts N (or a "
                        "rerun of the job) continues the run")
    p.add_argument("--checkpoint-every", type=int, default=None,
                   help="steps between checkpoints (default 1)")
    p.add_argument("--max-restarts", type=int, default=None, metavar="N",
                   help="after a rank fails, start every rank again from the newest "
                        "checkpoint, at most N times (needs --checkpoint-dir). Run outside "
                        "a job, launch starts one on this machine itself (torchrun "
                        "--standalone, a rank per device of the plan); under torchrun, "
                        "give torchrun the same --max-restarts")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds the rendezvous and each step may take")
    return p


def run(args) -> int:
    from piper_nb.cluster.job import JobEnv, JobRank
    from piper_nb.errors import PlanError, RuntimeFailure
    from piper_nb.train import train
    try:
        env = _restarts(args, JobEnv)
        saved = _load(args.plan, env)
        data = _data(args.data) if args.data else None
        out = Path(args.out)
        log = _Log(out, args.checkpoint_dir is not None) if env.rank == 0 else None
        with JobRank(env, device=args.device, timeout=args.timeout) as cluster:
            result = train(saved.plan, _batch(saved, data), args.steps, saved.optimizer,
                           cluster, log_dir=None if log is None else out / "tensorboard",
                           progress=None if log is None else log.step,
                           checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every,
                           resume=args.checkpoint_dir is not None, **saved.settings)
        if log is not None:
            log.finish(result)
    except (PlanError, RuntimeFailure, OSError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def _restarts(args, job_env):
    """This rank's `JobEnv`, after checking `--max-restarts` against the launcher; outside
    any job with `--max-restarts`, this process becomes torchrun starting the job."""
    from piper_nb.errors import PlanError
    n = args.max_restarts
    if n is None:
        return job_env.read()
    if n < 0:
        raise PlanError(f"--max-restarts {n}: give a number of restarts, 0 or more")
    if args.checkpoint_dir is None:
        raise PlanError("--max-restarts needs --checkpoint-dir: a restarted job resumes "
                        "from the newest checkpoint there (on a filesystem every rank sees)")
    try:
        env = job_env.read()
    except PlanError:
        _become_torchrun(args)               # returns only when the plan cannot be read
        from piper_nb.plan.files import load_plan
        load_plan(args.plan)                 # which says why
        raise
    agent = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if env.launcher == "srun":
        raise PlanError(f"--max-restarts {n}: srun restarts no ranks; requeue or resubmit "
                        "the job (sbatch --requeue): with --checkpoint-dir it resumes from "
                        "the newest checkpoint")
    if agent is not None and int(agent) != n:
        raise PlanError(f"--max-restarts {n}, but torchrun was started with --max-restarts "
                        f"{agent}: torchrun restarts its ranks, so give it --max-restarts {n}")
    return env


def _become_torchrun(args) -> None:
    """Replace this process with `torchrun --standalone --nproc-per-node <the plan's
    devices> --max-restarts N -m piper_nb launch ...` (the same arguments)."""
    devices = _devices(args.plan)
    if not isinstance(devices, int):
        return                                 # load_plan says what is wrong
    flags = ["--steps", str(args.steps), "--device", args.device, "--out", args.out,
             "--checkpoint-dir", args.checkpoint_dir, "--timeout", str(args.timeout),
             "--max-restarts", str(args.max_restarts)]
    flags += ["--data", args.data] if args.data else []
    if args.checkpoint_every is not None:
        flags += ["--checkpoint-every", str(args.checkpoint_every)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(devices), "--max-restarts", str(args.max_restarts), "-m", "piper_nb",
           "launch", str(args.plan), *flags]
    print(f"piper_nb launch: starting {devices} ranks: {' '.join(cmd[1:])}", flush=True)
    os.execv(sys.executable, cmd)


def _devices(directory: str):
    """The device count the plan directory's manifest gives (None when it cannot be read:
    `load_plan` says what is wrong with the directory)."""
    from piper_nb.plan.files import MANIFEST
    try:
        return json.loads((Path(directory) / MANIFEST).read_text()).get("devices")
    except (OSError, ValueError, AttributeError):
        return None


def _load(directory: str, env):
    """The saved plan, after its manifest says the job has the plan's device count."""
    from piper_nb.errors import PlanError
    from piper_nb.plan.files import load_plan
    devices = _devices(directory)
    if devices is not None and devices != env.world:
        raise PlanError(f"{directory}: the plan runs on {devices} devices and this "
                        f"{env.launcher} job has {env.world} ranks; launch {devices} "
                        f"processes (torchrun --nproc-per-node, srun --ntasks)")
    return load_plan(directory)


def _batch(saved, data):
    """What every rank trains on: `--data`'s batch or loader, else the saved batch."""
    from piper_nb.errors import PlanError
    if data is None and saved.batch is None:
        raise PlanError(f"{saved.path}: the plan was saved without a batch; save it with "
                        "plan.save(path, optimizer, batch=...), or pass --data "
                        "package.module:function")
    if saved.optimizer is None:
        raise PlanError(f"{saved.path}: the plan was saved without an optimizer; save it "
                        "with plan.save(path, optimizer)")
    return saved.batch if data is None else data


def _data(target: str):
    from piper_nb.errors import PlanError
    modname, _, attr = target.partition(":")
    if not modname or not attr:
        raise PlanError(f"--data {target!r}: name a function as package.module:function")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        fn = getattr(importlib.import_module(modname), attr)
    except (ImportError, AttributeError) as err:
        raise PlanError(f"--data {target!r}: {err}") from None
    return fn()


class _Log:
    """Rank 0's record of the run: a line per step, metrics.jsonl, the final weights."""

    def __init__(self, out: Path, resumes: bool):
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.t0 = out, time.monotonic()
        # a resumed job appends (the steps after its checkpoint appear twice, the later last)
        self.file = open(out / "metrics.jsonl", "a" if resumes else "w")

    def step(self, s: int, steps: int, m) -> None:
        row = {"step": s, "loss": m.loss, "step_time": m.step_time,
               "tokens_per_s": m.tokens_per_s, "samples_per_s": m.samples_per_s, "lr": m.lr,
               "grad_norm": m.grad_norm, **{k: float(v) for k, v in m.metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        print(f"step {s}/{steps}  {m.text()}", flush=True)

    def finish(self, result) -> None:
        import torch
        self.file.close()
        torch.save(result.params, self.out / "weights.pt")
        print(f"done: {len(result.losses)} steps in {time.monotonic() - self.t0:.1f} s; wrote "
              f"{self.out / 'metrics.jsonl'}, tensorboard/, weights.pt", flush=True)

