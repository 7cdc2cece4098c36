"""Benchmark: Hugging Face models through piper_nb, capture by torch.export and step time.

Three measurements, each printed as a markdown table:

1. capture time per family at the test size: the tiny Llama, Qwen3, GPT-2, Mixtral and
   Qwen3-MoE configs and stage annotations of `tests/capture/test_hf_families.py` (hidden
   32, 4 layers, batch 8 x seq 8), `spec.capture(None, batch, "export")` on a fresh
   `pn.annotate` each repeat, best of `--repeats`. The time is split, without touching the
   package, by wrapping two functions for the duration of a call: `torch.export.export`
   itself, the rest of `piper_nb.capture.export.export_graph` (unlifting with
   `ep.module()`, cleaning the graph), and the rest of `spec.capture` (cutting the graph
   into regions, rematerialising free values). Wall and CPU time of this process are both
   given: on a shared machine CPU time is the steadier figure.
2. capture time of a Llama built under `with torch.device("meta"):`, on a meta batch of
   input_ids (batch 2, seq 128), the model's own loss (labels = the shifted ids):
   `--meta-layers` entries, by default 4 and 16 layers of a Llama of about 1B parameters
   at 16 (hidden 2048, 32 heads, 8 kv heads, intermediate 5632, vocab 32000; target under
   5 s at 16), and `70b`, Llama 3 70B's shape (80 layers, hidden 8192, 64 heads, 8 kv
   heads, intermediate 28672, vocab 128256; target under 10 s). The stack of identical
   layers is exported once and stamped (`piper_nb.capture.stamp`), so the export column
   stays flat and the stamping shows in "unlift + clean".
   `--static` adds, as a diagnosis, `torch.export.export` of the same model + loss with no
   dynamic dimension (piper_nb exports with a dynamic batch dimension).
3. step time of a Llama (default hidden 256, 4 layers, 8 heads, 4 kv heads, intermediate
   688, vocab 4096, seq 128, batch 16) trained PP2 1F1B, 4 microbatches, SGD lr 0.01, by
   piper_nb (`pn.compile` on an (input_ids, targets) batch, `loss_fn` cross-entropy on
   `out.logits`, one `pn.LocalCluster` of 2 workers) and by `torch.distributed.pipelining`
   (`Schedule1F1B`, one manual `PipelineStage` per rank over the same halves: embeddings +
   layers 0-1, and layers 2-3 + norm + lm_head, each recomputing the causal mask and rotary
   embeddings as the HF model does; the same loss). The torch side runs in the spawned gloo
   groups of `_peers.py` (same pinning, timed the same way: a barrier, then wall time per
   rank to the end of its optimizer step, max over ranks). The systems run interleaved
   (piper_nb, torch, piper_nb, torch, ...) after warm-up steps; the median step is
   reported, the ratio piper_nb / torch, and the first-step losses must agree.

    .venv/bin/python benchmarks/bench_capture.py [--only capture,meta,step] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import piper_nb as pn
import piper_nb.capture.front_ends as _front

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))                                   # _peers (spawned ranks too)
sys.path.insert(0, str(_HERE.parent / "tests" / "capture"))      # the families' test configs
import _peers  # noqa: E402
from _peers import PeerGroup  # noqa: E402

__all__ = ["capture_families", "capture_meta", "step_time", "main"]

_COMPUTE = ("F", "B", "BI", "BW", "U")


# ----------------------------------------------------------------------------- timing


class _Split:
    """Times of one capture: torch.export.export, export_graph and the whole call."""

    def __init__(self):
        self.export = self.graph = 0.0
        self.nodes = 0


@contextlib.contextmanager
def _timed_export(split: _Split):
    """Wrap `torch.export.export` and the `export_graph` that `front_end` calls, recording
    their wall time into `split`; the package is left as it was afterwards."""
    real_export, real_graph = torch.export.export, _front.export_graph

    def export(*a, **k):
        t = time.perf_counter()
        try:
            return real_export(*a, **k)
        finally:
            split.export += time.perf_counter() - t

    def graph(*a, **k):
        t = time.perf_counter()
        try:
            gm = real_graph(*a, **k)
        finally:
            split.graph += time.perf_counter() - t
        split.nodes = len(gm.graph.nodes)
        return gm

    torch.export.export, _front.export_graph = export, graph
    try:
        yield split
    finally:
        torch.export.export, _front.export_graph = real_export, real_graph


def _capture_once(model, annotation, batch) -> dict:
    split = _Split()
    with _timed_export(split):
        c0, t0 = time.process_time(), time.perf_counter()
        cap = pn.annotate(model, annotation).capture(None, batch, "export")
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert cap is not None
    return {"capture s": wall, "torch.export s": split.export,
            "unlift + clean s": split.graph - split.export, "regions s": wall - split.graph,
            "CPU s": cpu, "graph nodes": split.nodes, "regions": len(cap.regions)}


def _best(runs: list[dict]) -> dict:
    """The run with the least wall time (its split), and the least CPU time of all runs."""
    best = dict(min(runs, key=lambda r: r["capture s"]))
    best["CPU s"] = min(r["CPU s"] for r in runs)
    return best


# ----------------------------------------------------------------------------- 1. families


def capture_families(repeats: int, only: str = "") -> list[dict]:
    from test_hf_families import FAMILIES, batch, stages
    rows = []
    for name, build in FAMILIES.items():
        if only and name not in only.split(","):
            continue
        torch.manual_seed(0)
        model = build()
        runs = [_capture_once(model, stages(name, 2), batch()) for _ in range(repeats)]
        row = {"family": name, "params": sum(p.numel() for p in model.parameters()),
               **_best(runs)}
        rows.append(row)
        print(f"  capture {name}: {row['capture s']:.2f} s", file=sys.stderr, flush=True)
    return rows


# ----------------------------------------------------------------------------- 2. meta 1B


_SHAPES = {   # a Llama of about 1B parameters at 16 layers, and Llama 3 70B's own shape
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048),
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192),
}


def _llama_1b(layers: int, shape: str = "1b"):
    import transformers
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, attn_implementation="eager",
                                   **_SHAPES[shape])
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def _halves(layers: int, stages: int = 2) -> dict:
    ann = {"model.embed_tokens": {"PP": 0}, "model.norm": {"PP": stages - 1},
           "lm_head": {"PP": stages - 1}}
    ann.update({f"model.layers.{i}": {"PP": i * stages // layers} for i in range(layers)})
    return ann


def capture_meta(layer_counts: list, repeats: int, static: bool) -> list[dict]:
    """One row per entry: a layer count of the 1B-shaped Llama, or "70b" (80 layers of
    Llama 3 70B's shape)."""
    rows = []
    ids = torch.zeros((2, 128), dtype=torch.long, device="meta")
    batch = (ids, ids)            # the model's own loss: forward(ids, labels=ids)
    for entry in layer_counts:
        shape, layers = ("70b", 80) if entry == "70b" else ("1b", int(entry))
        model = _llama_1b(layers, shape)
        params = sum(p.numel() for p in model.parameters())
        try:
            runs = [_capture_once(model, _halves(layers), batch) for _ in range(repeats)]
        except Exception as err:  # reported, not patched: the table says why
            rows.append({"shape": shape, "layers": layers, "params": params,
                         "capture s": float("nan"), "error": f"{type(err).__name__}: {err}"})
            print(f"  meta {layers} layers failed: {err}", file=sys.stderr, flush=True)
            continue
        row = {"shape": shape, "layers": layers, "params": params, **_best(runs)}
        if static:
            row["static export s"], row["static export CPU s"] = _static_export(model, batch)
        rows.append(row)
        print(f"  meta {layers} layers: {row['capture s']:.2f} s", file=sys.stderr, flush=True)
    return rows


def _static_export(model, batch) -> tuple[float, float]:
    """torch.export.export of model + its own loss with no dynamic dimension (diagnosis)."""
    from piper_nb.capture.loss import model_loss
    root = _front._WithLoss(model, model_loss)
    c0, t0 = time.process_time(), time.perf_counter()
    torch.export.export(root, batch, strict=False)
    return time.perf_counter() - t0, time.process_time() - c0


# ----------------------------------------------------------------------------- 3. step time


def llama_config(args) -> dict:
    return dict(vocab_size=args.vocab, hidden_size=args.hidden,
                intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                max_position_embeddings=max(args.seq, 64), attn_implementation="eager")


def build_llama(config: dict, seed: int = 0):
    import transformers
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))


