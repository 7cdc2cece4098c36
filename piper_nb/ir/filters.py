"""Filters: conjunctive `{tag: index}` maps selecting DAG nodes (Piper's filter form).

`"*"` matches any index of a tag the node has; `{}` matches everything; `PASS` is a
built-in tag whose values are F, B, BI, BW, U. A node's tags are a frozen mapping. `SEG`
(set by capture when a stage's tags come back later in the model) is 0 where absent: the
first segment of a stage carries no SEG tag, and `{"SEG": 0}` selects it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from piper_nb.errors import PlanError
from piper_nb.ir.kinds import PASS_NAMES

__all__ = ["Tags", "ANY", "SEG", "as_filter", "matches", "tags_text", "freeze_tags"]

ANY = "*"
SEG = "SEG"
Tags = tuple[tuple[str, Any], ...]


def freeze_tags(tags: Mapping[str, Any]) -> Tags:
    """Tags as a tuple of pairs in canonical order: PP, other tags, MB, PASS."""
    rank = {"PP": 0, "MB": 2, "PASS": 3}
    return tuple(sorted(tags.items(), key=lambda kv: (rank.get(kv[0], 1), kv[0])))


def as_filter(obj: Any, *, where: str = "filter") -> dict[str, Any]:
    """Validate a user-given filter and return it as a plain dict."""
    if not isinstance(obj, Mapping):
        raise PlanError(f"{where} must be a {{tag: index}} object, got {type(obj).__name__} {obj!r}")
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if not isinstance(key, str) or not key:
            raise PlanError(f"{where} keys must be tag names (strings), got {key!r}")
        if key == "PASS":
            if value != ANY and value not in PASS_NAMES:
                raise PlanError(f"{where}: PASS must be one of {', '.join(PASS_NAMES)} or '*', got {value!r}")
        elif value != ANY and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise PlanError(
                f"{where}: tag {key} must map to a non-negative integer index or '*', got {value!r}")
        out[key] = value
    return out


def matches(filt: Mapping[str, Any], tags: Mapping[str, Any]) -> bool:
    """True when every `tag: index` of the filter holds for the node's tags."""
    for key, want in filt.items():
        if key not in tags:
            if key == SEG and want in (0, ANY):
                continue
            return False
        if want != ANY and tags[key] != want:
            return False
    return True


def tags_text(tags: Mapping[str, Any] | Tags, skip: tuple[str, ...] = ("PASS",)) -> str:
    """Compact text of tags: `PP=1,MB=0`, the tags in `skip` left out (by default PASS: it
    is the node's op; the DAG's text form, which keeps every tag, passes `skip=()`)."""
    items = tags.items() if isinstance(tags, Mapping) else tags
    return ",".join(f"{k}={v}" for k, v in items if k not in skip)
