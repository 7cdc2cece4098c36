"""Text forms of directive fields, as typed into the Designer's rows and read back.

Filters read `PP=0, EP=*` (the compact form `tags_text` prints) or JSON `{"PP": 0}`;
devices read `0, 2` (or `[0, 2]`); an order's slots are one per line, the filters sharing
a slot (overlapped F&B) separated by `|`: `PP=1,MB=1,PASS=F | PP=1,MB=0,PASS=B`; tags of a
layer read `TP=1, X=2`. Each parser returns the parsed value when the text is well formed
and the text itself when not, so the directive validators raise a `PlanError` that names
the row: the row keeps what the user typed and shows what is wrong with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["filter_text", "parse_filter", "devices_text", "parse_devices", "slots_text",
           "parse_slots", "tags_text", "parse_tags", "parse_index", "parse_tag_parts"]


def _value(text: str) -> Any:
    text = text.strip()
    if text.isdigit():
        return int(text)
    return text


def parse_index(text: str) -> int | str | None:
    """A tag index typed into a box: '' -> None, '3' -> 3, anything else stays text."""
    text = str(text).strip()
    if not text:
        return None
    return int(text) if text.isdigit() else text


def tags_text(tags: Mapping[str, Any], skip: Sequence[str] = ()) -> str:
    return ", ".join(f"{k}={v}" for k, v in tags.items() if k not in skip)


def _json_of(text: str, kind: type, fallback: str):
    """`text` read as JSON when it is a `kind`, else `fallback` (shown back to the user)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return fallback
    return obj if isinstance(obj, kind) else fallback


def parse_tags(text: str) -> dict[str, Any] | str:
    """`TP=1, X=2` -> {"TP": 1, "X": 2}; '' -> {}; malformed text comes back as is."""
    text = text.strip()
    if not text:
        return {}
    if text.startswith("{"):
        return _json_of(text, dict, text)
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            return text
        out[key.strip()] = _value(value)
    return out


def parse_tag_parts(text: str) -> dict[str, Any]:
    """Lenient `parse_tags` for layer tags: `TP=1, X` -> {"TP": 1, "X": ""}, so a half
    typed tag stays in the annotations and is reported on its layer."""
    out: dict[str, Any] = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip():
            out[key.strip()] = _value(value)
    return out


def filter_text(filt: Any) -> str:
    if isinstance(filt, Mapping):
        return tags_text(filt)
    return "" if filt is None else str(filt)


def parse_filter(text: str) -> dict[str, Any] | str:
    """A filter from `PP=0, EP=*` or JSON; '' is `{}` (match everything)."""
    return parse_tags(text)


def devices_text(devices: Any) -> str:
    if isinstance(devices, (list, tuple)):
        return ", ".join(str(d) for d in devices)
    return "" if devices is None else str(devices)


def parse_devices(text: str) -> list[int] | str:
    """`0, 2` or `[0, 2]` -> [0, 2]; malformed text comes back as is."""
    body = text.strip().strip("[]")
    parts = [p.strip() for p in body.replace(" ", ",").split(",") if p.strip()]
    if parts and all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    return text


def groups_text(devices: Any) -> str:
    """Tensor-parallel groups as `0, 1 | 4, 5` (one group: `0, 1`)."""
    if isinstance(devices, (list, tuple)) and devices and all(
            isinstance(g, (list, tuple)) for g in devices):
        return " | ".join(devices_text(g) for g in devices)
    return devices_text(devices)


def parse_groups(text: str) -> list | str:
    """`0, 1 | 4, 5` -> [[0, 1], [4, 5]]; `0, 1` -> [0, 1]; malformed text as is."""
    parts = [parse_devices(p) for p in text.split("|")]
    if any(isinstance(p, str) for p in parts):
        return text
    return parts[0] if len(parts) == 1 else parts


def slots_text(filters: Any) -> str:
    """An order's slots, one per line."""
    if not isinstance(filters, (list, tuple)):
        return "" if filters is None else str(filters)
    lines = []
    for slot in filters:
        group = [slot] if isinstance(slot, Mapping) else slot
        if not isinstance(group, (list, tuple)):
            lines.append(str(group))
            continue
        lines.append(" | ".join(filter_text(f) for f in group))
    return "\n".join(lines)


def parse_slots(text: str) -> list[list[dict[str, Any]]] | str:
    """Slots from `slots_text` (or a JSON list); malformed text comes back as is."""
    stripped = text.strip()
    if stripped.startswith("["):
        return _json_of(stripped, list, text)
    slots = []
    for line in stripped.splitlines():
        if not line.strip():
            continue
        group = [parse_filter(part) for part in line.split("|")]
        if any(isinstance(f, str) for f in group):
            return text
        slots.append(group)
    return slots
