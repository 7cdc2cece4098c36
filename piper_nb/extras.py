"""The optional parts of piper_nb and the packages each needs: the core (compile, check,
simulate, train on local workers) needs torch, numpy and cloudpickle only; the notebook UI,
the ipyparallel cluster, TensorBoard logging and the docs are extras
(`pip install 'piper_nb[lab]'`, `[cluster]`, `[tensorboard]`, `[docs]`, `[all]`).

`require(module, what)` imports `module`, or raises `MissingExtra`, one line naming the
extra to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "require"]

EXTRAS = {   # extra -> the top-level packages it brings (pyproject.toml lists them)
    "lab": ("ipywidgets", "anywidget", "plotly", "graphviz", "jupyterlab"),
    "cluster": ("ipyparallel",),
    "tensorboard": ("tensorboard",),
}


class MissingExtra(ImportError):
    """A part of piper_nb whose optional packages are not installed."""


def require(module: str, what: str) -> ModuleType:
    """`module` imported, or MissingExtra: "`what` needs <package>: pip install ..."."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        top = (err.name or "").split(".")[0]
        extra = next((e for e, pkgs in EXTRAS.items() if top in pkgs), None)
        if extra is None or top != module.split(".")[0]:
            raise
        raise MissingExtra(f"{what} needs {top}, which is not installed: pip install "
                           f"'piper_nb[{extra}]'") from None