def llama_batch(config: dict, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), generator=g)
    return ids, torch.roll(ids, -1, dims=1)


def logits_loss(out, targets):
    """Cross-entropy on the logits (both systems): mean over the microbatch's tokens."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class LlamaHalf(nn.Module):
    """A pipeline stage of an HF Llama: layers `layers` (with the embeddings when `first`,
    the final norm and lm_head when `last`), recomputing the causal mask, position ids and
    rotary embeddings as `LlamaModel.forward` does; the parameters are the model's."""

    def __init__(self, model, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.embed = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[i] for i in layers)
        self.rotary = model.model.rotary_emb
        self.norm = model.model.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask
        h = self.embed(x) if self.embed is not None else x
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=pos)
        pe = self.rotary(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos)
        if self.head is not None:
            h = self.head(self.norm(h))
        return h


class _Staged(nn.Module):
    """What `_peers._pipeline` expects of a model: `layers[s]` is stage s, and `loss_fn`."""

    def __init__(self, model, cut: int):
        super().__init__()
        n = model.config.num_hidden_layers
        self.layers = nn.ModuleList([LlamaHalf(model, list(range(cut)), True, False),
                                     LlamaHalf(model, list(range(cut, n)), False, True)])

    @staticmethod
    def loss_fn(out, targets):
        return logits_loss(out, targets)


