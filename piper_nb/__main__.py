"""Command line: `python -m piper_nb run STRATEGY.json --model tiny_gpt --devices 4 ...`
(and `python -m piper_nb search ...`, `search_cli`; `python -m piper_nb launch PLAN_DIR`,
one rank of a torchrun or srun job, `launch_cli`).

Builds a small example model (or the user's own: `--model package.module:function`), cuts it
into as many pipeline stages as the strategy's largest `PP` tag + 1 (`pn.cut_stages`; or
`--stages N`, or `--annotations FILE`, a `pn.annotate` mapping in JSON; a model whose
forward calls `pipe_split()` keeps its own cut), prints the cut,
compiles the strategy (Piper's JSON directive list), trains it on local workers next to the
single-process reference, prints a per-step table of both losses, and writes the measured
timeline as a plotly HTML page (one bar per event, one row per device and stream) plus the
trace and the plan (with the cut) as text into `--out`.

Workers start by importing the main module: a user's script that runs this (`main([...])`)
needs `if __name__ == "__main__":`, as every torch.multiprocessing program does.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
from pathlib import Path

__all__ = ["main", "build_model", "load_user_model", "stage_count", "cut_text"]

MODELS = ("tiny_gpt", "mlp", "tiny_moe")
DEFAULT_BATCH_SIZE = 16

MODEL_HELP = (f"a built-in model ({', '.join(MODELS)}) or your own, "
              "'package.module:function': the module is imported with the current directory on "
              "sys.path and the function is called with no arguments; it returns (model, batch) "
              "or (model, batch, loss_fn), where batch is an (inputs, targets) pair of tensors and "
              "loss_fn(output, targets) defaults to model.loss_fn, or a dict of tensors (a Hugging "
              "Face batch: with labels, the model's own loss)")


def build_model(name: str, tied: bool = False):
    import piper_nb as pn
    if name == "tiny_gpt":
        return pn.models.TinyGPT(vocab=64, dim=32, layers=4, heads=2, seq=16, tie_embeddings=tied)
    if name == "mlp":
        return pn.models.MLP(dim=16, depth=4)
    if name == "tiny_moe":
        return pn.models.TinyMoE(vocab=64, dim=32, layers=2, experts=4, top_k=2, seq=16,
                                 tie_embeddings=tied)
    raise SystemExit(f"unknown model {name!r}; choose one of {', '.join(MODELS)} "
                     "or name your own as package.module:function")


_EXPECTED = "(model, batch) or (model, batch, loss_fn)"


def load_user_model(target: str):
    """`package.module:function` -> (model, batch, loss_fn or None); SystemExit on any misfit."""
    import torch
    from torch import nn
    modname, _, attr = target.partition(":")
    if not modname or not attr:
        raise SystemExit(f"--model {target!r}: expected package.module:function")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as err:
        if err.name and (modname == err.name or modname.startswith(err.name + ".")):
            raise SystemExit(f"--model {target!r}: no module named {err.name!r} (looked in the "
                             f"current directory {cwd} and on sys.path)") from None
        raise SystemExit(f"--model {target!r}: importing {modname!r} failed: {err}") from None
    fn = module
    for part in attr.split("."):
        if not hasattr(fn, part):
            raise SystemExit(f"--model {target!r}: module {modname!r} ({module.__file__}) has no "
                             f"{attr!r}") from None
        fn = getattr(fn, part)
    if not callable(fn):
        raise SystemExit(f"--model {target!r}: {attr!r} is not callable ({type(fn).__name__}); "
                         f"name a function returning {_EXPECTED}")
    try:
        inspect.signature(fn).bind()
    except TypeError:
        raise SystemExit(f"--model {target!r}: {attr}{inspect.signature(fn)} must be callable with no "
                         "arguments") from None
    except ValueError:  # no signature (a builtin): just call it
        pass
    got = fn()
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        what = f"a {len(got)}-tuple" if isinstance(got, (tuple, list)) else type(got).__name__
        raise SystemExit(f"--model {target!r}: {attr}() must return {_EXPECTED}, got {what}")
    model, batch, loss_fn = (*got, None) if len(got) == 2 else got
    if not isinstance(model, nn.Module):
        raise SystemExit(f"--model {target!r}: {attr}() must return {_EXPECTED} with a "
                         f"torch.nn.Module first, got {type(model).__name__}")
    named = isinstance(batch, dict) and batch and all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in batch.items())
    if not named and not (isinstance(batch, (tuple, list)) and len(batch) == 2
                          and all(isinstance(t, torch.Tensor) for t in batch)):
        raise SystemExit(f"--model {target!r}: {attr}() must return {_EXPECTED} with batch an "
                         "(inputs, targets) pair of tensors or a dict of tensors, got "
                         f"{_describe(batch)}")
    if not named and loss_fn is None and not callable(getattr(model, "loss_fn", None)):
        raise SystemExit(f"--model {target!r}: {type(model).__name__} has no loss_fn method; "
                         f"return (model, batch, loss_fn) with loss_fn(output, targets) -> scalar")
    if loss_fn is not None and not callable(loss_fn):
        raise SystemExit(f"--model {target!r}: {attr}() must return {_EXPECTED} with "
                         f"loss_fn(output, targets) callable, got {type(loss_fn).__name__}")
    return model, batch, loss_fn


def _describe(batch) -> str:
    if isinstance(batch, dict):
        return "a dict of (" + ", ".join(f"{k}: {type(v).__name__}" for k, v in batch.items()) + ")"
    if isinstance(batch, (tuple, list)):
        return f"a {len(batch)}-{type(batch).__name__} of ({', '.join(type(t).__name__ for t in batch)})"
    return type(batch).__name__


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


def _cut(args, model, program, batch) -> dict:
    """The annotation mapping: `--annotations FILE`, or `pn.cut_stages` into `--stages` (by
    default the strategy's own count of stages), in the order the forward runs; none for a
    model whose forward calls `pipe_split()` (its own cut)."""
    import piper_nb as pn
    from piper_nb.capture.annotate import split_count
    if args.annotations:
        try:
            cut = json.loads(Path(args.annotations).read_text())
        except json.JSONDecodeError as err:
            raise SystemExit(f"--annotations {args.annotations}: not JSON ({err})") from None
        if not isinstance(cut, dict) or not all(isinstance(t, dict) for t in cut.values()):
            raise SystemExit(f"--annotations {args.annotations}: expected a mapping from module "
                             'patterns to tags, e.g. {"layers.[0-1]": {"PP": 0}, ...}')
        return cut
    splits = split_count(model, batch)
    if splits:
        if args.stages and args.stages != splits + 1:
            calls = f"{splits} pipe_split() call{'s' if splits > 1 else ''}"
            raise SystemExit(f"--stages {args.stages}: the model's forward makes {calls}, so "
                             f"it has {splits + 1} stages; drop --stages")
        return {}
    return pn.cut_stages(model, args.stages or stage_count(program), example=batch)


def cut_text(cut: dict) -> str:
    """One line per tag combination: the tags, then the module patterns that carry them."""
    by: dict[str, list[str]] = {}
    for pattern, tags in cut.items():
        key = ",".join(f"{k}={v}" for k, v in tags.items()) or "(no tags)"
        by.setdefault(key, []).append(pattern or "(the whole model)")
    return "\n".join(f"  {k}: {', '.join(v)}" for k, v in by.items())


def _run(args) -> int:
    import torch

    import piper_nb as pn
    from piper_nb import optim
    from piper_nb.cluster.local import LocalCluster
    from piper_nb.train import reference_train, train
    torch.manual_seed(0)
    program = pn.Program.from_json(Path(args.strategy).read_text())
    if ":" in args.model:
        model, batch, loss_fn = load_user_model(args.model)
    else:
        model, loss_fn = build_model(args.model, args.tied), None
        batch = model.example_batch(batch_size=args.batch_size or DEFAULT_BATCH_SIZE, seed=0)
    cut = _cut(args, model, program, batch)
    print("the cut:\n" + (cut_text(cut) or "  the model's own pipe_split() calls"))
    plan = pn.compile(pn.annotate(model, cut), program, batch, world=args.devices,
                      loss_fn=loss_fn, loss_mean=args.loss_mean)
    opt = optim.AdamW(args.lr) if args.optimizer == "adamw" else optim.SGD(args.lr, momentum=0.9)
    with LocalCluster(args.devices) as cluster:
        result = train(plan, batch, args.steps, opt, cluster=cluster)
    # the one process a plan equals: one mean per (microbatch, replica) slice of the batch
    ref = reference_train(model, batch, args.steps, plan.reference_microbatches, opt,
                          loss_fn=loss_fn, loss_mean=plan.loss_mean)
    print(f"{'step':>4}  {'loss':>12}  {'reference':>12}  {'|diff|':>9}  {'time ms':>8}")
    for s, (a, b, t) in enumerate(zip(result.losses, ref.losses, result.step_times, strict=True)):
        print(f"{s + 1:>4}  {a:>12.6f}  {b:>12.6f}  {abs(a - b):>9.2e}  {t * 1e3:>8.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result.trace.figure().write_html(out / "timeline.html")
    (out / "trace.json").write_text(result.trace.to_json())
    (out / "plan.txt").write_text(plan.grid(waits=True) + "\n\n# the cut (a pn.annotate mapping)\n"
                                  + json.dumps(cut, indent=1) + "\n")
    (out / "losses.json").write_text(json.dumps({"losses": result.losses,
                                                 "reference": ref.losses,
                                                 "step_times": result.step_times}))
    print(f"wrote {out / 'timeline.html'}, trace.json, plan.txt, losses.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m piper_nb",
                                     description="Compile and run a piper_nb strategy, or "
                                                 "search for one.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train a strategy on local workers",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("strategy", help="JSON list of directives (Piper's format)")
    run.add_argument("--model", default="tiny_gpt", metavar="NAME|MODULE:FUNCTION", help=MODEL_HELP)
    run.add_argument("--tied", action="store_true", help="tie the embeddings (built-in GPT models)")
    cut = run.add_mutually_exclusive_group()
    cut.add_argument("--stages", type=int, default=argparse.SUPPRESS,
                     help="cut the model into this many stages (pn.cut_stages, in the order its "
                          "forward runs); by default as many as the strategy's PP tags")
    cut.add_argument("--annotations", metavar="FILE", default=argparse.SUPPRESS,
                     help="a pn.annotate mapping in JSON instead of a cut, e.g. "
                          '{"layers.[0-1]": {"PP": 0}, "layers.[2-3]": {"PP": 1}}')
    run.add_argument("--devices", type=int, default=2, help="local worker processes")
    run.add_argument("--steps", type=int, default=5, help="training steps")
    run.add_argument("--batch-size", type=int, default=argparse.SUPPRESS,
                     help=f"batch of a built-in model (default: {DEFAULT_BATCH_SIZE}); a user "
                          "function returns its own batch")
    run.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw",
                     help="SGD with momentum 0.9, or AdamW")
    run.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    run.add_argument("--loss-mean", choices=("microbatch", "global"), default="microbatch",
                     help="what a step minimises: the mean of the microbatches' mean losses, "
                          "or the loss over the whole batch (token mean)")
    run.add_argument("--out", default="piper_nb_out",
                     help="folder for timeline.html, trace.json, plan.txt and losses.json")
    from piper_nb import launch_cli, search_cli
    search = search_cli.add_parser(sub, MODEL_HELP, MODELS)
    launch_cli.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "search":
        return search_cli.run(args, search, build_model, load_user_model)
    if args.command == "launch":
        return launch_cli.run(args)
    for name in ("stages", "annotations", "batch_size"):   # given, or None
        setattr(args, name, getattr(args, name, None))
    if args.stages is not None and args.stages < 1:
        run.error(f"--stages {args.stages}: give a positive number of stages")
    if ":" in args.model:
        for flag, given in (("--batch-size", args.batch_size is not None), ("--tied", args.tied)):
            if given:
                run.error(f"{flag} applies to the built-in models only; {args.model} builds its own")
    elif args.model not in MODELS:
        run.error(f"--model {args.model!r}: choose one of {', '.join(MODELS)} or name your own "
                  "as package.module:function")
    from piper_nb.errors import PlanError, RuntimeFailure
    try:
        return _run(args)
    except (PlanError, RuntimeFailure, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
