"""The in-code form of annotations, Piper-compatible: `with pn.region("PP"): ...`.

Inside `forward`, each entry into a scope of one tag takes the next index in trace order
(PP=0, PP=1, ...); scopes nest (an EP scope inside a PP scope tags both). Outside of
piper_nb's tracing the context manager costs nothing; under torch.export it also records
the tags through `torch.fx.traceback.annotate` so other PT2 tools see them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.fx.traceback as fx_traceback

__all__ = ["region", "current_region_tags", "tracing_scope"]

_STATE: dict[str, Any] = {"active": False, "stack": [], "counters": {}}


@contextlib.contextmanager
def tracing_scope() -> Iterator[None]:
    """Enable region bookkeeping for the duration of one piper_nb trace."""
    saved = dict(_STATE)
    _STATE.update(active=True, stack=[], counters={})
    try:
        yield
    finally:
        _STATE.clear()
        _STATE.update(saved)


def current_region_tags() -> dict[str, int]:
    tags: dict[str, int] = {}
    for frame in _STATE["stack"]:
        tags.update(frame)
    return tags


@contextlib.contextmanager
def region(tag: str, index: int | None = None) -> Iterator[None]:
    """Tag the operations traced inside this block with `tag=index` (auto-numbered)."""
    if not _STATE["active"]:
        yield
        return
    counters = _STATE["counters"]
    if index is None:
        index = counters.get(tag, 0)
        counters[tag] = index + 1
    _STATE["stack"].append({tag: index})
    try:
        with fx_traceback.annotate({tag: index}):
            yield
    finally:
        _STATE["stack"].pop()
