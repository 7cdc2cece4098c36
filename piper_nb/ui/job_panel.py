"""The Run tab's batch-job box: the current plan saved as a directory (`plan.save`), and
the `torchrun` and `sbatch` commands that run it (`python -m piper_nb launch`), ready to
copy.

The plan is saved with the optimizer the Run tab trains with and the Designer's batch, so
the job trains what a launch from the tab would. Errors (a plan that does not compile, a
directory that holds something else) are said in the box.
"""

from __future__ import annotations

import html
from collections.abc import Callable

import ipywidgets as W

from piper_nb.errors import PlanError

__all__ = ["JobPanel"]


class JobPanel:
    """`widget`: the directory box, Save, and the commands. `get_run()` gives the Run tab's
    (plan, trace, model, batch, loss_fn); `optimizer()` its optimizer; `steps()` its
    step count."""

    def __init__(self, get_run: Callable[[], tuple], optimizer: Callable[[], object],
                 steps: Callable[[], int]):
        self.get_run, self.optimizer, self.steps = get_run, optimizer, steps
        self.directory = W.Text(value="piper_nb_plan", description="plan directory",
                                style={"description_width": "initial"},
                                layout=W.Layout(width="360px"))
        self.button = W.Button(description="Save for a batch job", icon="save")
        self.button.on_click(lambda _: self.save())
        self.status = W.HTML("<span class='pn-muted'>Writes the plan, its weights, the "
                             "optimizer and the batch as a directory, and shows the torchrun "
                             "and sbatch commands that train it as a job.</span>")
        self.commands = W.Textarea(layout=W.Layout(width="100%", height="220px"))
        self.commands.layout.display = "none"
        self.widget = W.VBox([W.HTML("<b>Batch job</b>"), W.HBox([self.directory, self.button]),
                              self.status, self.commands])
        self.path = None

    def save(self):
        """Save the current plan into the directory box's path and show its commands; the
        path written (None on an error, said in the box)."""
        from piper_nb.cluster.job import job_commands
        plan, _, _, batch, _ = self.get_run()
        if plan is None:
            self._say("the program does not compile; fix the Problems first", bad=True)
            return None
        try:
            self.path = plan.save(self.directory.value, self.optimizer(), batch=batch)
        except (PlanError, OSError) as err:
            self._say(str(err), bad=True)
            return None
        self.commands.value = job_commands(self.path, plan.world, self.steps())
        self.commands.layout.display = None
        self._say(f"saved {self.path.resolve()} ({plan.world} devices); copy a command below")
        return self.path

    def _say(self, text: str, bad: bool = False) -> None:
        cls = "pn-bad" if bad else "pn-muted"
        self.status.value = f"<span class='{cls}'>{html.escape(text)}</span>"
