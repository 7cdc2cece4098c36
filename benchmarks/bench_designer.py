"""Designer responsiveness: time from an edit (the microbatch count) to redrawn views.

TinyGPT cut into 4 stages x 8 microbatches (1F1B), uniform cost model (the Designer's
default). Each edit recompiles, re-simulates and redraws the visible view in place; the
figure is `designer.last_refresh_seconds`, measured by the Designer around its refresh,
for the Timeline tab (plotly) and the DAG tab (graphviz) in turn.
Run: .venv/bin/python benchmarks/bench_designer.py
"""

from __future__ import annotations

import statistics

import piper_nb as pn
from piper_nb.ui.views import TABS


def main(repeats: int = 10) -> None:
    model = pn.models.TinyGPT(layers=4)
    batch = model.example_batch(batch_size=16, seed=0)
    program = [{"op": "schedule", "name": "1f1b", "ranks": 4, "microbatches": 8, "place": True}]
    designer = pn.Designer(model, batch, debounce=None, annotations=pn.cut_stages(model, 4),
                           program=program)
    assert designer.problems == [] and designer.plan.world == 4, designer.problems
    print("| view | edit | median ms | max ms | edits |")
    print("|---|---|---|---|---|")
    for tab in ("Timeline", "DAG"):
        designer.views.tabs.selected_index = TABS.index(tab)
        times = []
        for i in range(repeats):
            designer.microbatches.value = 8 if i % 2 == 0 else 4
            assert designer.problems == [] and designer.plan.microbatches in (4, 8)
            times.append(designer.last_refresh_seconds * 1e3)
        print(f"| {tab} | microbatches 4 <-> 8 | {statistics.median(times):.1f} | "
              f"{max(times):.1f} | {repeats} |")
    designer.close()


if __name__ == "__main__":
    main()
