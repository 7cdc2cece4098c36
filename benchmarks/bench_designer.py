"""Designer responsiveness: time from an edit (the microbatch count) to redrawn views.

Two models, each cut into 4 stages x 8 microbatches (1F1B), uniform cost model (the
Designer's default): TinyGPT (4 blocks, captured by torch.fx) and a 24-layer tiny Llama
from Hugging Face `transformers` (random weights, captured by torch.export; skipped when
transformers is missing). Each edit recompiles (the capture is cached per annotation set),
re-simulates and redraws the visible view in place; the figure is
`designer.last_refresh_seconds`, measured by the Designer around its refresh, for the
Timeline tab (plotly) and the DAG tab (graphviz) in turn. Every edit changes the count
(4 <-> 8), so no sample is the opening refresh; opening (the capture) is timed apart.
Run: .venv/bin/python benchmarks/bench_designer.py
"""

from __future__ import annotations

import statistics
import time

import torch

import piper_nb as pn
from piper_nb.ui.views import TABS

PROGRAM = [{"op": "schedule", "name": "1f1b", "ranks": 4, "microbatches": 8, "place": True}]


def tiny_gpt():
    model = pn.models.TinyGPT(layers=4)
    return "TinyGPT, 4 blocks (fx)", model, model.example_batch(batch_size=16, seed=0)


def llama24():
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=24,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="eager"))
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))
    return "Llama, 24 layers (export)", model, (ids, torch.roll(ids, -1, dims=1))


def bench(name: str, model, batch, repeats: int) -> None:
    t0 = time.perf_counter()
    designer = pn.Designer(model, batch, debounce=None, annotations=pn.cut_stages(model, 4),
                           program=PROGRAM)
    opened = time.perf_counter() - t0
    assert designer.problems == [] and designer.plan.world == 4, designer.problems
    for tab in ("Timeline", "DAG"):
        designer.views.tabs.selected_index = TABS.index(tab)
        times = []
        for _ in range(repeats):
            designer.microbatches.value = 4 if designer.plan.microbatches == 8 else 8
            assert designer.problems == [] and designer.plan.microbatches in (4, 8)
            times.append(designer.last_refresh_seconds * 1e3)
        print(f"| {name} | {tab} | microbatches 4 <-> 8 | {statistics.median(times):.1f} | "
              f"{max(times):.1f} | {repeats} | {opened:.1f} |", flush=True)
    designer.close()


def main(repeats: int = 10) -> None:
    print("| model | view | edit | median ms | max ms | edits | open s |")
    print("|---|---|---|---|---|---|---|")
    cases = [tiny_gpt]
    try:
        import transformers  # noqa: F401
        cases.append(llama24)
    except ImportError:
        print("(transformers not installed: the 24-layer Llama case is skipped)")
    for case in cases:
        bench(*case(), repeats)


if __name__ == "__main__":
    main()
