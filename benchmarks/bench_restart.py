"""Benchmark: how long a run is stalled when a worker is killed (`pn.train(max_restarts=)`).

TinyGPT (dim 64, 4 layers) as PP 2 x DP 2 ZeRO-1 (1F1B, 4 microbatches) on a
`pn.LocalCluster(4)`, 12 steps, a checkpoint every 4 steps. A progress callback kills
worker 3 with SIGKILL right after step 6 (two steps after the newest checkpoint); the
figure is the time from the kill to the next completed step (the group noticing the
death, starting four new workers, reloading the checkpoint at step 4 and training steps 5
and 6 again, then step 7), beside the median step time of the same run, and the run's
final weights against an uninterrupted run's (same cadence).

    .venv/bin/python benchmarks/bench_restart.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time
import warnings

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


def once(plan, batches, full) -> dict:
    marks: dict[str, float] = {}
    with pn.LocalCluster(4) as cluster, tempfile.TemporaryDirectory() as ckpt:
        def progress(step, steps, metrics):
            now = time.perf_counter()
            if step == KILL_AFTER and "kill" not in marks:
                marks["kill"] = time.perf_counter()
                os.kill(cluster.info[3]["pid"], signal.SIGKILL)
            elif "kill" in marks and "next" not in marks:
                marks["next"] = now

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # the restart's own warning
            got = pn.train(plan, batches, STEPS, pn.optim.AdamW(1e-3), cluster=cluster,
                           progress=progress, checkpoint_dir=ckpt, checkpoint_every=EVERY,
                           max_restarts=1)
    equal = got.losses == full.losses and all(
        torch.equal(got.params[n], w) for n, w in full.params.items())
    return {"kill to next step s": marks["next"] - marks["kill"],
            "median step s": statistics.median(got.step_times), "equal": equal}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plan, batches = _plan()
    with pn.LocalCluster(4) as cluster:
        full = pn.train(plan, batches, STEPS, pn.optim.AdamW(1e-3), cluster=cluster)
    runs = [once(plan, batches, full) for _ in range(args.repeats)]
    stall = statistics.median(r["kill to next step s"] for r in runs)
    step = statistics.median(r["median step s"] for r in runs)
    print(json.dumps({"runs": runs, "kill to next completed step s (median)": round(stall, 2),
                      "median step s": round(step, 4), "stall / step": round(stall / step, 1),
                      "final weights equal to the uninterrupted run": all(
                          r["equal"] for r in runs)}, indent=1))


if __name__ == "__main__":
    main()
