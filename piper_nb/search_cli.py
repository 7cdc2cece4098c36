"""Command line: `python -m piper_nb search --model tiny_gpt --devices 4 --hardware H100`.

Searches the plans of a built-in model, a published Llama 3 shape on the meta device
(`llama3-8b`, `llama3-70b`, `llama3-405b`: sequence 8192, vocabulary 128,256) or the user's
own (`package.module:function`, as `run` takes it) over `--devices` devices with
`pn.search`, prints the top rows sorted by a column, and writes the best candidate's program
as Piper JSON (`--out`) with its stage cut beside it (`.annotations.json`), which
`python -m piper_nb run OUT --annotations ...` trains.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "run", "LLAMA3"]

LLAMA3 = {"llama3-8b": dict(dim=4096, heads=32, kv_heads=8, hidden=14336, layers=32),
          "llama3-70b": dict(dim=8192, heads=64, kv_heads=8, hidden=28672, layers=80),
          "llama3-405b": dict(dim=16384, heads=128, kv_heads=8, hidden=53248, layers=126)}
SORTS = ("step", "tokens", "memory", "bubble")


def add_parser(sub, model_help: str, builtin: tuple[str, ...]) -> argparse.ArgumentParser:
    p = sub.add_parser("search", help="find the plans that fit, ranked by predicted step time",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny_gpt", metavar="NAME|MODULE:FUNCTION",
                   help=model_help + f"; or a Llama 3 shape on the meta device ({', '.join(LLAMA3)})")
    p.add_argument("--devices", type=int, required=True, help="devices the plan runs on")
    p.add_argument("--hardware", default="H100", help="the GPU (a name in pn.sim.HARDWARE)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node holds (TP stays inside)")
    p.add_argument("--batch-size", type=int, default=argparse.SUPPRESS,
                   help="sequences a step trains on (default: 16; a Llama shape, 2 per device)")
    p.add_argument("--pin", action="append", default=[], metavar="KNOB=VALUE[,VALUE]",
                   help="fix a knob, e.g. --pin tp=8 --pin schedule=1f1b,interleaved "
                        "(knobs: pp, tp, dp, zero, schedule, microbatches, recompute, sp, float8, "
                        "every)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=argparse.SUPPRESS,
                   help="the compile's precision (default: bf16 analytic, fp32 profiled)")
    p.add_argument("--cost", choices=("analytic", "profile"), default="analytic",
                   help="the cost model: the GPU's analytic one, or profiled on this CPU")
    p.add_argument("--verify", type=int, default=5, help="candidates compiled and simulated")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes that probe and estimate (default: one per core)")
    p.add_argument("--top", type=int, default=10, help="rows printed")
    p.add_argument("--sort", choices=SORTS, default="step", help="the column rows sort by")
    p.add_argument("--out", default="search_best.json", help="the best program (Piper JSON)")
    p.set_defaults(builtin=builtin)
    return p


def _pins(items: list[str], parser) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value:
            parser.error(f"--pin {item!r}: write KNOB=VALUE, e.g. --pin tp=8")
        vals = []
        for v in value.split(","):
            low = v.strip().lower()
            vals.append(int(low) if low.isdigit() else {"true": True, "false": False}.get(low, low))
        out[key.strip()] = vals if len(vals) > 1 else vals[0]
    return out


def _model(args, build_model, load_user_model):
    import torch

    import piper_nb as pn
    if args.model in LLAMA3:
        with torch.device("meta"):
            model = pn.models.Llama(vocab=128256, seq=8192, attention="flash",
                                    **LLAMA3[args.model])
            ids = torch.zeros(args.batch_size or 2 * args.devices, 8192, dtype=torch.long)
        return model, (ids, ids), None
    if ":" in args.model:
        return load_user_model(args.model)
    model = build_model(args.model)
    return model, model.example_batch(batch_size=args.batch_size or 16, seed=0), None


def run(args, parser, build_model, load_user_model) -> int:
    """Search, print the table, write the best program; 2 on a PlanError."""
    import piper_nb as pn
    from piper_nb.errors import PlanError
    args.batch_size = getattr(args, "batch_size", None)
    if args.model not in (*args.builtin, *LLAMA3) and ":" not in args.model:
        parser.error(f"--model {args.model!r}: choose one of {', '.join((*args.builtin, *LLAMA3))} "
                     "or name your own as package.module:function")
    pins = _pins(args.pin, parser)
    model, batch, loss_fn = _model(args, build_model, load_user_model)
    try:
        result = pn.search(model, batch, args.devices, args.hardware,
                           topology=pn.Topology.of(args.hardware, gpus_per_node=args.gpus_per_node),
                           pin=pins, precision=getattr(args, "precision", None), cost=args.cost,
                           top=args.verify, loss_fn=loss_fn, jobs=args.jobs)
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.table(args.top, sort=args.sort))
    if not result.fits:
        return 1
    paths = result.save_best(args.out)
    print(f"\nbest: {result.best.knobs.label()}; wrote {paths['program']} and "
          f"{paths['annotations']}")
    if args.model not in LLAMA3:
        size = "" if ":" in args.model else f" --batch-size {len(batch[0])}"
        print(f"train it: python -m piper_nb run {paths['program']} --model {args.model} "
              f"--annotations {paths['annotations']} --devices {args.devices}{size}")
    return 0