def _hf_model_and_batch(case: dict):
    model = build_llama(case["config"], case["seed"])
    return _Staged(model, case["cut"]), llama_batch(case["config"], case["batch"], case["seq"])


def _serve_hf(*args) -> None:
    """A `_peers` rank whose model is the staged HF Llama (the rest is `_peers._serve`)."""
    _peers._model_and_batch = _hf_model_and_batch   # this spawned process only
    _peers._serve(*args)


class HFPeerGroup(PeerGroup):
    """`_peers.PeerGroup` (kind "1f1b") over the staged HF Llama: the same spawn, pinning,
    gloo group, timing and result collection, with `_serve_hf` as each rank's main."""

    def __init__(self, case: dict, world: int, timeout: float = 300.0, pin: bool | None = None):
        super().__init__(case, world, timeout, pin, serve=_serve_hf)


class _Piper:
    """One compiled plan on a LocalCluster, stepped as `pn.train` steps it."""

    def __init__(self, plan, cluster, batch, optimizer):
        self.plan, self.cluster, self.batch = plan, cluster, batch
        cluster.reset(plan, optimizer)
        self.busy: list[float] = []

    def run(self, steps: int) -> tuple[list[float], list[float]]:
        times, losses = [], []
        for _ in range(steps):
            outs = self.cluster.step(self.plan, self.batch, trace=False)
            losses.append(sum(o["loss"] for o in outs))
            times.append(max(o["end"] for o in outs))
            self.busy.append(max(sum(e.end - e.start for e in o["events"] if e.kind in _COMPUTE)
                                 for o in outs))
        return times, losses


def step_time(args) -> list[dict]:
    config = llama_config(args)
    model = build_llama(config, 0)
    batch = llama_batch(config, args.batch, args.seq)
    cut = args.layers // 2
    m = args.microbatches
    ann = {"model.embed_tokens": {"PP": 0}, "model.norm": {"PP": 1}, "lm_head": {"PP": 1},
           **{f"model.layers.{i}": {"PP": int(i >= cut)} for i in range(args.layers)}}
    program = [pn.place({"PP": 0}, [0]), pn.place({"PP": 1}, [1]),
               *pn.schedules.one_f_one_b(ranks=2, microbatches=m)]
    t0 = time.perf_counter()
    plan = pn.compile(pn.annotate(model, ann), program, batch, loss_fn=logits_loss)
    compile_s = time.perf_counter() - t0
    case = dict(kind="1f1b", config=config, seed=0, batch=args.batch, seq=args.seq, cut=cut,
                microbatches=m, lr=args.lr, stages=[[0], [1]])
    cluster = pn.LocalCluster(2, pin=args.pin).start()
    peer = None
    try:
        piper = _Piper(plan, cluster, batch, pn.optim.SGD(lr=args.lr))
        peer = HFPeerGroup(case, 2, pin=args.pin)
        first = {"piper": piper.run(args.warmup)[1][0], "torch": peer.run(args.warmup)[1][0]}
        times: dict[str, list[float]] = {"piper": [], "torch": []}
        for _ in range((args.steps + args.chunk - 1) // args.chunk):
            times["piper"] += piper.run(args.chunk)[0]     # piper, torch, piper, torch, ...
            times["torch"] += peer.run(args.chunk)[0]
    finally:
        if peer is not None:
            peer.close()
        cluster.close()
    if abs(first["piper"] - first["torch"]) > 1e-4 * max(abs(first["torch"]), 1.0):
        raise RuntimeError(f"first-step losses differ: piper_nb {first['piper']}, torch "
                           f"{first['torch']}: the systems do not do the same work")
    p_ms, t_ms = (statistics.median(times[k]) * 1e3 for k in ("piper", "torch"))
    return [{"case": f"Llama PP2 1F1B, {m} mb", "params": sum(p.numel() for p in
                                                               model.parameters()),
             "piper_nb ms": p_ms, "torch ms": t_ms, "ratio": p_ms / t_ms,
             "best-step ratio": min(times["piper"]) / min(times["torch"]),
             "piper_nb compute ms": statistics.median(piper.busy[args.warmup:]) * 1e3,
             "steps": len(times["piper"]), "first loss": first["piper"],
             "compile s": compile_s}]


# ----------------------------------------------------------------------------- output


def _fmt(key: str, v) -> str:
    if isinstance(v, float):
        if v != v:
            return "failed"
        if "ratio" in key:
            return f"{v:.2f}"
        if key.endswith(" s") or key == "first loss":
            return f"{v:.3f}" if v < 10 else f"{v:.1f}"
        return f"{v:.1f}"
    if key == "params":
        return (f"{v / 1e9:.2f} B" if v >= 1e8 else f"{v / 1e6:.2f} M" if v >= 1e6
                else f"{v / 1e3:.1f} K")
    return str(v)


def table(rows: list[dict], keys: list[str]) -> str:
    keys = [k for k in keys if any(k in r for r in rows)]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(k, r[k]) if k in r else "" for k in keys) + " |")
    return "\n".join(lines)


