"""A live progress bar for `pn.train(..., progress=ProgressBar())`: steps done and the loss.

In a notebook it is one HTML `<progress>` element updated in place through IPython's
display handles (no widget, so it survives in saved notebooks and nbconvert output); in a
terminal it rewrites one line. At most `every` seconds pass between redraws, and the last
step is always drawn.
"""

from __future__ import annotations

import html
import sys
import time

__all__ = ["ProgressBar"]


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


class ProgressBar:
    """Callable `(step, steps, metrics)`, as `pn.train`'s `progress=` hook wants: the step,
    the loss, and the gradient norm and learning rate when the run has them."""

    def __init__(self, label: str = "train", every: float = 0.2, notebook: bool | None = None):
        self.label, self.every = label, every
        self.notebook = _in_notebook() if notebook is None else notebook
        self.handle = None
        self.drawn = 0.0
        self.t0: float | None = None
        self.history: list[tuple[int, float]] = []

    def __call__(self, step: int, steps: int, metrics) -> None:
        now = time.monotonic()
        if self.t0 is None or (self.history and step <= self.history[-1][0]):  # a new run
            self.t0, self.history, self.handle = now, [], None
        loss = float(getattr(metrics, "loss", metrics))
        self.history.append((step, loss))
        if step != steps and now - self.drawn < self.every:
            return
        self.drawn = now
        text = f"{self.label}: step {step}/{steps}  loss {loss:.5g}"
        for name, label in (("grad_norm", "grad norm"), ("lr", "lr")):
            if getattr(metrics, name, None) is not None:
                text += f"  {label} {getattr(metrics, name):.3g}"
        if len(self.history) > 1:
            text += f"  ({(now - self.t0) / (len(self.history) - 1) * 1e3:.1f} ms/step)"
        if self.notebook:
            self._html(step, steps, text)
        else:
            end = "\n" if step == steps else ""
            sys.stderr.write(f"\r{text}{end}")
            sys.stderr.flush()

    def _html(self, step: int, steps: int, text: str) -> None:
        from IPython.display import HTML, display
        body = HTML(f"<div style='font-family:monospace'><progress value='{step}' max='{steps}' "
                    f"style='width:240px;vertical-align:middle'></progress> {html.escape(text)}</div>")
        if self.handle is None:
            self.handle = display(body, display_id=True)
        else:
            self.handle.update(body)
