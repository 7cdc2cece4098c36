"""`pn.cluster.ProgressBar`: one line redrawn per step with what the step's metrics carry."""

from __future__ import annotations

from piper_nb.cluster import ProgressBar
from piper_nb.metrics import StepMetrics


def test_the_bar_shows_loss_norm_and_learning_rate(capsys):
    bar = ProgressBar("run", every=0.0, notebook=False)
    for s in (1, 2):
        bar(s, 2, StepMetrics(s, 2.5 / s, 0.01, 800.0, lr=3e-4, grad_norm=0.75))
    err = capsys.readouterr().err
    assert "run: step 2/2  loss 1.25  grad norm 0.75  lr 0.0003" in err
    assert bar.history == [(1, 2.5), (2, 1.25)]
