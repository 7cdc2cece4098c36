"""Plans at a realistic size: notebook 09's twelve plans of a 70B Llama on 128 H100s.

Runs the planning cells of `notebooks/09_plan_at_scale.ipynb` as they are (the model on the
meta device, PP 8 x DP 16, 1F1B / interleaved / DualPipeV x ZeRO-1 / ZeRO-3 x recompute or
not) and prints the notebook's table with, per plan, the seconds to compile (with the
static checks; the first plan of each stage count also captures the model and builds the
analytic cost model) and to simulate, then the drawing of the best plan's timeline and DAG,
and the whole run's wall and CPU seconds. Target: compile + simulate under 30 s per plan.

    .venv/bin/python benchmarks/bench_plan_at_scale.py
"""

from __future__ import annotations

import json
import time
from pathlib import Path

__all__ = ["notebook_code", "main"]

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "09_plan_at_scale.ipynb"


def notebook_code(upto: str = "MEMORY = ") -> str:
    """The notebook's code cells up to and including the one that starts with `upto`."""
    cells = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    out = []
    for cell in cells:
        src = "".join(cell["source"])
        out.append("\n".join(line for line in src.splitlines() if not line.startswith("# NBVAL")))
        if src.startswith(upto):
            return "\n\n".join(out)
    raise SystemExit(f"{NOTEBOOK.name} has no code cell starting with {upto!r}")


def main() -> None:
    w0, c0 = time.perf_counter(), time.process_time()
    env: dict = {}
    exec(compile(notebook_code(), str(NOTEBOOK), "exec"), env)   # noqa: S102 (our notebook)
    traces, seconds, cfg = env["traces"], env["seconds"], env
    tokens = cfg["DP"] * cfg["MICRO"] * cfg["SEQ"]
    print("| schedule | ZeRO | recompute | step s | tokens/s/GPU | bubble | peak GiB | fits | "
          "compile s | simulate s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (schedule, zero, rc), tr in traces.items():
        comp, sim = seconds[schedule, zero, rc]
        print(f"| {schedule} | {zero} | {'yes' if rc else 'no'} | {tr.step_time:.2f} | "
              f"{tokens / tr.step_time / cfg['GPUS']:.0f} | {tr.bubble_fraction():.0%} | "
              f"{max(tr.peak_memory.values()) / 2**30:.1f} | {'yes' if tr.fits() else 'no'} | "
              f"{comp:.1f} | {sim:.1f} |", flush=True)
    planned_w, planned_c = time.perf_counter() - w0, time.process_time() - c0
    from piper_nb.viz import dag_to_graphviz
    fits = [k for k, t in traces.items() if t.fits()]
    best = min(fits, key=lambda k: traces[k].step_time)
    t0 = time.perf_counter()
    traces[best].figure()
    t1 = time.perf_counter()
    dag_to_graphviz(env["plans"][best].dag).pipe(format="svg")
    t2 = time.perf_counter()
    print(f"\nbest {best}: timeline figure {t1 - t0:.1f} s, DAG drawing {t2 - t1:.1f} s")
    print(f"planning: {planned_w:.0f} s wall, {planned_c:.0f} s CPU; total "
          f"{time.perf_counter() - w0:.0f} s wall, {time.process_time() - c0:.0f} s CPU")


if __name__ == "__main__":
    main()
