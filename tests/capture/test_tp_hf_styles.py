"""Hugging Face's tensor-parallel spellings: every style a `transformers` config's
`base_model_tp_plan` names is either read as one of ours or refused by name, saying what
to write instead; never an "unknown style"."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import piper_nb as pn
from piper_nb.tp.styles import ACCEPTED, REFUSED, parse_style

transformers = pytest.importorskip("transformers")


def hf_styles() -> dict[str, set[str]]:
    """Every style in every config class's `base_model_tp_plan` -> the families naming it."""
    import transformers.models as families

    out: dict[str, set[str]] = {}
    for fam in pkgutil.iter_modules(families.__path__):
        try:
            pkg = importlib.import_module(f"transformers.models.{fam.name}")
        except Exception:   # noqa: BLE001 - a family needing an optional dependency
            continue
        for sub in pkgutil.iter_modules(getattr(pkg, "__path__", [])):
            if not sub.name.startswith("configuration_"):
                continue
            try:
                mod = importlib.import_module(f"{pkg.__name__}.{sub.name}")
            except Exception:   # noqa: BLE001
                continue
            for cls in vars(mod).values():
                plan = getattr(cls, "base_model_tp_plan", None) if isinstance(cls, type) else None
                for style in (plan or {}).values():
                    out.setdefault(style, set()).add(fam.name)
    return out


def test_every_style_in_transformers_plans_is_read_or_refused_by_name():
    styles = hf_styles()
    assert {"colwise", "rowwise", "rowwise_split_input"} <= styles.keys()   # the walk found them
    unknown = {s: sorted(f)[:3] for s, f in styles.items() if s not in ACCEPTED | REFUSED}
    assert not unknown, f"styles neither read nor refused: {unknown}"
    for style in styles.keys() & REFUSED:
        with pytest.raises(pn.PlanError, match=f"Hugging Face's style '{style}' is not "
                           "supported: .*(use|keep|give)"):
            parse_style(style)
    for style in styles.keys() & ACCEPTED:
        parse_style(style)


def test_rowwise_split_input_says_what_to_write_instead():
    """Before: "unknown style 'rowwise_split_input'; use colwise, ..."."""
    with pytest.raises(pn.PlanError, match="rowwise_split_input' is not supported: a rowwise "
                       "layer whose input is whole on every device .* give the layer before it "
                       "colwise:k .* and this one rowwise"):
        pn.tensor_parallel({}, [0, 1], plan={"layers.*.mlp.down_proj": "rowwise_split_input"})
