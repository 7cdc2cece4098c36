"""Pipeline stages that are not contiguous in the forward: a PlanError naming the cut.

Regions run in dependency order (`capture.split`). A stage re-entered after a later stage
is legal when it only calls again what it already ran (a layer shared by two stages, like
tied weights); a module of stage s that first runs after stage t > s is a cut made in
another order than the forward's (OPT declares `decoder.final_layer_norm` before
`decoder.layers`, so a cut in definition order puts the final norm in stage 0). Such a plan
sends activations 0 -> 1 -> 0 -> 1 and deadlocks under any schedule that places a stage
on one device, so it is refused here, before any schedule check, with the modules, the
stage order found and the fix.
"""

from __future__ import annotations

from piper_nb.errors import PlanError

__all__ = ["check_stage_order"]


def check_stage_order(capture) -> None:
    regions = capture.regions
    producer = {v: r.index for r in regions for v in r.outputs}
    stage = {r.index: dict(r.tags).get("PP") for r in regions}
    seen: dict[int, set[str]] = {}         # stage -> modules its earlier regions ran
    for r in regions:
        s = stage[r.index]
        if not isinstance(s, int):
            continue
        later = [producer[v] for v in r.inputs
                 if v in producer and isinstance(stage[producer[v]], int)
                 and stage[producer[v]] > s]
        new = [m for m in r.modules if m not in seen.get(s, set())]
        if later and new:
            _refuse(capture, r, regions[later[0]], new, stage)
        seen.setdefault(s, set()).update(r.modules)


def _refuse(capture, region, before, new, stage) -> None:
    s, t = stage[region.index], stage[before.index]
    order = [stage[r.index] for r in capture.regions if isinstance(stage[r.index], int)]
    order = [p for i, p in enumerate(order) if i == 0 or p != order[i - 1]]
    mods = _units(capture, region) or new
    raise PlanError(
        f"pipeline stage {s} is not contiguous in the forward: {_names(mods)} (PP {s}) "
        f"first runs after {_names(_units(capture, before))} (PP {t}), so the stages run "
        f"in the order {', '.join(map(str, order))}. A stage must be one contiguous part "
        f"of the forward: tag modules by execution order (pn.cut_stages(model, n, example=batch) "
        f"cuts in it), or tag {_names(mods)} with PP {t} or later")


def _units(capture, region) -> list[str]:
    """The outermost modules only `region` runs (its layers, not their sublayers)."""
    elsewhere = {m for r in capture.regions if r.index != region.index for m in r.modules}
    own = [m for m in region.modules if m not in elsewhere]
    mine = set(own)
    return [m for m in own if not any(a in mine for a in _ancestors(m))]


def _ancestors(name: str) -> list[str]:
    bits = name.split(".")
    return [".".join(bits[:i]) for i in range(1, len(bits))]


def _names(mods: list[str]) -> str:
    if len(mods) <= 3:
        return ", ".join(mods)
    return f"{mods[0]}, ..., {mods[-1]} ({len(mods)} modules)"
