"""The Designer's Run tab: launch the plan on a cluster with a progress bar and live loss
and learning-rate curves, then show measured beside predicted timelines and the loss beside the reference;
below, the plan saved for a batch job (`ui.job_panel`).

`pn.train` drives the cluster through three calls (`reset`, `step`, `state`); the
launcher hands it a `StepReporter` that forwards them to the real cluster and reports
each step's loss, so progress is live without a callback in `pn.train`. The reference is
`pn.reference_train` on the same batch and microbatches. Launches run in a background
thread (the notebook stays responsive); `launch(wait=True)` blocks, for tests and scripts.
Failures (`PlanError`, `RuntimeFailure`) are shown in the tab, the worker's traceback
folded away under "details".
"""

from __future__ import annotations

import functools
import html
import threading
from collections.abc import Callable

import ipywidgets as W
import plotly.graph_objects as go

from piper_nb.errors import PlanError, RuntimeFailure
from piper_nb.ui.job_panel import JobPanel
from piper_nb.ui.render import comparison_figure, loss_figure, round_ticks
from piper_nb.ui.widgets import replace_figure

__all__ = ["StepReporter", "LaunchPanel"]


class StepReporter:
    """A cluster wrapper for `pn.train` that calls `on_step(outs)` after every step."""

    def __init__(self, cluster, on_step: Callable[[list[dict]], None]):
        self.cluster, self.on_step = cluster, on_step

    def reset(self, plan, optimizer, seed: int = 0) -> None:
        self.cluster.reset(plan, optimizer, seed)

    def step(self, plan, batch, trace: bool = True) -> list[dict]:
        outs = self.cluster.step(plan, batch, trace)
        self.on_step(outs)
        return outs

    def state(self, plan) -> dict:
        return self.cluster.state(plan)

    def train_state(self, plan) -> list[dict]:
        return self.cluster.train_state(plan)


