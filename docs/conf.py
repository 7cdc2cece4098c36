"""Sphinx configuration of the piper_nb docs (`make docs` builds docs/_build/html).

The notebooks are pages with their stored outputs (never executed here: see
docs/_ext/pn_notebooks.py), the API reference comes from the docstrings, and warnings are
errors (`make docs` passes `-W --keep-going`).
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "piper_nb"
author = "the piper_nb authors"
copyright = "the piper_nb authors"
release = tomllib.loads((HERE.parent / "pyproject.toml").read_text())["project"]["version"]
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "pn_notebooks",
    "pn_api",
]

exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

# notebooks: the stored outputs, as they are in notebooks/ (pn_notebooks stages them)
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# API reference: from the docstrings, in source order
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
autosummary_generate = False
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "pydata_sphinx_theme"
html_title = f"piper_nb {release}"
html_static_path = ["_static"]
html_css_files = ["piper_nb.css"]
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_sidebars = {"**": ["sidebar-nav-bs"]}
default_role = "literal"
