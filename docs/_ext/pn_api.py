"""Sphinx extension of the piper_nb docs: the public names docs/api.md does not list yet.

docs/api.md documents the names of `piper_nb.__all__` in groups. Where the page has the
line `<!-- pn-api-rest -->`, this extension puts (when Sphinx reads the page) autodoc
entries for every name of `piper_nb.__all__` that the page does not name as
`piper_nb.<name>`, so a name added to the package is in the reference at once.
tests/docs/test_site.py checks that every name is.
"""

from __future__ import annotations

import inspect
import re

MARK = "<!-- pn-api-rest -->"


def _entries(text: str) -> str:
    import piper_nb

    named = set(re.findall(r"piper_nb\.(\w+)", text))
    lines = []
    for name in piper_nb.__all__:
        if name in named:
            continue
        obj = getattr(piper_nb, name)
        kind = ("automodule" if inspect.ismodule(obj) else
                "autoclass" if inspect.isclass(obj) else
                "autofunction" if callable(obj) else "autodata")
        lines.append(f".. {kind}:: piper_nb.{name}")
        lines += ["   :members:", ""] if kind in ("automodule", "autoclass") else [""]
    if not lines:
        return "Every public name is documented above."
    return "```{eval-rst}\n" + "\n".join(lines) + "\n```"


def add_the_rest(app, docname: str, source: list[str]) -> None:
    if MARK in source[0]:
        source[0] = source[0].replace(MARK, _entries(source[0]))


def always_reread(app, env, added, changed, removed) -> list[str]:
    """The page follows `piper_nb.__all__`, which Sphinx does not watch: read it each time."""
    return [d for d in env.found_docs if d == "api"]


def setup(app) -> dict:
    app.connect("source-read", add_the_rest)
    app.connect("env-get-outdated", always_reread)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
