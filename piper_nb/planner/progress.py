"""A search's progress: a tqdm bar (terminal or notebook), or the caller's callable.

The callable, `progress(phase, done, total)` with phase "probing", "exploring" or
"verifying", is what the Designer's Search tab passes; when it returns True the search
stops (`Stop`) and returns the best it has, as Ctrl-C does.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Stop", "bar"]


class Stop(Exception):
    """The caller's progress callable asked the search to stop."""


class _Report:
    """A tqdm-shaped bar that reports to `progress(phase, done, total)` and raises `Stop`
    when it returns True."""

    def __init__(self, progress: Callable, total: int, phase: str):
        self.progress, self.total, self.phase, self.done = progress, total, phase, 0
        progress(phase, 0, total)    # a stop is asked for between candidates, not here

    def update(self, n: int = 1) -> None:
        self.done += n
        if self.progress(self.phase, self.done, self.total):
            raise Stop

    def close(self) -> None:
        pass


def bar(total: int, progress, desc: str):
    """A bar over `total` steps of phase `desc`: the callable's, a tqdm bar (`progress`
    True) or a silent one (False)."""
    if callable(progress):
        return _Report(progress, total, desc)
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=f"pn.search: {desc}", disable=not progress, leave=False)
