"""Plans byte for byte across a refactor: compile seven programs (PP, ZeRO-3, DP with the
global loss and clipping, TP, TP x DP, PP x TP) and print a digest of each plan's
instructions (their JSON form, which stays flat and exact), buckets, TP fields and loss
settings, and the compile time on stderr. Run on two trees and diff the digests; time the
two with farm-bench in alternating runs.

    .venv/bin/python benchmarks/bench_plan_digest.py [repeats]
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

import piper_nb as pn

torch.set_num_threads(1)
S = pn.schedules


def summed(out, y):
    return ((out - y) ** 2).sum(), (y == y).sum()


def cases():
    mlp = pn.models.MLP(dim=16, depth=4)
    b = mlp.example_batch(batch_size=16, seed=0)
    st = pn.annotate(mlp, {"layers.[0-1]": {"PP": 0}, "layers.[2-3]": {"PP": 1}})
    yield "1f1b", st, [*S.one_f_one_b(2, 4, place=True)], b, {}
    yield "1f1b-clip", st, [*S.one_f_one_b(2, 4, place=True)], b, {"clip_grad_norm": 1.0}
    yield "zb1p-zero3", st, [pn.place({"PP": 0}, [0, 1]), pn.place({"PP": 1}, [2, 3]),
                             pn.replicate({"PP": 0}, [0, 1], zero=3),
                             pn.replicate({"PP": 1}, [2, 3], zero=3), *S.zero_bubble(2, 4)], b, {}
    yield "1f1b-dp-global", st, [pn.place({"PP": 0}, [0, 1]), pn.place({"PP": 1}, [2, 3]),
                                 pn.replicate({"PP": 0}, [0, 1]), pn.replicate({"PP": 1}, [2, 3]),
                                 *S.one_f_one_b(2, 4)], b,\
        {"loss_mean": "global", "loss_fn": summed, "clip_grad_norm": 1.0}
    g = pn.models.TinyGPT(vocab=32, dim=16, layers=2, heads=2, seq=8)
    gb = g.example_batch(batch_size=8, seed=0)
    one = pn.annotate(g, {"": {"PP": 0}})
    yield "tp2", one, [pn.tensor_parallel({}, [0, 1]), pn.split({}, num=2)], gb, {}
    yield "tp2-dp2", one, [pn.tensor_parallel({}, [[0, 1], [2, 3]]),
                           pn.replicate({}, [0, 2], zero=1), pn.split({}, num=2)], gb,\
        {"clip_grad_norm": 0.5}
    sg = pn.annotate(g, pn.cut_stages(g, 2))
    yield "pp2-tp2", sg, [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [2]),
                          pn.tensor_parallel({"PP": 0}, [0, 1]),
                          pn.tensor_parallel({"PP": 1}, [2, 3]), *S.one_f_one_b(2, 2)], gb, {}


reps = int(sys.argv[1]) if len(sys.argv) > 1 else 1
t0 = time.perf_counter()
for name, spec, prog, batch, kw in cases():
    for _ in range(reps):
        plan = pn.compile(spec, prog, batch, **kw)
    h = hashlib.sha1()
    for dp in plan.devices:
        h.update(json.dumps([i.to_json() for i in dp.instrs], sort_keys=True).encode())
    h.update(repr((plan.buckets, plan.tp_groups, sorted(plan.tp_params.items()), plan.loss_scale,
                   plan.clip_grad_norm, plan.loss_mean)).encode())
    print(name, h.hexdigest()[:16])
print(f"compile {time.perf_counter() - t0:.2f}s", file=sys.stderr)