class LaunchPanel:
    """`widget`: launch controls, progress, loss curve and the two timelines."""

    def __init__(self, get_run: Callable[[], tuple], get_cluster: Callable[[int], object],
                 optimizer=None):
        self.get_run, self.get_cluster = get_run, get_cluster
        self.optimizer = optimizer   # as pn.train takes it; None: SGD at the lr box's rate
        self.steps = W.BoundedIntText(value=3, min=1, max=10_000, description="steps",
                                      layout=W.Layout(width="130px"))
        self.lr = W.BoundedFloatText(value=0.1, min=0.0, max=10.0, step=0.01, description="lr",
                                     layout=W.Layout(width="130px"))
        self.button = W.Button(description="Launch", icon="play", button_style="success")
        self.button.on_click(lambda _: self.launch())
        self.progress = W.IntProgress(value=0, min=0, max=3, description="steps 0/3",
                                      style={"description_width": "initial"})
        self.status = W.HTML(f"<span class='pn-muted'>Trains the current plan with "
                             f"{html.escape(self.optimizer_text())} on the cluster (local "
                             "worker processes unless the Designer was given one), and "
                             "pn.reference_train beside it; <code>designer.result</code> is the "
                             "last run's <code>pn.Result</code>. Its loss against the "
                             "reference, and the measured timeline against the predicted, "
                             "appear here once it runs.</span>")
        if optimizer is not None:
            self.lr.disabled = True
            self.lr.tooltip = "the optimizer given to pn.Designer sets its own rate"
        self.loss = go.FigureWidget(loss_figure([], []))
        self.timelines = go.FigureWidget(comparison_figure(None, None))
        self.job = JobPanel(get_run, lambda: self.optimizer_for(self.lr.value),
                            lambda: self.steps.value)
        # no empty plots before a launch: they show once one starts
        self.plots = W.VBox([self.loss, self.timelines], layout=W.Layout(display="none"))
        self.widget = W.VBox([W.HBox([self.steps, self.lr, self.button, self.progress]),
                              self.status, self.plots, self.job.widget])
        self.thread: threading.Thread | None = None
        self.result = None
        self.reference = None
        self.error: Exception | None = None

    def optimizer_text(self) -> str:
        """The optimizer a launch uses, as the user would write it."""
        opt = self.optimizer
        if opt is None:
            return "SGD at the rate in the lr box"
        if isinstance(opt, functools.partial):
            args = [repr(a) for a in opt.args] + [f"{k}={v!r}" for k, v in opt.keywords.items()]
            return f"{opt.func.__name__}({', '.join(args)})"
        return f"{opt.__name__}()" if isinstance(opt, type) else repr(opt)

    def optimizer_for(self, lr: float):
        from piper_nb.optim import SGD
        return SGD(lr=lr) if self.optimizer is None else self.optimizer

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def launch(self, wait: bool = False) -> None:
        """Train the current plan for `steps` steps (in a thread; `wait` joins it)."""
        if self.running:
            self.status.value = "<span class='pn-bad'>a launch is already running</span>"
            return
        plan, trace, model, batch, loss_fn = self.get_run()
        if plan is None:
            self.status.value = "<span class='pn-bad'>the program does not compile; fix the " \
                                "Problems first</span>"
            return
        steps, lr = self.steps.value, self.lr.value
        self.thread = threading.Thread(target=self._run, args=(plan, trace, model, batch, steps, lr, loss_fn),
                                       name="piper_nb-launch", daemon=True)
        self.button.disabled = True
        self.plots.layout.display = ""
        self.thread.start()
        if wait:
            self.thread.join()

    def _set_losses(self, losses: list[float], reference: list[float], steps: int,
                    lrs: list[float] = ()) -> None:
        with self.loss.batch_update():
            self.loss.data[0].x, self.loss.data[0].y = list(range(1, len(losses) + 1)), losses
            self.loss.data[1].x = list(range(1, len(reference) + 1))
            self.loss.data[1].y = reference
            self.loss.data[2].x, self.loss.data[2].y = list(range(1, len(lrs) + 1)), list(lrs)
            self.loss.layout.xaxis.range = [0.5, steps + 0.5]
            self.loss.layout.yaxis2.update(round_ticks(max(lrs, default=0.0)))

    def _run(self, plan, trace, model, batch, steps: int, lr: float, loss_fn=None) -> None:
        from piper_nb.train import reference_train, train
        from piper_nb.train.loop import step_loss
        self.result = self.reference = self.error = None
        losses: list[float] = []
        lrs: list[float] = []
        self.progress.max, self.progress.value = steps, 0
        self.progress.description = f"steps 0/{steps}"
        try:
            self.status.value = "<span class='pn-muted'>reference run ...</span>"
            self.reference = reference_train(model, batch, steps, plan.reference_microbatches,
                                             self.optimizer_for(lr), loss_fn,
                                             loss_mean=plan.loss_mean)
            ref = list(self.reference.losses)
            self._set_losses([], ref, steps)
            self.status.value = (f"<span class='pn-muted'>starting {plan.world} workers ...</span>")
            cluster = self.get_cluster(plan.world)

            def on_step(outs: list[dict]) -> None:
                losses.append(step_loss(plan, outs))
                lrs.append(outs[0]["lr"])
                self.progress.value = len(losses)
                self.progress.description = f"steps {len(losses)}/{steps}"
                self.status.value = f"<span class='pn-muted'>step {len(losses)}: loss {losses[-1]:.6g}</span>"
                self._set_losses(losses, ref, steps, lrs)

            self.result = train(plan, batch, steps, self.optimizer_for(lr),
                                cluster=StepReporter(cluster, on_step))
            replace_figure(self.timelines, comparison_figure(trace, self.result.trace))
            diff = max(abs(a - b) for a, b in zip(self.result.losses, ref, strict=True))
            self.status.value = (
                f"<span class='pn-good'>done</span>: final loss {self.result.losses[-1]:.6g} "
                f"(reference {ref[-1]:.6g}, largest difference {diff:.2g}); measured step "
                f"{self.result.step_times[-1] * 1000:.1f} ms; {html.escape(self.optimizer_text())}")
        except (PlanError, RuntimeFailure) as err:
            self.error = err
            first, _, rest = str(err).partition("\n")
            more = (f"<details><summary>details</summary><pre>{html.escape(rest)}</pre></details>"
                    if rest else "")
            self.status.value = f"<span class='pn-bad'>{html.escape(first)}</span>{more}"
        except Exception as err:  # surfaced in the tab, not lost in a thread
            self.error = err
            self.status.value = (f"<span class='pn-bad'>launch failed: {type(err).__name__}: "
                                 f"{html.escape(str(err))}</span>")
        finally:
            self.button.disabled = False
