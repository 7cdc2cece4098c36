"""Command line: `python -m piper_nb run STRATEGY.json --model tiny_gpt --devices 4 ...`.

Builds a small example model, cuts it into as many pipeline stages as the strategy's
largest `PP` tag + 1 (`pn.cut_stages`), compiles the strategy (Piper's JSON directive list),
trains it on local workers next to the single-process reference, prints a per-step table of
both losses, and writes the measured timeline as a plotly HTML page (one bar per event, one
row per device and stream) plus the trace and the plan as text into `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main", "build_model", "stage_count"]

MODELS = ("tiny_gpt", "mlp", "tiny_moe")


def build_model(name: str, tied: bool = False):
    import piper_nb as pn
    if name == "tiny_gpt":
        return pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=tied)
    if name == "mlp":
        return pn.models.MLP(dim=16, depth=4)
    if name == "tiny_moe":
        return pn.models.TinyMoE(vocab=64, dim=32, layers=2, experts=4, top_k=2, seq=16,
                                 tie_embeddings=tied)
    raise SystemExit(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def stage_count(program) -> int:
    """The largest PP index any filter of the (expanded) program names, plus one."""
    from piper_nb.compiler.compile import expand
    top = 0
    for _, d in expand(program):
        filters = [f for g in d.groups for f in g] if hasattr(d, "groups") else [d.filter]
        for f in filters:
            if isinstance(f.get("PP"), int):
                top = max(top, f["PP"])
    return top + 1


def _run(args) -> int:
    import torch

    import piper_nb as pn
    from piper_nb import optim
    from piper_nb.cluster.local import LocalCluster
    from piper_nb.train import reference_train, train
    torch.manual_seed(0)
    program = pn.Program.from_json(Path(args.strategy).read_text())
    model = build_model(args.model, args.tied)
    batch = model.example_batch(batch_size=args.batch_size, seed=0)
    spec = pn.annotate(model, pn.cut_stages(model, stage_count(program)))
    plan = pn.compile(spec, program, batch, world=args.devices)
    opt = optim.AdamW(args.lr) if args.optimizer == "adamw" else optim.SGD(args.lr, momentum=0.9)
    with LocalCluster(args.devices) as cluster:
        result = train(plan, batch, args.steps, opt, cluster=cluster)
    ref = reference_train(model, batch, args.steps, plan.microbatches, opt)
    print(f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'|diff|':>9}  {'time ms':>8}")
    for s, (a, b, t) in enumerate(zip(result.losses, ref.losses, result.step_times, strict=True)):
        print(f"{s + 1:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>9.2e}  {t * 1e3:>8.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.trace.figure().write_html(out / "timeline.html")
    (out / "trace.json").write_text(result.trace.to_json())
    (out / "plan.txt").write_text(plan.grid(waits=True) + "\n")
    (out / "losses.json").write_text(json.dumps({"losses": result.losses,
                                                 "reference": ref.losses,
                                                 "step_times": result.step_times}))
    print(f"wrote {out / 'timeline.html'}, trace.json, plan.txt, losses.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m piper_nb",
                                     description="Compile and run a piper_nb strategy.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train a strategy on local workers")
    run.add_argument("strategy", help="JSON list of directives (Piper's format)")
    run.add_argument("--model", choices=MODELS, default="tiny_gpt")
    run.add_argument("--tied", action="store_true", help="tie the embeddings (GPT models)")
    run.add_argument("--devices", type=int, default=2)
    run.add_argument("--steps", type=int, default=5)
    run.add_argument("--batch-size", type=int, default=16)
    run.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw")
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--out", default="piper_nb_out")
    args = parser.parse_args(argv)
    from piper_nb.errors import PlanError, RuntimeFailure
    try:
        return _run(args)
    except (PlanError, RuntimeFailure, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
