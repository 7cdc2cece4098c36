"""What the global-batch loss costs a step: the same plans with `loss_mean="microbatch"` and
`loss_mean="global"` (one more all-reduce, `count:AR`, before the updates, and a division
of every gradient by the count), interleaved step by step on one cluster.

    .venv/bin/python benchmarks/bench_global_loss.py            # MLP 8 x 256, batch 2048
    .venv/bin/python benchmarks/bench_global_loss.py --quick
"""

from __future__ import annotations

import argparse
import statistics

import torch

import piper_nb as pn
from piper_nb.cluster.local import LocalCluster


def squared_error(out, y):
    return torch.nn.functional.mse_loss(out, y)


def squared_error_sum(out, y):
    """The same loss in the global form: (sum, count)."""
    return (out - y).square().sum(), (y == y).sum()


CASES = {
    "1F1B x2": lambda: pn.schedules.one_f_one_b(2, 8, place=True),
    "replicate zero=0 x2": lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1]),
                                    pn.split({}, "MB", 8)],
    "replicate zero=3 x2": lambda: [pn.place({}, [0, 1]), pn.replicate({}, [0, 1], zero=3),
                                    pn.split({}, "MB", 8)],
}


def run(dim: int, depth: int, batch_size: int, steps: int) -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    model = pn.models.MLP(dim=dim, depth=depth)
    batch = model.example_batch(batch_size=batch_size, seed=0)
    rows = []
    with LocalCluster(2) as cluster:
        for name, program in CASES.items():
            annotation = (pn.cut_stages(model, 2) if name.startswith("1F1B")
                          else {"layers": {"PP": 0}})
            spec = pn.annotate(model, annotation)
            plans = {"microbatch": pn.compile(spec, program(), batch, loss_fn=squared_error),
                     "global": pn.compile(spec, program(), batch, loss_fn=squared_error_sum,
                                          loss_mean="global")}
            times: dict[str, list[float]] = {k: [] for k in plans}
            for plan in plans.values():
                cluster.reset(plan, pn.optim.SGD(0.01))
            for s in range(steps + 2):
                for k, plan in plans.items():
                    outs = cluster.step(plan, batch, trace=False)
                    if s >= 2:   # warm-up
                        times[k].append(max(o["end"] for o in outs))
            a, b = statistics.median(times["microbatch"]), statistics.median(times["global"])
            rows.append((name, a * 1e3, b * 1e3))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dim, depth, bsz, steps = (128, 4, 512, 10) if args.quick else (256, 8, 2048, 30)
    print(f"MLP {depth} x {dim}, batch {bsz}, 8 microbatches, SGD, gloo on CPU, 2 workers; "
          f"median of {steps} interleaved steps after 2 warm-up")
    print("| case | microbatch mean ms | global loss ms | ratio |")
    print("|---|---|---|---|")
    for name, a, b in run(dim, depth, bsz, steps):
        print(f"| {name} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
