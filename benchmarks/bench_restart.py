"""Benchmark: how long a run is stalled when a worker is killed (`pn.train(max_restarts=)`).

TinyGPT (dim 64, 4 layers) as PP 2 x DP 2 ZeRO-1 (1F1B, 4 microbatches), 12 steps, a DCP
checkpoint every 4 steps; one of the four workers is killed with SIGKILL right after step
6 (two steps after the newest checkpoint). The figure is the time from the kill to the
next completed step (the group noticing the death, starting new workers, reloading the
checkpoint at step 4 and training step 5 again), beside the median step time, and the
run's final weights against an uninterrupted run's (same cadence). `--cluster`:

- `local`: `pn.LocalCluster(4)`, worker 3's process killed;
- `ipp`: `pn.IPyParallelCluster(4)` (engines it starts), engine 3 killed, and replaced;
- `torchrun`: `python -m piper_nb launch PLAN --max-restarts 1` (torchrun over 4 ranks),
  rank 3 killed; the steps are read from rank 0's metrics.jsonl as it appends them.

    .venv/bin/python benchmarks/bench_restart.py [--cluster local|ipp|torchrun] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

import piper_nb as pn

STEPS, EVERY, KILL_AFTER = 12, 4, 6


def _plan():
    torch.manual_seed(0)
    model = pn.models.TinyGPT(vocab=64, dim=64, layers=4, heads=4, seq=32)
    batches = [model.example_batch(batch_size=16, seed=s) for s in range(STEPS)]
    plan = pn.compile(pn.annotate(model, pn.cut_stages(model, 2)), [
        pn.place({"PP": 0}, [0, 2]), pn.place({"PP": 1}, [1, 3]),
        pn.replicate({"PP": 0}, [0, 2], zero=1), pn.replicate({"PP": 1}, [1, 3], zero=1),
        *pn.schedules.one_f_one_b(2, 4)], batches[0])
    return plan, batches


def once(plan, batches, full, kind: str) -> dict:
    if kind == "torchrun":
        return _torchrun(plan, batches, full)
    marks: dict[str, float] = {}
    made = pn.LocalCluster(4) if kind == "local" else pn.IPyParallelCluster(4)
    with made as cluster, tempfile.TemporaryDirectory() as ckpt:
        victim = "pid" if kind == "local" else "engine_pid"

        def progress(step, steps, metrics):
            now = time.perf_counter()
            if step == KILL_AFTER and "kill" not in marks:
                marks["kill"] = time.perf_counter()
                os.kill(cluster.info[3][victim], signal.SIGKILL)
            elif "kill" in marks and "next" not in marks:
                marks["next"] = now

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # the restart's own warning
            got = pn.train(plan, batches, STEPS, pn.optim.AdamW(1e-3), cluster=cluster, seed=0,
                           progress=progress, checkpoint_dir=ckpt, checkpoint_every=EVERY,
                           max_restarts=1)
    equal = got.losses == full.losses and all(
        torch.equal(got.params[n], w) for n, w in full.params.items())
    return {"kill to next step s": marks["next"] - marks["kill"],
            "median step s": statistics.median(got.step_times), "equal": equal}


def _torchrun(plan, batches, full) -> dict:
    """`launch --max-restarts 1` in a subprocess; rank 3 killed once step 6 is logged."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        path = plan.save(tmp / "plan", pn.optim.AdamW(1e-3), batch=batches[0], seed=0)
        metrics = tmp / "out" / "metrics.jsonl"
        job = subprocess.Popen(
            [sys.executable, "-m", "piper_nb", "launch", str(path), "--steps", str(STEPS),
             "--out", str(tmp / "out"), "--checkpoint-dir", str(tmp / "ckpt"),
             "--checkpoint-every", str(EVERY), "--max-restarts", "1"],
            env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=tmp,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            rows = _rows(metrics, KILL_AFTER, job, time.monotonic() + 300)
            kill = time.perf_counter()
            os.kill(_ranks(job.pid)[3], signal.SIGKILL)
            _rows(metrics, rows + 1, job, time.monotonic() + 300)
            stall = time.perf_counter() - kill
            job.wait(timeout=300)
        finally:
            job.kill()
        weights = torch.load(tmp / "out" / "weights.pt", weights_only=True)
        logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {"kill to next step s": stall,
            "median step s": statistics.median(r["step_time"] for r in logged),
            "equal": job.returncode == 0 and all(torch.equal(weights[n], w)
                                                 for n, w in full.params.items())}


def _rows(path: Path, at_least: int, job, deadline: float) -> int:
    while time.monotonic() < deadline and job.poll() is None:
        n = len(path.read_text().splitlines()) if path.exists() else 0
        if n >= at_least:
            return n
        time.sleep(0.01)
    raise RuntimeError(f"the job logged fewer than {at_least} steps (exit {job.poll()})")


def _ranks(pid: int) -> list[int]:
    """torchrun's ranks: the live processes whose parent is its agent, `pid`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cluster", choices=("local", "ipp", "torchrun"), default="local")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plan, batches = _plan()
    if args.cluster == "torchrun":
        batches = [batches[0]] * STEPS        # launch trains on the batch saved with the plan
    with pn.LocalCluster(4) as cluster:
        full = pn.train(plan, batches, STEPS, pn.optim.AdamW(1e-3), cluster=cluster, seed=0)
    runs = [once(plan, batches, full, args.cluster) for _ in range(args.repeats)]
    stall = statistics.median(r["kill to next step s"] for r in runs)
    step = statistics.median(r["median step s"] for r in runs)
    print(json.dumps({"cluster": args.cluster, "runs": runs,
                      "kill to next completed step s (median)": round(stall, 2),
                      "median step s": round(step, 4), "stall / step": round(stall / step, 1),
                      "final weights equal to the uninterrupted run": all(
                          r["equal"] for r in runs)}, indent=1))


if __name__ == "__main__":
    main()