def _machine() -> str:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (f"{os.cpu_count()} CPUs, torch {torch.__version__}, transformers "
            f"{__import__('transformers').__version__}, load average {load[0]:.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="capture,meta,step",
                    help="comma-separated parts to run: capture, meta, step")
    ap.add_argument("--families", default="", help="comma-separated families (default all)")
    ap.add_argument("--repeats", type=int, default=3, help="capture repeats (best is kept)")
    ap.add_argument("--meta-layers", default="4,16,70b",
                    help="layer counts of the 1B-shaped meta Llama, and 70b for Llama 3 70B")
    ap.add_argument("--meta-repeats", type=int, default=1)
    ap.add_argument("--static", action="store_true",
                    help="also time torch.export of the meta model with no dynamic dimension")
    ap.add_argument("--quick", action="store_true", help="1 capture repeat, 6 steps, 2 warm-up")
    ap.add_argument("--steps", type=int, default=20, help="measured steps per system")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=1, help="steps per system per round")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--no-pin", dest="pin", action="store_const", const=False, default=None,
                    help="pin no process to a core (default: as LocalCluster, both systems)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 1, 6, 2
    parts = set(args.only.split(","))
    torch.set_num_threads(1)
    print(f"Machine: {_machine()}; one intra-op thread per process\n")
    if "capture" in parts:
        rows = capture_families(args.repeats, args.families)
        print(f"Capture at the test size (tests/capture/test_hf_families.py: hidden 32, 4 layers, "
              f"batch 8 x seq 8, PP2 annotation), best of {args.repeats}. capture s = torch.export s "
              "(torch.export.export) + unlift + clean s (the rest of export_graph) + regions s "
              "(the rest of spec.capture); CPU s: this process's CPU time, best run\n")
        print(table(rows, ["family", "params", "graph nodes", "regions", "capture s",
                           "torch.export s", "unlift + clean s", "regions s", "CPU s"]))
        print()
    if "meta" in parts:
        layers = [n for n in args.meta_layers.split(",") if n]
        rows = capture_meta(layers, args.meta_repeats, args.static)
        print("Capture of a Llama built on the meta device (1b: hidden 2048, 32 heads, 8 kv "
              "heads, intermediate 5632, vocab 32000; 70b: Llama 3 70B, hidden 8192, 64 heads, "
              "8 kv heads, intermediate 28672, vocab 128256, 80 layers), meta batch of "
              f"input_ids 2 x 128, the model's own loss, best of {args.meta_repeats}; targets "
              "under 5 s for 1b at 16 layers, under 10 s for 70b\n")
        print(table(rows, ["shape", "layers", "params", "graph nodes", "regions", "capture s",
                           "torch.export s", "unlift + clean s", "regions s", "CPU s",
                           "static export s", "static export CPU s", "error"]))
        print()
    if "step" in parts:
        t0 = time.perf_counter()
        rows = step_time(args)
        print(f"Step time, Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads "
              f"({args.kv_heads} kv), intermediate {args.intermediate}, vocab {args.vocab}, "
              f"batch {args.batch} x seq {args.seq}, {args.microbatches} microbatches, SGD lr "
              f"{args.lr}, cross-entropy on logits; 2 ranks, gloo on CPU, 1 thread per rank; "
              f"median of {args.steps} steps after {args.warmup} warm-up, interleaved in "
              f"rounds of {args.chunk}; {time.perf_counter() - t0:.0f} s in all\n")
        print(table(rows, ["case", "params", "piper_nb ms", "torch ms", "ratio",
                           "best-step ratio", "piper_nb compute ms", "steps", "first loss",
                           "compile s"]))
    print(f"\n(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
